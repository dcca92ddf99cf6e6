"""The read path: reference attention, log-sum-exp merging, log-weights, SDPA fast path."""

import math

import pytest
import torch

from kvcompress.attention import attend_reference, group_queries, merge_lse, read
from kvcompress.cache import LayerCache
from transformers.integrations.sdpa_attention import repeat_kv


class _Module:
    """What transformers' SDPA call reads from an attention module."""

    num_key_value_groups = 2
    training = False
    is_causal = True


def _dense_attention(q, k, v, scaling):
    """Plain softmax attention in float64, queries [B, Hq, q, d] over keys [B, Hq, L, d], no mask."""
    w = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scaling, dim=-1)
    return w @ v.double()


def test_group_queries_matches_repeat_kv():
    q = torch.randn(2, 6, 3, 4)
    k = torch.randn(2, 2, 5, 4)
    grouped = group_queries(q, 2)  # [B, H, G, q, d]
    expanded = repeat_kv(k, 3)  # query head j reads KV head j // 3
    for j in range(6):
        assert torch.equal(grouped[:, j // 3, j % 3], q[:, j])
        assert torch.equal(expanded[:, j], k[:, j // 3])


def test_reference_equals_dense_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 2, 1, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    out, lse, _ = attend_reference(q, k, v, 0.3, query_positions=torch.tensor([[10]]), key_positions=torch.arange(10).expand(1, 2, 10))
    ref = _dense_attention(q.reshape(1, 4, 1, 8), repeat_kv(k, 2), repeat_kv(v, 2), 0.3)
    assert torch.allclose(out.reshape(1, 4, 1, 8).double(), ref, atol=1e-5)
    logits = (q.double() @ k.double()[:, :, None].transpose(-1, -2)) * 0.3
    assert torch.allclose(lse.double(), torch.logsumexp(logits, -1).squeeze(-1).view_as(lse.double()), atol=1e-5)


def test_merge_of_disjoint_parts_equals_attention_over_union():
    """Attending two halves and merging by LSE is exact: the summary path's foundation."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 1, 3, 2, 8), torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8)
    pos = torch.arange(20).expand(1, 1, 20)
    qpos = torch.tensor([[30, 31]])
    whole, lse_whole, _ = attend_reference(q, k, v, 0.5, query_positions=qpos, key_positions=pos)
    a, lse_a, _ = attend_reference(q, k[:, :, :7], v[:, :, :7], 0.5, query_positions=qpos, key_positions=pos[..., :7])
    b, lse_b, _ = attend_reference(q, k[:, :, 7:], v[:, :, 7:], 0.5, query_positions=qpos, key_positions=pos[..., 7:])
    merged, lse = merge_lse(a, lse_a, b, lse_b)
    assert torch.allclose(merged, whole, atol=1e-6)
    assert torch.allclose(lse, lse_whole, atol=1e-6)


def test_merge_with_empty_side_is_identity():
    out = torch.randn(1, 1, 1, 1, 4)
    lse = torch.tensor([[[[2.0]]]])
    merged, merged_lse = merge_lse(out, lse, torch.full_like(out, float("nan")), torch.full_like(lse, float("-inf")))
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)


class _ExactSummary:
    """A summary that is exact attention over a held-out set (what MomentKV approximates)."""

    def __init__(self, keys, values, positions):
        self.keys, self.values, self.positions = keys, values, positions

    def attend(self, query, scaling):
        qpos = torch.full(query.shape[:1] + query.shape[3:4], 10**6)
        out, lse, _ = attend_reference(query, self.keys, self.values, scaling, query_positions=qpos, key_positions=self.positions)
        return out, lse

    def nbytes(self):
        return 0


def test_summary_term_merges_through_lse():
    """Retained entries + an exact summary of the evicted ones reproduce full attention."""
    torch.manual_seed(2)
    k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    pos = torch.arange(16).expand(1, 16)
    q = torch.randn(1, 4, 1, 8)
    full = LayerCache(0, 2, 8)
    full.append(k, v, pos)
    part = LayerCache(0, 2, 8)
    part.append(k[:, :, 6:], v[:, :, 6:], pos[:, 6:])
    part.summary = _ExactSummary(k[:, :, :6], v[:, :, :6], torch.arange(6).expand(1, 2, 6))
    qpos = torch.tensor([[16]])
    out_full, _ = read(_Module(), full, q, qpos, 0.35)
    out_part, _ = read(_Module(), part, q, qpos, 0.35)
    assert torch.allclose(out_part, out_full, atol=1e-6)


def test_log_weight_equals_duplicated_entry():
    """An entry with log-weight log p attends like p copies of it (KeepKV's votes)."""
    torch.manual_seed(3)
    k, v = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    q = torch.randn(1, 1, 1, 1, 8)
    pos = torch.arange(5).expand(1, 1, 5)
    weights = torch.tensor([[[0.0, math.log(3.0), 0.0, 0.0, 0.0]]])
    out, _, _ = attend_reference(q, k, v, 0.4, query_positions=torch.tensor([[9]]), key_positions=pos, log_weights=weights)
    dup_k = torch.cat([k, k[:, :, 1:2], k[:, :, 1:2]], dim=2)
    dup_v = torch.cat([v, v[:, :, 1:2], v[:, :, 1:2]], dim=2)
    ref, _, _ = attend_reference(q, dup_k, dup_v, 0.4, query_positions=torch.tensor([[9]]), key_positions=torch.arange(7).expand(1, 1, 7))
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("num_queries", [1, 3])
def test_sdpa_fast_path_matches_reference(num_queries):
    """The SDPA path (uniform heads) and the float32 reference agree, causal by positions."""
    torch.manual_seed(4)
    layer = LayerCache(0, 2, 16)
    layer.append(torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16), torch.arange(12).expand(2, 12))
    keep = torch.rand(2, 2, 12) < 2  # keep all, but reorder nothing
    layer.retain(keep)
    new_k, new_v = torch.randn(2, 2, num_queries, 16), torch.randn(2, 2, num_queries, 16)
    qpos = torch.arange(12, 12 + num_queries).expand(2, num_queries)
    layer.append(new_k, new_v, qpos)
    q = torch.randn(2, 4, num_queries, 16)
    fast, probs = read(_Module(), layer, q, qpos, 0.25, return_probs=True)
    grouped = q.view(2, 2, 2, num_queries, 16)
    view = layer.padded_view()
    slow, _, ref_probs = attend_reference(
        grouped, view.keys, view.values, 0.25, query_positions=qpos, key_positions=view.positions, return_probs=True
    )
    assert torch.allclose(fast, slow.reshape(2, 4, num_queries, 16).transpose(1, 2), atol=1e-5)
    assert torch.allclose(probs, ref_probs)


def test_hidden_future_keys_get_no_weight():
    q, k, v = torch.randn(1, 1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    _, _, probs = attend_reference(
        q, k, v, 1.0, query_positions=torch.tensor([[0, 1]]), key_positions=torch.tensor([[[0, 1, 2]]]), return_probs=True
    )
    assert probs[0, 0, 0, 0].tolist()[1:] == [0.0, 0.0]
    assert probs[0, 0, 0, 1, 2] == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(1, 1, 1, 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_nan_with_extreme_logits_in_half_precision(dtype):
    q = torch.full((1, 1, 1, 1, 8), 100.0, dtype=dtype)
    k = torch.cat([torch.full((1, 1, 2, 8), 100.0), torch.full((1, 1, 2, 8), -100.0)], dim=2).to(dtype)
    v = torch.randn(1, 1, 4, 8).to(dtype)
    out, lse, _ = attend_reference(q, k, v, 1.0, query_positions=torch.tensor([[9]]), key_positions=torch.arange(4).expand(1, 1, 4))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
