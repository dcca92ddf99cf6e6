"""Paged decode attention: one decoding query per row reads its entries where they live in the slot pool.

    paged_decode(query, keys, values, tables, lengths, log_weights, scaling, coded=None) -> (out, lse)

The contract (every implementation, tested against ``reference.py``): ``query`` [R, Hq, d] (one decoding
query per row, at or after every entry it reads: no causal mask); ``keys``, ``values`` [S, d] the pool's
plain arrays; ``tables`` one int32 [H, L_r] slot table per row (any strides: a view of the store's own
table, so nothing is concatenated or copied), slot 0 = a hole (padding, or an entry a selection left
out), skipped; ``lengths`` int64 [R, H], the entries of each head; ``log_weights`` one float32 [H, L_r]
per row or None, added to the logits; ``coded`` the coded entries the tables may name, read in place: the one tier of
KIVI blocks (``store.view.KiviBlocks``: an id ``tier << TIER_SHIFT | block · G + offset``, dequantised as it is read), or
DeltaKV's codes and references (``store.view.DeltaKVBlocks``: each coded token named rebuilt once), or None (plain slots only);
``scores`` a float32 [R, Hq, L] buffer (L at least every head's length) that the read fills in place with each entry's
logit (scaled, its log-weight added, -inf on a hole; columns past a head's length untouched), or None: what column
sums are made of (H2O's). Returns ``out`` [R, Hq, d] in the query's dtype and ``lse`` [R, Hq] float32 (-inf where a
head holds nothing, whose output is 0).

* On the CPU: a small C++ kernel (``kvcompress/csrc/paged_decode.cpp``), compiled on first use with the system's C++
  compiler through ``torch.utils.cpp_extension`` and cached (``kernels.py``; ``make setup`` builds it). Each KV head's entries are cut into chunks read in
  parallel (flash-decoding) with an online softmax in float32; a key or value row is loaded once for
  its GQA group, straight from the pool, in the pool's dtype (float32, bfloat16 or float16).
  DeltaKV's tiers take ``csrc/deltakv_rebuild.cpp``'s ``deltakv_decode``: each coded entry's key made where its logit is taken
  (its head's part of the decoder's product in exact integers where the decoder is as a checkpoint stores it), its value
  never (values carry no RoPE: Σ p·v̂ = ((Σ p·z) · W_V) ⊙ s_V + Σ p·m, so the read sums the codes and projects them once).
* On a CUDA GPU: the same in Triton (``paged_triton.py``; tested on the CPU through Triton's interpreter), KIVI or plain.
* Elsewhere, or where neither is available: ``paged_decode_torch``, the same contract in plain PyTorch
  (it gathers the entries first).
"""

from __future__ import annotations

import math

import torch

from ..kernels import NOTHING, cpu_kernels
from ..store.slots import ENTRY_MASK, TIER_SHIFT
from ..store.view import DeltaKVBlocks, KiviBlocks, Pages
from .tables import KIVI_FIELDS, kernel_log_weights, stacked, stacked_log_weights


def triton_kernel():
    """The Triton read (``paged_triton.paged_decode_triton``), or None where Triton is not installed."""
    try:
        from .paged_triton import paged_decode_triton
    except ImportError:
        return None
    return paged_decode_triton


def paged_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: list[torch.Tensor], lengths: torch.Tensor,
                 log_weights: list[torch.Tensor | None] | None, scaling: float, coded: KiviBlocks | DeltaKVBlocks | None = None,
                 scores: torch.Tensor | None = None, longest: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over slot tables (see the module docstring): (out [R, Hq, d], lse [R, Hq] float32).
    ``longest``: the longest head's length where the caller knows it (spares the GPU read a wait for ``lengths``)."""
    if isinstance(coded, DeltaKVBlocks):
        return _deltakv_decode(query, keys, values, tables, lengths, log_weights, scaling, coded, scores)
    if query.device.type == "cuda" and (triton_read := triton_kernel()) is not None:
        return triton_read(query, keys, values, tables, lengths, log_weights, scaling, coded, scores, longest)
    kernel = cpu_kernels() if query.device.type == "cpu" else None
    if kernel is None:
        return paged_decode_torch(query, keys, values, tables, lengths, log_weights, scaling, coded, scores)
    return kernel.paged_decode(query, scaling, keys, values, *compiled_arguments(tables, lengths, log_weights, coded, query.shape[-1]),
                               NOTHING if scores is None else scores)


def compiled_arguments(tables: list[torch.Tensor], lengths: torch.Tensor, log_weights: list[torch.Tensor | None] | None,
                       coded: KiviBlocks | None, head_dim: int) -> tuple:
    """The compiled CPU read's arguments after the keys and values, as ``csrc/paged_decode.cpp`` takes them: the tables,
    the lengths (int64, contiguous), each row's log-weights (empty for none), the tier shift and the KIVI tier's spec and
    arrays (both empty without one)."""
    spec = [] if coded is None else [coded.tier, coded.codec.bits, coded.codec.block_size, coded.codec.channel_group(head_dim)]
    arrays = [] if coded is None else [coded.arrays[name] for name in KIVI_FIELDS]
    return tables, lengths.to(torch.long).contiguous(), kernel_log_weights(log_weights, len(tables)), TIER_SHIFT, spec, arrays


def compiled_step(pages: Pages, slots: torch.Tensor, head_dim: int):
    """A decoding step's reads in place, every layer's, as the compiled layers take them (``csrc/paged_decode.cpp``'s
    ``PagedStep``): ``pages`` of every layer (``SlotTable.step_pages``), ``slots`` [L, R, H] where the step's new entries
    go; None where they hold entries the compiled read does not take (DeltaKV's)."""
    keys, values, coded = pages.arrays()
    if isinstance(coded, DeltaKVBlocks):
        return None
    tables, *rest = compiled_arguments(pages.tables, pages.lengths, pages.log_weights, coded, head_dim)
    return cpu_kernels().PagedStep(keys, values, slots, tables, *rest)


def _deltakv_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: list[torch.Tensor], lengths: torch.Tensor,
                    log_weights: list[torch.Tensor | None] | None, scaling: float, blocks: DeltaKVBlocks,
                    scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over tables naming DeltaKV's tiers: the compiled read for 4-bit codes on the CPU, else the PyTorch one."""
    kernel = cpu_kernels() if query.device.type == "cpu" and blocks.codec.bits == 4 else None
    if kernel is None:
        return paged_decode_torch(query, keys, values, tables, lengths, log_weights, scaling, blocks, scores)
    weights = kernel_log_weights(log_weights, len(tables))
    codes, references, codec = blocks.arrays, blocks.references, blocks.codec
    stored = codec.stored_keys() or (NOTHING, NOTHING, NOTHING)
    return kernel.deltakv_decode(query, scaling, keys, values, tables, lengths.to(torch.long).contiguous(), weights, TIER_SHIFT,
                                 blocks.tier, blocks.reference_tier, codes["code"], codes["code_zero"], codes["code_scale"],
                                 codes["refs"], codes["position"], codes["layer"], references["keys"], references["values"],
                                 references["position"], codec.weights.decoder, codec.weights.scale, *stored, codec.rotary,
                                 NOTHING if scores is None else scores)


def paged_decode_torch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: list[torch.Tensor],
                       lengths: torch.Tensor, log_weights: list[torch.Tensor | None] | None, scaling: float,
                       coded: KiviBlocks | DeltaKVBlocks | None = None, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract in plain PyTorch, float32 math: gather each row's entries (coded ones decoded by their codec in
    PyTorch), mask holes and padding, attend."""
    rows, hq, d = query.shape
    heads = lengths.shape[1]
    groups = hq // heads
    longest = int(lengths.max()) if lengths.numel() else 0
    span = torch.arange(longest, device=query.device)
    slots = stacked(tables, longest, 0).long()
    seen = (span < lengths.to(query.device)[..., None]) & (slots != 0)  # [R, H, L]
    bias = stacked_log_weights(tables, log_weights, longest)
    if bias is None:
        bias = torch.zeros(rows, heads, longest, device=query.device)
    bias = bias.masked_fill(~seen, -math.inf)
    k, v = _gathered(keys, values, slots.masked_fill(~seen, 0).reshape(-1), coded)
    k, v = k.view(rows, heads, longest, d), v.view(rows, heads, longest, d)
    q = query.float().view(rows, heads, groups, d)
    logits = torch.einsum("rhgd,rhld->rhgl", q, k) * scaling + bias[:, :, None]
    if scores is not None:
        _fill_scores(scores, logits.reshape(rows, hq, longest), lengths)
    lse = torch.logsumexp(logits, dim=-1)  # -inf where a head sees nothing
    probs = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("rhgl,rhld->rhgd", probs, v)
    return out.reshape(rows, hq, d).to(query.dtype), lse.reshape(rows, hq)


def entry_weights(scores: torch.Tensor, lse: torch.Tensor, group: int, mean: bool) -> torch.Tensor:
    """Each entry's attention weight exp(logit − lse) from a decoding read's logits ``scores`` [R, Hq, L] (as
    ``paged_decode`` fills them: -inf on holes and past a head's length) and its ``lse`` [R, Hq]: [R, Hq, L], in ``scores``
    itself; with ``mean``, their mean over each KV head's ``group`` query heads, [R, Hq / group, L] (what column sums
    take). 0 on holes, past a head's length and where a query head read nothing. On the CPU one compiled pass
    (``csrc/paged_decode.cpp``); elsewhere ``entry_weights_torch``, the reference."""
    kernel = cpu_kernels() if scores.device.type == "cpu" else None
    if kernel is None:
        return entry_weights_torch(scores, lse, group, mean)
    return kernel.entry_weights(scores, lse.contiguous(), group, mean)


def entry_weights_torch(scores: torch.Tensor, lse: torch.Tensor, group: int, mean: bool) -> torch.Tensor:
    """``entry_weights`` in plain PyTorch: the reference."""
    weights = scores.sub_(lse.nan_to_num(neginf=0.0)[..., None]).exp_()  # in place; exp(-inf) = 0 on holes
    rows, query_heads, length = weights.shape
    return weights.view(rows, query_heads // group, group, length).mean(dim=2) if mean else weights


def _fill_scores(scores: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor) -> None:
    """Write logits [R, Hq, L'] into ``scores`` [R, Hq, L] where each query's head holds entries (the contract's
    in-place fill: columns past a head's length untouched)."""
    rows, hq, longest = logits.shape
    inside = torch.arange(longest, device=logits.device) < lengths.to(logits.device).repeat_interleave(hq // lengths.shape[1], dim=1)[..., None]
    scores[..., :longest] = torch.where(inside, logits, scores[..., :longest])


def _gathered(keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, coded: KiviBlocks | DeltaKVBlocks | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys and values [n, d] of entry ids [n] (int64): plain slots, and coded entries decoded by their codec."""
    is_coded = (ids >> TIER_SHIFT) != 0
    if bool((ids[~is_coded] >= keys.shape[0]).any()) or (bool(is_coded.any()) and (coded is None or not bool(_holds(coded, ids[is_coded]).all()))):
        raise RuntimeError("paged_decode: a slot table names a slot outside the pool, or a coded entry of a tier it was not given")
    plain = ids.masked_fill(is_coded, 0)
    k, v = keys.index_select(0, plain).float(), values.index_select(0, plain).float()
    if coded is not None and bool(is_coded.any()):
        where = is_coded.nonzero().squeeze(1)
        ck, cv = _decoded(coded, ids.index_select(0, where))
        k.index_copy_(0, where, ck.float())
        v.index_copy_(0, where, cv.float())
    return k, v


def _holds(coded: KiviBlocks | DeltaKVBlocks, ids: torch.Tensor) -> torch.Tensor:
    """Which coded entry ids [n] name an entry of ``coded``'s tiers."""
    tiers, place = ids >> TIER_SHIFT, ids & ENTRY_MASK
    if isinstance(coded, KiviBlocks):
        blocks = place // coded.codec.block_size
        return (tiers == coded.tier) & (blocks >= 1) & (blocks < coded.arrays["key_codes"].shape[0])
    tokens = place // coded.codec.block_size
    return (((tiers == coded.tier) & (tokens >= 1) & (tokens < coded.arrays["code"].shape[0]))
            | ((tiers == coded.reference_tier) & (tokens < coded.references["keys"].shape[0])))


def _decoded(coded: KiviBlocks | DeltaKVBlocks, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [n, d] of coded entry ids [n], in PyTorch: KIVI's dequantised, DeltaKV's rebuilt (``decode_torch``)
    or its references as stored."""
    if isinstance(coded, KiviBlocks):
        return coded.codec.decode(coded.arrays, ids & ENTRY_MASK)
    d = coded.references["keys"].shape[-1]
    keys, values = torch.empty(ids.shape[0], d, device=ids.device), torch.empty(ids.shape[0], d, device=ids.device)
    for tier, decode, arrays in ((coded.tier, coded.codec.decode_torch, coded.arrays),
                                 (coded.reference_tier, coded.codec.references.codec.decode, coded.references)):
        where = ((ids >> TIER_SHIFT) == tier).nonzero().squeeze(1)
        if where.numel():
            k, v = decode(arrays, ids.index_select(0, where) & ENTRY_MASK)
            keys.index_copy_(0, where, k.float())
            values.index_copy_(0, where, v.float())
    return keys, values
