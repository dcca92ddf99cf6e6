"""bench: rows carry same-run ratios to full, and compression really holds fewer bytes."""


from common import tiny_model
from kvcompress import get_method
import torch

from kvcompress.bench import bench, cpu_description


def test_bench_rows_and_ratios():
    model = tiny_model()
    methods = [get_method("full"), get_method("snapkv", budget=16), get_method("h2o", budget=16)]
    rows = bench(model, None, methods, context_tokens=96, batch_size=2, decode_tokens=4, progress=False)
    assert [r["method"] for r in rows] == ["hf_dynamic_cache", "full", "snapkv", "h2o"]
    plain, full, snap, h2o = rows
    assert plain["kv_bytes"] == full["kv_bytes_full"]  # the same keys and values as transformers holds
    assert full["kv_bytes_vs_full"] == 1.0 and full["decode_ms_per_token_vs_full"] == 1.0
    assert snap["kv_bytes"] < full["kv_bytes"] / 4
    assert snap["kv_bytes_full"] == full["kv_bytes_full"] == 2 * 2 * 96 * 2 * 2 * 16 * 4
    assert all(r["prefill_s"] > 0 and r["decode_ms_per_token"] > 0 and r["peak_bytes"] >= 0 for r in rows)
    assert snap["compress_vs_full_prefill"] is not None


def test_bench_refuses_contexts_beyond_positions():
    model = tiny_model()
    try:
        bench(model, None, [get_method("full")], context_tokens=600, decode_tokens=4, progress=False)
    except ValueError as error:
        assert "exceeds the model's 512 positions" in str(error)
    else:
        raise AssertionError("expected a ValueError")


def test_bench_reports_the_bytes_keepkv_keeps_off_the_device_for_refresh():
    model = tiny_model()
    methods = [get_method("full"), get_method("keepkv", budget=16, window=8, refresh_every=2)]
    rows = bench(model, None, methods, context_tokens=64, decode_tokens=4, progress=False)
    full, keep = rows[1], rows[2]
    assert full["offloaded_bytes"] == 0
    # the uncompressed K/V of all 64 + 4 tokens (float32), positions and validity, and the last 8 queries
    assert keep["offloaded_bytes"] >= 2 * (2 * 68 * 2 * 16 * 4) + 2 * (8 * 4 * 16 * 4)
    assert keep["kv_bytes"] < full["kv_bytes"] / 2


def test_a_result_file_names_the_cpu_and_its_vector_instructions():
    """Timings compare only on one kind of CPU: bench.json says which (model name, family and model numbers where the
    system gives them, and ATen's capability: AVX2, AVX512…)."""
    described = cpu_description()
    assert described.endswith(f"({torch.backends.cpu.get_cpu_capability()})") and len(described) > len("(AVX2)") + 1
    try:
        with open("/proc/cpuinfo") as handle:
            family = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("cpu family")), None)
    except OSError:
        family = None
    if family is not None:
        assert f"family {family} model " in described

