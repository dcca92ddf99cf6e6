"""kvc.generate on the embedded model: exactness against model.generate, protocol, errors."""

import argparse

import pytest
import torch

import kvcompress as kvc
from kvcompress.cli import main as cli_main
from kvcompress.demo import needle_prompt
from kvcompress.methods import REGISTRY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt(embedded):
    _, tokenizer = embedded
    return needle_prompt(tokenizer, context_tokens=600, seed=1)


def test_full_reproduces_model_generate_token_for_token(embedded, prompt):
    model, tokenizer = embedded
    out = kvc.generate(model, tokenizer, prompt.context, prompt.question, "full", max_new_tokens=24)
    reference = model.generate(torch.tensor([out.prompt_ids]), max_new_tokens=24, do_sample=False)
    assert out.token_ids == reference[0, len(out.prompt_ids):].tolist()
    assert prompt.answer in out.text
    # a 4-byte slot index and a 4-byte position per 512-byte fp32 entry, plus 8 bytes of length per head and layer
    tokens = len(out.prompt_ids) + len(out.token_ids) - 1
    assert out.stats["kv_bytes_end"] == 30 * 3 * (tokens * (512 + 4 + 4) + 8)
    assert out.stats["kr"] == pytest.approx(1 + 8 / 512, abs=1e-4)


@pytest.mark.parametrize("name", [m for m in kvc.available_methods() if REGISTRY[m].needs_budget])
def test_every_method_at_ratio_one_equals_full(embedded, prompt, name):
    model, tokenizer = embedded
    full = kvc.generate(model, tokenizer, prompt.context, prompt.question, "full", max_new_tokens=12)
    out = kvc.generate(model, tokenizer, prompt.context, prompt.question, kvc.get_method(name, ratio=1.0), max_new_tokens=12)
    assert out.token_ids == full.token_ids


def test_query_agnostic_compresses_only_the_context(embedded, prompt):
    model, tokenizer = embedded
    out = kvc.generate(model, tokenizer, prompt.context, prompt.question, kvc.get_method("snapkv", budget=64), max_new_tokens=4)
    stats = out.stats
    per_layer_full = stats["context_tokens"] * 3 * 64 * 2 * 4
    assert stats["kv_bytes_full"] == 30 * per_layer_full
    assert stats["kv_bytes"] == 30 * 3 * 64 * (2 * 64 * 4 + 4 + 4) + 30 * 3 * 8  # entries + slot indices + positions + head lengths
    assert stats["kr"] == stats["kv_bytes"] / stats["kv_bytes_full"]
    assert stats["kr_end"] > stats["kr"]  # the question and answer were appended uncompressed


def test_bad_inputs_get_clear_errors(embedded, prompt):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="context is empty"):
        kvc.generate(model, tokenizer, "  ", "What?", "full")
    with pytest.raises(ValueError, match="exceeds the model's 8192 positions"):
        kvc.generate(model, tokenizer, "word " * 9000, "What?", "full")
    with pytest.raises(ValueError, match="budget must be a positive"):
        kvc.get_method("snapkv", budget=0)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        kvc.get_method("snapkv", ratio=1.5)
    with pytest.raises(ValueError, match="exactly one of"):
        kvc.get_method("snapkv")
    with pytest.raises(ValueError, match="available methods: full, streamingllm"):
        kvc.get_method("snapkvv", budget=4)
    with pytest.raises(ValueError, match="has no option windw"):
        kvc.get_method("snapkv", budget=4, windw=3)


def test_budget_at_or_above_context_keeps_everything_and_says_so(embedded, prompt):
    model, tokenizer = embedded
    out = kvc.generate(model, tokenizer, prompt.context, prompt.question, kvc.get_method("snapkv", budget=5000), max_new_tokens=4)
    assert out.stats["kr"] == pytest.approx(1 + 8 / 512, abs=1e-3)
    assert any("everything kept" in note for note in out.stats["notes"])


def test_cli_generate_prints_answer_and_stats(embedded, prompt, tmp_path, capsys):
    context = tmp_path / "context.txt"
    context.write_text(prompt.context)
    code = cli_main(["generate", "--context-file", str(context), "--question", prompt.question,
                     "--method", "full", "--max-new-tokens", "20"])
    captured = capsys.readouterr()
    assert code == 0 and prompt.answer in captured.out
    assert "[full] kr=1.016" in captured.err
    code = cli_main(["generate", "--context-file", str(context), "--question", prompt.question,
                     "--method", "snapkv", "--budget", "64", "--json", "--max-new-tokens", "4"])
    stats = __import__("json").loads(capsys.readouterr().out)["stats"]
    assert code == 0 and stats["method"] == "snapkv@64" and stats["kr"] < 0.2


def test_cli_reports_missing_file(capsys):
    assert cli_main(["generate", "--context-file", "/nonexistent/ctx.txt", "--question", "q"]) == 2
    assert "context file not found" in capsys.readouterr().err


def test_generate_takes_a_method_name_with_its_size(embedded, prompt):
    model, tokenizer = embedded
    by_name = kvc.generate(model, tokenizer, prompt.context, prompt.question, "snapkv:window=16", ratio=0.25, max_new_tokens=3)
    by_object = kvc.generate(model, tokenizer, prompt.context, prompt.question, kvc.get_method("snapkv", ratio=0.25, window=16),
                             max_new_tokens=3)
    assert by_name.token_ids == by_object.token_ids and by_name.stats["method"] == "snapkv@0.25[window=16]"
    with pytest.raises(ValueError, match="exactly one of"):
        kvc.generate(model, tokenizer, prompt.context, prompt.question, "snapkv")
    with pytest.raises(ValueError, match="a method object carries its own size"):
        kvc.generate(model, tokenizer, prompt.context, prompt.question, kvc.get_method("snapkv", ratio=0.25), budget=8)


def test_cli_methods_lists_each_method_with_its_size_and_options(capsys):
    assert cli_main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in kvc.available_methods():
        assert f"\n{name} " in "\n" + out
    words = " ".join(out.split())  # options wrap across lines
    assert "window=32 kernel=7 pooling='max'" in words and "bits=2 group_size=32 residual=128" in words
    assert "no size (it keeps every entry)" in out and "no size (it chooses its own budget" in out


def test_every_flag_with_a_value_shows_its_default_in_help():
    from kvcompress.cli import build_parser

    parser = build_parser()
    verbs = parser._subparsers._group_actions[0].choices
    for verb, sub in verbs.items():
        text = sub.format_help()
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.nargs != 0 and action.default is not None and action.default != argparse.SUPPRESS:
                shown = formatter._get_help_string(action) % {"default": action.default}
                assert "default" in shown, (verb, action.dest)
        assert "default: 0" in text or "--seed" not in text  # --seed: no help of its own and a falsy default


def test_dtype_and_device_flags_load_and_run_in_that_dtype(tiny_checkpoint, tmp_path, capsys):
    from kvcompress.cli import _load, build_parser

    path = str(tiny_checkpoint())
    assert next(_load(build_parser().parse_args(["generate", "--model", path, "--question", "q", "--context", "c"]))[0]
                .parameters()).dtype == torch.float32  # auto on the CPU: float32
    context = tmp_path / "context.txt"
    context.write_text(" ".join(f"w{i % 50}" for i in range(120)))
    full_bytes = {}
    for dtype in ("float32", "bfloat16"):
        code = cli_main(["generate", "--model", path, "--context-file", str(context), "--question", "w1", "--method", "snapkv",
                         "--ratio", "0.5", "--dtype", dtype, "--json", "--max-new-tokens", "3"])
        assert code == 0
        stats = __import__("json").loads(capsys.readouterr().out)["stats"]
        full_bytes[dtype] = stats["kv_bytes_full"]
    assert full_bytes["bfloat16"] * 2 == full_bytes["float32"]  # the cache is held in the model's dtype
    for device, message in (("cuda", "sees no CUDA GPU"), ("gpu0", "is not a device")):
        if device == "cuda" and torch.cuda.is_available():
            continue
        assert cli_main(["generate", "--model", path, "--context-file", str(context), "--question", "q", "--device", device]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["bench", "--repeats", "0"], "argument --repeats: 0 must be ≥ 1"),
    (["bench", "--batch-size", "0"], "argument --batch-size: 0 must be ≥ 1"),
    (["eval", "--budgets", "64,abc"], "argument --budgets: 'abc' in '64,abc': give comma-separated whole numbers"),
    (["eval", "--ratios", "0.1,x"], "argument --ratios: 'x' in '0.1,x': give comma-separated numbers"),
    (["bench", "--context-tokens", "3k"], "argument --context-tokens: '3k'"),
    (["eval", "--samples", "many"], "argument --samples: 'many' is not a whole number"),
])
def test_bad_flag_values_are_usage_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("verb", [["eval", "--tasks", "vt", "--samples", "1"], ["diagnose"], ["bench"]])
def test_out_pointing_at_a_file_is_refused_before_any_work(verb, tmp_path, capsys, monkeypatch):
    import kvcompress.cli as cli

    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded before --out was checked"))
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert cli_main([*verb, "--methods", "snapkv", "--ratios", "0.5", "--out", str(target)]) == 2
    assert "is a file: give a directory" in capsys.readouterr().err and target.read_text() == "keep me"


def test_runtime_failures_exit_1_in_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["generate", "--model", "no-such-org/no-such-model", "--context", "c", "--question", "q"]
    assert cli_main(argv) == 1  # bad input is 2; a model that cannot be fetched is a failure while running
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "could not load 'no-such-org/no-such-model'" in error
    with pytest.raises(OSError, match="could not load"):
        cli_main([*argv, "--debug"])
    with pytest.raises(ValueError, match="not a device"):
        cli_main(["generate", "--context", "c", "--question", "q", "--device", "gpu0", "--debug"])
