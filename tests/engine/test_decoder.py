"""The engine's decoder forward computes what transformers' forward does: the same logits for every supported
architecture (Llama, Mistral, Qwen2's biases, Qwen3's q/k-norms), packed and fused or not, in float32 and bfloat16;
and it hands each layer's attention the inputs transformers' attention gets."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from common import tiny_model
from kvcompress.engine.decoder import Decoder, _norm, _Rotary
from kvcompress.engine.packed import FusedLinear, can_pack
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


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
        for out, own, layer in zip(fused(x), plain(x), layers):
            assert torch.equal(own, layer(x))
            torch.testing.assert_close(out, own, atol=1e-5, rtol=1e-5)
        assert torch.equal(fused.joint(x), torch.cat(fused(x), dim=-1)) and torch.equal(plain.joint(x), torch.cat(plain(x), dim=-1))


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["llama", "qwen3"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]), tokens=st.integers(1, 40),
       start=st.integers(0, 400), seed=st.integers(0, 2**16))
def test_the_rotary_and_the_norms_are_transformers_bit_for_bit(kind, dtype, tokens, start, seed):
    """``_Rotary`` (a roll and a signed sine) and ``_norm`` (``F.rms_norm``) compute transformers' numbers exactly."""
    model = tiny_model(kind, layers=1, seed=seed % 5).to(dtype)
    stack, attention = model.model, model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, 64, generator=gen) * 4).to(dtype)
    positions = torch.arange(start, start + tokens)
    q, k = (torch.randn(tokens, h, 16, generator=gen).to(dtype) for h in (4, 2))
    cos, sin = stack.rotary_emb(hidden[None], positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rotary = _Rotary(stack.rotary_emb, hidden, positions)
    assert torch.equal(rotary(q), expected_q[0].transpose(0, 1)) and torch.equal(rotary(k), expected_k[0].transpose(0, 1))
    norms = [model.model.layers[0].input_layernorm, stack.norm] + ([attention.q_norm] if kind == "qwen3" else [])
    for module in norms:
        x = hidden if module.weight.shape[0] == 64 else q
        assert _norm(module) is not module and torch.equal(_norm(module)(x), module(x))


def test_a_norm_that_is_not_transformers_rmsnorm_runs_its_own_forward():
    layer_norm = torch.nn.LayerNorm(8)
    assert _norm(layer_norm) is layer_norm
