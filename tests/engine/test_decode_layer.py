"""A decoding step's layers as one compiled call each (``csrc/decode_layer.cpp``, ``_Layer.compiled``): the same logits as
the Python layers bit for bit (the call runs the same compiled functions in the same order), for Llama, Qwen2's biases
and Qwen3's head norms, plain and KIVI-coded entries; layers it cannot take (a method acting in every layer, DeltaKV's
entries, entries due for coding between the layer's write and its read, prompt pieces) run in Python."""

import pytest
import torch

from common import tiny_codec, tiny_model
from conftest import tiny_tokenizer
import kvcompress as kvc
import kvcompress.engine.packed as packed
from kvcompress.engine import SamplingParams
from kvcompress.kernels import cpu_kernels

RUNS = [] if cpu_kernels() is None else [getattr(torch, name) for name in cpu_kernels().linear_rows_dtypes()]
pytestmark = pytest.mark.skipif(not RUNS, reason="the compiled layer needs the CPU kernels and linear_rows (AVX2 and FMA)")


@pytest.fixture
def streamed(monkeypatch):
    """Every dtype linear_rows runs here streamed (this CPU may pick oneDNN's products for float32 otherwise)."""
    monkeypatch.setattr(packed, "streamed_dtypes", lambda: set(RUNS))


class Counted:
    """A compiled layer that counts its calls."""

    def __init__(self, layer):
        self.layer, self.calls = layer, 0

    def __call__(self, *args):
        self.calls += 1
        return self.layer(*args)


def decoding_logits(llm, prompts, method, compiled: bool, new: int = 6) -> tuple[list[torch.Tensor], int]:
    """Every decoding-only step's logits of one run (the layers compiled or not) and the compiled layers' calls."""
    recorded, real = [], llm.runner.step

    def step(requests, pieces):
        logits, finals = real(requests, pieces)
        if requests and not pieces:
            recorded.append(logits.clone())
        return logits, finals

    decoder = llm.runner.decoder
    layers, stack, whole = decoder.layers, decoder.stack, decoder.stack_call
    saved = [layer.compiled for layer in layers]
    for layer in layers:
        layer.compiled = Counted(layer.compiled) if compiled else None
    stacked = Counted(whole)
    decoder.stack, decoder.stack_call = (stack if compiled else None), stacked
    llm.runner.step = step
    try:
        llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True), method=method)
    finally:
        del llm.runner.step, decoder.stack_call
        decoder.stack = stack
        calls = sum(layer.compiled.calls for layer in layers) + stacked.calls * len(layers) if compiled else 0
        for layer, kept in zip(layers, saved):
            layer.compiled = kept
    return recorded, calls


def engine(kind: str, dtype: torch.dtype, seed: int = 0):
    model = tiny_model(kind, layers=2, seed=seed).to(dtype)
    return kvc.LLM(model_and_tokenizer=(model, tiny_tokenizer()), kv_memory="4MiB", max_num_seqs=32)


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", RUNS or [torch.float32])
@pytest.mark.parametrize("method", [None, "snapkv:budget=24:window=4", "kivi:bits=2:group_size=16:residual=8",
                                    "snapkv:budget=32:window=4+kivi:bits=4:group_size=16:residual=8"])
def test_a_compiled_decoding_layer_gives_the_python_layers_logits_bit_for_bit(streamed, kind, dtype, method):
    llm = engine(kind, dtype)
    assert all(layer.compiled is not None for layer in llm.runner.decoder.layers)
    batch = prompts([40, 57, 33], seed=len(kind))
    compiled, calls = decoding_logits(llm, batch, method, compiled=True, new=20)
    python, _ = decoding_logits(llm, batch, method, compiled=False, new=20)
    assert len(compiled) == len(python) >= 18
    if method is None or "kivi" not in method:
        assert calls == 2 * len(compiled)  # both layers of every decoding step
    else:  # a layer whose entries are due for coding between its write and its read runs in Python
        assert len(compiled) <= calls < 2 * len(compiled)
    for got, expected in zip(compiled, python):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("method", [None, "snapkv:budget=24:window=4", "kivi:bits=2:group_size=16:residual=8"])
def test_a_step_whose_every_layer_takes_its_reads_runs_the_layers_in_one_call(streamed, method):
    """Where every layer of a decoding step takes the step's reads (no entries due for coding, no summary), the layers run
    as one call (``decode_layers``), which ``test_a_compiled_decoding_layer_gives_the_python_layers_logits_bit_for_bit``
    holds to the Python layers' logits; KIVI's layers, whose entries come due for coding, run one call each."""
    llm = engine("llama", RUNS[0], seed=6)
    decoder = llm.runner.decoder
    assert decoder.stack is not None and len(decoder.stack) == len(decoder.layers)
    stacked = Counted(decoder.stack_call)
    decoder.stack_call = stacked
    logits, calls = decoding_logits(llm, prompts([30, 45], seed=6), method, compiled=True, new=12)
    assert len(logits) >= 10
    if method is None or "kivi" not in method:
        assert stacked.calls == len(logits) and calls == 2 * len(logits)
    else:
        assert stacked.calls == 0 and calls > 0


def test_the_stack_of_layers_needs_a_layer_for_each_of_the_steps():
    llm = engine("llama", RUNS[0], seed=7)
    decoder = llm.runner.decoder
    request = llm.add_request(prompts([20], seed=7)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while not llm.request(request).output_ids:
        llm.step()
    captured = []
    real = decoder.stack_call
    decoder.stack_call = lambda hidden, rotary, reads: captured.append((hidden, rotary, reads)) or real(hidden, rotary, reads)
    llm.step()
    hidden, rotary, reads = captured[0]
    with pytest.raises(RuntimeError, match="a layer for each"):
        cpu_kernels().decode_layers(decoder.stack[:1], hidden, None, rotary.cos, rotary.sin, reads)


@pytest.mark.parametrize("method", ["h2o:budget=24", "deltakv:recent=8:chunk=8"])
def test_steps_the_compiled_layer_cannot_take_run_the_python_layers(streamed, method):
    """H2O acts in every layer of a decoding step (column sums); DeltaKV's entries are read by their own kernel."""
    model = tiny_model("llama", layers=2, seed=4)
    if method.startswith("deltakv"):
        method += f':checkpoint="{tiny_codec(model)}"'
    llm = kvc.LLM(model_and_tokenizer=(model, tiny_tokenizer()), kv_memory="4MiB", max_num_seqs=32)
    logits, calls = decoding_logits(llm, prompts([40, 50], seed=4), kvc.get_method(method), compiled=True)
    assert len(logits) >= 4 and calls == 0


def test_more_rows_than_linear_rows_streams_run_the_python_layers(streamed):
    """Past ``rows_streamed`` rows the products are oneDNN's (or a widened product), which the compiled layer does not
    call: such steps run in Python, with the same logits as before."""
    llm = engine("llama", RUNS[0], seed=5)
    limit = llm.runner.decoder.layers[0].compiled_rows
    logits, calls = decoding_logits(llm, prompts([20] * (limit + 2), seed=5), None, compiled=True)
    assert len(logits) >= 4 and all(x.shape[0] == limit + 2 for x in logits) and calls == 0


def test_the_compiled_layer_refuses_what_it_cannot_take():
    layer_class = cpu_kernels().DecodeLayer
    norm, weight = torch.ones(64), [torch.randn(64, 64)]
    with pytest.raises(RuntimeError, match="norms"):
        layer_class([norm], [1e-6], [weight] * 4, [None] * 4, 4, 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="four products"):
        layer_class([norm, norm], [1e-6, 1e-6], [weight] * 3, [None] * 3, 4, 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        layer_class([norm, norm], [1e-6, 1e-6], [weight] * 4, [None] * 4, 3, 2, 16, 0.25)


def small_layer(dtype=torch.float32, seed=0):
    """A compiled layer of D = 64, four query heads and two KV heads of 16, an MLP of 64, random weights."""
    gen = torch.Generator().manual_seed(seed)
    weight = lambda n, k: (torch.randn(n, k, generator=gen) / 8).to(dtype)  # noqa: E731
    norm = torch.ones(64, dtype=dtype)
    layer = cpu_kernels().DecodeLayer([norm, norm], [1e-6, 1e-6], [[weight(128, 64)], [weight(64, 64)], [weight(128, 64)], [weight(64, 64)]],
                                      [None] * 4, 4, 2, 16, 0.25)
    return layer, gen


def call_with_empty_reads(layer, gen, slots, keys, values, dtype=torch.float32):
    """One decoding step of three rows through ``layer`` whose reads hold nothing but the new entries' writes."""
    rows = slots.numel() // 2
    hidden = torch.randn(rows, 64, generator=gen).to(dtype)
    cos, sin = torch.ones(rows, 1, 16, dtype=dtype), torch.zeros(rows, 1, 16, dtype=dtype)
    tables = [torch.zeros(1, 2, 1, dtype=torch.int32) for _ in range(rows)]
    step = cpu_kernels().PagedStep(keys, values, slots.view(1, rows, 2), tables, torch.zeros(1, rows, 2, dtype=torch.long),
                                   [torch.empty(0)] * rows, 27, [], [])
    return layer(hidden, None, cos, sin, step, 0)


@pytest.mark.parametrize("dtype", RUNS or [torch.float32])
def test_the_compiled_layer_writes_each_new_entry_into_its_slot(dtype):
    """Rows in the pool's dtype are copied where they lie; a pool of another dtype takes ``index_copy_`` (float64 here:
    every value exact): both leave the same pool (each of the 3 rows × 2 heads' keys and values in its own slot, every
    other slot untouched)."""
    layer, _ = small_layer(dtype)
    slots = torch.tensor([7, 3, 12, 5, 9, 1])
    pools = []
    for pool_dtype in (dtype, torch.float64):  # the rows' dtype: copied in place; another: through index_copy_
        keys, values = torch.full((16, 16), -1.0, dtype=pool_dtype), torch.full((16, 16), -2.0, dtype=pool_dtype)
        call_with_empty_reads(layer, torch.Generator().manual_seed(3), slots, keys, values, dtype)
        pools.append((keys, values))
    (keys, values), (keys_wide, values_wide) = pools
    assert torch.equal(keys.double(), keys_wide) and torch.equal(values.double(), values_wide)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (keys[untouched] == -1).all() and (values[untouched] == -2).all()
    assert (keys[slots] != -1).any(dim=1).all() and (values[slots] != -2).any(dim=1).all()


def test_the_compiled_layer_refuses_a_slot_outside_the_pool_before_writing():
    layer, gen = small_layer()
    keys, values = torch.zeros(16, 16), torch.zeros(16, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        call_with_empty_reads(layer, gen, torch.tensor([7, 3, 12, 5, 9, 16]), keys, values)
    assert not keys.any() and not values.any()
