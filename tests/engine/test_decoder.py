"""The engine's decoder forward computes what transformers' forward does: the same logits for every supported
architecture (Llama, Mistral, Qwen2's biases, Qwen3's q/k-norms), packed and fused or not, in float32 and bfloat16;
and it hands each layer's attention the inputs transformers' attention gets."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from common import tiny_model
from kvcompress.kernels import cpu_kernels
from kvcompress.engine.decoder import Decoder, _cos_sin, _Norm, _Rotary
from kvcompress.engine.packed import FusedLinear, can_pack
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


def causal_attend(layer, query, key, value, positions, hidden, scaling):
    """Plain causal attention over the row's own tokens ([T, H, d] in, [T, Hq, d] out), GQA by repetition."""
    group = query.shape[1] // key.shape[1]
    q, k, v = (x.transpose(0, 1).float() for x in (query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    return out.transpose(0, 1).to(query.dtype)


@settings(max_examples=16, deadline=None)
@given(kind=st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]), pack=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), tokens=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_the_decoder_gives_transformers_logits(kind, pack, dtype, tokens, seed):
    if pack and not can_pack(torch.nn.Linear(2, 2)):
        pytest.skip("this torch build has no oneDNN packed linear")
    model = tiny_model(kind, layers=2, seed=seed % 7).to(dtype)
    ids = torch.randint(3, 128, (tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = model(ids[None]).logits[0].float()
    keep = torch.arange(tokens).flip(0)[: max(1, tokens // 2)]
    logits = Decoder(model, pack)(ids, torch.arange(tokens), causal_attend, keep).float()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(logits, expected[keep], atol=tolerance * float(expected.abs().max()), rtol=tolerance)


def test_each_layer_attends_with_transformers_inputs():
    """Queries and keys after RoPE, values, positions, attention inputs and scaling as transformers hands them
    to its attention function (recorded by a hook on the attention module)."""
    model = tiny_model("qwen3", layers=2, seed=3)
    ids, positions = torch.randint(3, 128, (7,), generator=torch.Generator().manual_seed(3)), torch.arange(5, 12)
    seen_hf, seen = [], []

    def record(module, args, kwargs, output):
        seen_hf.append(kwargs["hidden_states"][0])

    hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids[None], position_ids=positions[None])
    for hook in hooks:
        hook.remove()

    def attend(layer, query, key, value, positions_, hidden, scaling):
        seen.append((layer, positions_.clone(), hidden.clone(), scaling))
        return causal_attend(layer, query, key, value, positions_, hidden, scaling)

    Decoder(model, pack=False)(ids, positions, attend, torch.tensor([6]))
    assert [s[0] for s in seen] == [0, 1]
    for (layer, got_positions, hidden, scaling), expected in zip(seen, seen_hf):
        assert torch.equal(got_positions, positions) and scaling == model.model.layers[layer].self_attn.scaling
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not can_pack(torch.nn.Linear(2, 2)), reason="this torch build has no oneDNN packed linear")
def test_fused_products_split_into_each_layers_output_and_count_their_copy():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(24, 16, bias=True), torch.nn.Linear(24, 8, bias=False), torch.nn.Linear(24, 8, bias=True)]
    x = torch.randn(5, 24)
    fused, plain = FusedLinear(layers, pack=True), FusedLinear(layers, pack=False)
    assert fused.nbytes == sum(m.weight.numel() * 4 for m in layers) and plain.nbytes == 0
    with torch.no_grad():
        sizes = [m.out_features for m in layers]
        for out, own, layer in zip(fused(x).split(sizes, dim=-1), plain(x).split(sizes, dim=-1), layers):
            assert torch.equal(own, layer(x))
            torch.testing.assert_close(out, own, atol=1e-5, rtol=1e-5)


ROPE_TYPES = [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
              {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
              {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, {"rope_type": "dynamic", "factor": 2.0},
              {"rope_type": "longrope", "long_factor": [1.5] * 8, "short_factor": [1.0] * 8, "original_max_position_embeddings": 64}]


@pytest.mark.parametrize("rope", ROPE_TYPES, ids=[r["rope_type"] for r in ROPE_TYPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cosines_and_sines_are_the_rotary_modules_for_every_rope_type(rope, dtype):
    """Computed from the module's frequencies where they are fixed, through the module where they move with the
    positions (dynamic, long-context): its numbers either way, past the original length too."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                         rope_parameters={**rope, "rope_theta": 10000.0})
    rotary = LlamaRotaryEmbedding(config)
    hidden = torch.randn(8, 64).to(dtype)
    for start in (0, 200, 300):
        positions = torch.arange(start, start + 8)
        expected = [x[0] for x in rotary(hidden[None], positions[None])]
        got = _cos_sin(rotary, hidden, positions)
        assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(got, expected))


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]), tokens=st.integers(1, 40),
       start=st.integers(0, 400), seed=st.integers(0, 2**16))
def test_the_rotary_and_the_norms_are_transformers_bit_for_bit(kind, dtype, tokens, start, seed):
    """``_Rotary`` (a roll and a signed sine; the compiled ``rope`` too) and ``_Norm`` (``F.rms_norm``) compute
    transformers' numbers exactly."""
    model = tiny_model(kind, layers=1, seed=seed % 5).to(dtype)
    stack, attention = model.model, model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, 64, generator=gen) * 4).to(dtype)
    positions = torch.arange(start, start + tokens)
    q, k = (torch.randn(tokens, h, 16, generator=gen).to(dtype) for h in (4, 2))
    cos, sin = stack.rotary_emb(hidden[None], positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for kernels in [None] + ([cpu_kernels()] if cpu_kernels() is not None else []):
        rotary = _Rotary(stack.rotary_emb, hidden, positions, kernels)
        assert torch.equal(rotary(q), expected_q[0].transpose(0, 1)) and torch.equal(rotary(k), expected_k[0].transpose(0, 1))
    norms = [model.model.layers[0].input_layernorm, stack.norm] + ([attention.q_norm] if kind == "qwen3" else [])
    for module in norms:
        x = hidden if module.weight.shape[0] == 64 else q
        s, normed = _Norm(module)(x)
        assert s is x and torch.equal(normed, module(x))
        s, normed = _Norm(module)(x, -x)
        assert torch.equal(s, x - x) and torch.equal(normed, module(x - x))


def last_place(dtype: torch.dtype) -> float:
    """The spacing of the dtype's numbers relative to their size (one unit in the last place)."""
    return torch.finfo(dtype).eps


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built")
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), tokens=st.integers(1, 40),
       width=st.sampled_from([8, 64, 96, 576]), adds=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_the_compiled_norm_and_silu_are_their_pytorch_forms_to_the_last_place(dtype, tokens, width, adds, scale, seed):
    """``add_rms_norm`` and ``silu_mul`` (``csrc/decoder_ops.cpp``) against the plain PyTorch forms they replace: the
    residual sum exact; the norm and SiLU·up within four units of the dtype's last place (the norm's float32 sum runs in
    another order, then two products round; SiLU's exp is another polynomial, less exact where it is tiny), and in bfloat16 and float16 almost every number exactly equal."""
    kernels, gen = cpu_kernels(), torch.Generator().manual_seed(seed)
    hidden, delta = ((torch.randn(tokens, width, generator=gen) * scale).to(dtype) for _ in range(2))
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    module = type("RMSNorm", (torch.nn.Module,), {})()  # the plain form, as ``_Norm`` builds it without kernels
    module.weight, module.variance_epsilon = weight, 1e-6
    s, normed = kernels.add_rms_norm(hidden, delta if adds else None, weight, 1e-6)
    expected_s, expected = _Norm(module)(hidden, delta if adds else None)
    assert torch.equal(s, expected_s)
    gate_up = (torch.randn(tokens, 2 * width, generator=gen) * 4 * scale).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    pairs = [(normed, expected), (kernels.silu_mul(gate_up), F.silu(gate) * up)]
    for got, want in pairs:
        tiny = 1e-3 * last_place(dtype) * float(want.float().abs().max())  # far below the largest number's last place
        torch.testing.assert_close(got.float(), want.float(), rtol=4 * last_place(dtype), atol=tiny)
        if dtype != torch.float32:
            assert int((got != want).sum()) <= max(1, got.numel() // 20)


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built")
def test_the_compiled_ops_refuse_what_they_cannot_take():
    kernels = cpu_kernels()
    with pytest.raises(RuntimeError, match="weight"):
        kernels.add_rms_norm(torch.randn(2, 8), None, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="delta"):
        kernels.add_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernels.rope(torch.randn(3, 2, 8), torch.randn(3, 1, 4), torch.randn(3, 1, 8))
    with pytest.raises(RuntimeError, match="gate_up"):
        kernels.silu_mul(torch.randn(3, 7))


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built")
def test_the_decoder_with_its_compiled_ops_gives_its_pytorch_forms_logits():
    """The whole forward with the compiled norms, RoPE and SiLU against the same forward without them (Qwen3's per-head
    norms included), and a weight in another dtype than the rows falls back to the PyTorch form."""
    for kind, dtype in [("llama", torch.float32), ("qwen3", torch.bfloat16)]:
        model = tiny_model(kind, layers=2, seed=1).to(dtype)
        ids = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(1))
        compiled = Decoder(model, pack=False)(ids, torch.arange(9), causal_attend, torch.arange(9))
        plain = Decoder(model, pack=False, compiled=False)(ids, torch.arange(9), causal_attend, torch.arange(9))
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(compiled.float(), plain.float(), atol=tolerance * float(plain.abs().max()), rtol=tolerance)
    norm = _Norm(model.model.norm, cpu_kernels())
    x = torch.randn(3, 64)  # float32 rows, a bfloat16 weight: PyTorch's promotion, as the module computes
    assert torch.equal(norm(x)[1], model.model.norm(x))


def test_a_norm_that_is_not_transformers_rmsnorm_runs_its_own_forward():
    layer_norm, x, delta = torch.nn.LayerNorm(8), torch.randn(3, 8), torch.randn(3, 8)
    s, normed = _Norm(layer_norm, cpu_kernels())(x, delta)
    assert torch.equal(s, x + delta) and torch.equal(normed, layer_norm(x + delta))
