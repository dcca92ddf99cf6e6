"""The fast read on torch's fused attention kernels (CPU, or any device torch's SDPA runs on).

* ``read_exact``: every head holds the same entries, no log-weights, no summary — torch's
  SDPA called exactly as transformers calls it, so the ``full`` method (and any method at
  ratio 1.0) reproduces ``model.generate`` token for token.
* ``read_masked``: everything else (ragged heads, log-weights, a summary, column sums). The
  GQA group is folded into the query axis ([B, H, G·q, d] against [B, H, L, d], no copy of
  the keys per query head), ragged heads, causality and log-weights become one additive
  mask, and the CPU flash kernel returns the log-sum-exp that a summary merge needs. Column
  sums (H2O's and KeepKV's decode scores) come from the same logits, without materializing
  [B, H, G, q, L] probabilities twice.
* ``replay_attention``: KVzip's replay (new tokens over the held entries and, causally, themselves).
  After a prefill (every held entry real and before the replay), in bfloat16, one compiled pass
  (``csrc/replay_chunk.cpp``: the output and each held entry's largest weight, with no logits in
  memory); elsewhere ``chunk_attention``'s two flash calls and, for the weights, the largest
  q · k · scaling less the query's log-sum-exp from a float32 product (``held_max_weights``). Held
  entries with holes are read in masked blocks.
* ``chunk_attention``: a chunk of a prompt after its held entries (the engine's chunked prefill): on the CPU the
  compiled causal attention (``csrc/prompt_attention.cpp``) over the held entries and the chunk's, where it runs;
  else two flash calls without a mask (the held entries, the chunk's causal square) merged by their log-sum-exp.
* ``prompt_attention``: the prefill's causal attention over the prompt (on the CPU the compiled causal attention where
  it runs, else torch's SDPA); with column sums
  (H2O's score: each entry's total attention from every prompt query) one chunked pass
  computes the weights once for the output and the sums — never the n × n weights at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..kernels import cpu_kernels
from ..store.view import KVView
from .reference import group_queries, merge_lse, summary_attend

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H, L, d] → [B, H·G, L, d]: KV head h serves query heads h·G … h·G + G − 1."""
    if groups == 1:
        return x
    b, h, length, d = x.shape
    return x[:, :, None].expand(b, h, groups, length, d).reshape(b, h * groups, length, d)


def read_exact(query: torch.Tensor, query_positions: torch.Tensor, view: KVView, scaling: float) -> torch.Tensor:
    """SDPA over uniform heads, as transformers' ``sdpa_attention_forward`` calls it: [B, Hq, q, d]."""
    groups = query.shape[1] // view.shape[1]
    if query.shape[2] == 1:
        return F.scaled_dot_product_attention(query, view.keys, view.values, scale=scaling, enable_gqa=groups > 1)
    mask = view.positions[:, :, None, :] <= query_positions[:, None, :, None]  # heads may hold different positions
    mask = mask.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, repeat_kv(view.keys, groups), repeat_kv(view.values, groups), attn_mask=mask, scale=scaling)


def _folded_bias(query_positions: torch.Tensor, view: KVView, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive float32 mask [B, H, G·q, L] (log-weights, -inf where hidden: padding sits after every
    real position) and which rows see any entry [B, H, G·q]; with one query the mask is [B, H, 1, L],
    shared by the group's rows."""
    b, h, length = view.shape
    q = query_positions.shape[1]
    hidden = view.positions[:, :, None, :] > query_positions[:, None, :, None]  # [B, H, q, L]
    if view.log_weights is None:
        bias = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(hidden, float("-inf"))
    else:
        bias = view.log_weights.float()[:, :, None, :].masked_fill(hidden, float("-inf"))
    seen = ~hidden.all(-1)
    if groups > 1 and q > 1:
        bias = bias[:, :, None].expand(b, h, groups, q, length).reshape(b, h, groups * q, length)
    if groups > 1:
        seen = seen[:, :, None].expand(b, h, groups, q).reshape(b, h, groups * q)
    return bias, seen


def read_masked(query: torch.Tensor, query_positions: torch.Tensor, view: KVView, scaling: float,
                col_sums: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Output [B, Hq, q, d] (the query's dtype), lse [B, Hq, q] float32 (the summary merged) and, if
    asked, column sums [B, H, L] float32 (before the summary merge).

    With column sums the weights are computed once in float32 (they are what is summed); otherwise
    the flash kernel attends (on the CPU; float32 math elsewhere)."""
    b, hq, q, d = query.shape
    heads = view.shape[1]
    groups = hq // heads
    folded = query.reshape(b, heads, groups * q, d)
    keys, values = view.keys, view.values
    bias, seen = _folded_bias(query_positions, view, groups)
    sums = None
    if col_sums or folded.device.type != "cpu" or _CPU_FLASH is None:
        logits = torch.matmul(folded.float(), keys.float().transpose(-1, -2)).mul_(scaling).add_(bias)
        lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits.sub_(torch.where(seen, lse, 0.0)[..., None]))  # exp(-inf) = 0 where hidden
        out = torch.matmul(probs, values.float()).to(query.dtype)
        if col_sums:  # each query's weights sum to one
            sums = probs.sum(dim=2).div_(groups)
    else:
        out, lse = _CPU_FLASH(folded, keys.to(query.dtype), values.to(query.dtype), 0.0, False, attn_mask=bias.to(query.dtype),
                              scale=scaling)
        lse = lse.float()
    lse = lse.masked_fill(~seen, float("-inf"))  # the kernel reports 0 for a query that sees nothing
    out, lse = out.reshape(b, hq, q, d), lse.reshape(b, hq, q)
    if view.summary is not None:
        out, lse = merge_summary(query, out, lse, view.summary, heads, scaling)
    return out, lse, sums


def merge_summary(query: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, summary, heads: int, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The read's output [B, Hq, q, d] and lse [B, Hq, q] with what left (a ``Summary``) merged in through log-sum-exp.
    One query a row on the CPU: one compiled pass (``csrc/summary_merge.cpp``); elsewhere, or without the compiled
    module, ``merge_summary_torch``."""
    kernel = cpu_kernels() if query.shape[2] == 1 and query.device.type == "cpu" else None
    if kernel is not None:
        return tuple(kernel.summary_merge(query, out, lse, *summary.readout(scaling)))
    return merge_summary_torch(query, out, lse, summary, heads, scaling)


def merge_summary_torch(query: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, summary, heads: int, scaling: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_summary`` in PyTorch (the compiled pass's reference): the summary's read, then ``merge_lse``."""
    b, hq, q, d = query.shape
    groups = hq // heads
    out_s, lse_s = summary_attend(summary, group_queries(query, heads), scaling)
    merged, lse_m = merge_lse(out.float().view(b, heads, groups, q, d), lse.view(b, heads, groups, q), out_s, lse_s)
    return merged.to(query.dtype).view(b, hq, q, d), lse_m.view(b, hq, q)


def replay_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor,
                     key_valid: torch.Tensor | None, new_keys: torch.Tensor, new_values: torch.Tensor, query_positions: torch.Tensor,
                     scaling: float, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.attend_with_max_weights``'s contract, fast: (out [B, Hq, q, d] in the query's dtype, each held
    entry's largest weight from any query of its KV head's group [B, H, L] float32). A held entry's weight for a
    query is exp(q · k · scaling − lse), so its largest is exp of the largest q · k · scaling − lse."""
    b, hq, q, d = query.shape
    heads, length = keys.shape[1], keys.shape[2]
    groups = hq // heads
    before = key_valid is None and (length == 0 or bool(key_positions.max() < query_positions.min()))
    if before and query.device.type == "cpu" and _CPU_FLASH is not None:
        return _replay_after_held(query, keys, values, new_keys, new_values, scaling, block)
    attend = _replay_block_masked(query, keys, values, key_positions, key_valid, new_keys, new_values, query_positions, scaling)
    held = keys.float().transpose(-1, -2)  # [B, H, d, L]
    outs, best = [], torch.full((b, heads, length), float("-inf"), device=keys.device)
    for start in range(0, q, block):
        part = slice(start, min(q, start + block))
        rows = query[:, :, part].reshape(b, heads, groups, -1, d).reshape(b, heads, -1, d)  # the group folded: [B, H, G·q', d]
        out, lse = attend(rows, part)
        outs.append(out.view(b, heads, groups, -1, d))
        logits = torch.matmul(rows.float(), held).mul_(scaling).sub_(lse.float().view(b, heads, -1, 1))  # [B, H, G·q', L]
        hidden = key_positions[:, :, None, :] > query_positions[:, None, part, None]  # [B, H, q', L]
        if key_valid is not None:
            hidden |= ~key_valid[:, :, None, :]
        logits = logits.view(b, heads, groups, -1, length).masked_fill_(hidden[:, :, None], float("-inf")).view(b, heads, -1, length)
        best = torch.maximum(best, logits.amax(dim=2))
    return torch.cat(outs, dim=3).reshape(b, hq, q, d), best.exp_()


def _replay_after_held(query, keys, values, new_keys, new_values, scaling, block):
    """``replay_attention`` on the CPU when every held entry is real and before every query: (out [B, Hq, q, d], the
    held entries' largest weights [B, H, L] float32)."""
    b, hq, q, d = query.shape
    heads = keys.shape[1]
    groups = hq // heads
    folded = query.reshape(b, heads, groups * q, d)
    bf16 = all(x.dtype == torch.bfloat16 for x in (query, keys, values, new_keys, new_values))
    kernel = cpu_kernels() if bf16 else None
    if kernel is None or not kernel.replay_chunk_available() or d % 64:
        out, lse = _flash_after_held(query, keys, values, new_keys, new_values, scaling)  # lse [B, H, G·q]
        return out, held_max_weights(folded, keys, lse, scaling, block * groups)
    out, best = kernel.replay_chunk(folded, keys, values, new_keys, new_values, scaling)
    return out.to(query.dtype).view(b, hq, q, d), best.exp_()


def held_max_weights(rows: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scaling: float, block: int = 1024) -> torch.Tensor:
    """Each held entry's largest weight from any of ``rows`` [B, H, R, d] (queries, the GQA group folded), all of which
    see every held entry [B, H, L, d]: exp(max over rows of q · k · scaling − the row's lse [B, H, R]) → [B, H, L]
    float32, the logits in float32 ``block`` rows at a time."""
    b, heads, r, _ = rows.shape
    held = keys.float().transpose(-1, -2)  # [B, H, d, L]
    best = torch.full((b, heads, keys.shape[2]), float("-inf"), device=keys.device)
    for start in range(0, r, block):
        part = slice(start, min(r, start + block))
        logits = torch.matmul(rows[:, :, part].float(), held).mul_(scaling).sub_(lse[:, :, part, None].float())
        best = torch.maximum(best, logits.amax(dim=2))
    return best.exp_()


def _replay_block_masked(query, keys, values, key_positions, key_valid, new_keys, new_values, query_positions, scaling):
    """A block of replay queries (the group folded, [B, H, G·q', d]) over held entries anywhere (holes, positions):
    ``read_masked`` over a view of the held and new entries."""
    b, heads = keys.shape[:2]
    groups, q = query.shape[1] // heads, new_keys.shape[2]
    new_positions = query_positions[:, None, :].expand(b, heads, q)
    valid = None if key_valid is None else torch.cat([key_valid, torch.ones_like(new_positions, dtype=torch.bool)], dim=2)
    whole = KVView.of(torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2),
                      torch.cat([key_positions, new_positions], dim=2), valid=valid)

    def attend(rows: torch.Tensor, part: slice) -> tuple[torch.Tensor, torch.Tensor]:
        unfolded = rows.view(b, heads, groups, -1, rows.shape[-1]).reshape(b, heads * groups, -1, rows.shape[-1])
        out, lse, _ = read_masked(unfolded, query_positions[:, part], whole, scaling)
        return out.view(b, heads, -1, rows.shape[-1]), lse.view(b, heads, -1)

    return attend


def chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor,
                    new_values: torch.Tensor, scaling: float) -> torch.Tensor:
    """A prompt chunk's causal attention after held entries that are all real and all before it (a chunked
    prefill): queries [B, Hq, c, d] over the held keys/values [B, H, L, d] and, causally, the chunk's own
    [B, H, c, d] → [B, Hq, c, d] in the query's dtype. On the CPU, the compiled causal attention over the held and
    the chunk's entries where it runs (``_causal_kernel``), else two flash calls without a mask — the held
    entries with the GQA group folded into the query axis, the chunk over itself as the causal square — merged by
    their log-sum-exp; on a GPU, one SDPA call with the causal mask aligned to the last key (PyTorch's
    ``causal_lower_right``, which its fused kernels apply without making a [c, L + c] matrix)."""
    b, hq, c, d = query.shape
    heads, length = keys.shape[1], keys.shape[2]
    groups = hq // heads
    if query.device.type != "cpu":
        every_key, every_value = (repeat_kv(torch.cat([held, new], dim=2), groups).to(query.dtype) for held, new in
                                  ((keys, new_keys), (values, new_values)))
        return F.scaled_dot_product_attention(query, every_key, every_value, attn_mask=causal_lower_right(c, length + c), scale=scaling)
    kernel = _causal_kernel(query, keys, values, new_keys, new_values)
    if kernel is not None:  # the held entries and the chunk's read where they lie, side by side
        pieces = [[x.to(query.dtype) for x in (held, new) if x.shape[2]] for held, new in ((keys, new_keys), (values, new_values))]
        return kernel.causal_attention(query, *pieces, scaling)
    if _CPU_FLASH is None:
        positions = torch.arange(length + c, device=query.device).expand(b, heads, length + c)
        whole = KVView.of(torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2), positions)
        return read_masked(query, positions[:, 0, length:], whole, scaling)[0]
    return _flash_after_held(query, keys, values, new_keys, new_values, scaling)[0]


def _causal_kernel(query: torch.Tensor, *entries: torch.Tensor):
    """The CPU kernels where their causal attention (``csrc/prompt_attention.cpp``: float32 sums, ~2.8× torch's CPU flash
    kernel at a 2000-token prompt; its output token-major, [B, c, Hq, d] permuted) takes ``query`` [B, Hq, c, d]: on the
    CPU, float32 or bfloat16, d a multiple of 64, with no gradient to record through it or ``entries``; else None."""
    if query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16) or query.shape[-1] % 64:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, *entries)):
        return None
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.causal_attention_available() else None


def _flash_after_held(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor,
                      new_values: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_attention`` on the CPU's flash kernel: the held entries (the GQA group folded into the query axis) and
    the chunk's causal square, two calls without a mask merged by their log-sum-exp → output [B, Hq, c, d] in the
    query's dtype and lse [B, H, G·c] float32 (the group folded)."""
    b, hq, c, d = query.shape
    heads, length = keys.shape[1], keys.shape[2]
    groups = hq // heads
    own, own_lse = _CPU_FLASH(query.contiguous(), repeat_kv(new_keys, groups).to(query.dtype).contiguous(),
                              repeat_kv(new_values, groups).to(query.dtype).contiguous(), 0.0, True, scale=scaling)
    own_lse = own_lse.float().reshape(b, heads, groups * c)
    if length == 0:
        return own, own_lse
    folded = query.reshape(b, heads, groups * c, d)
    held, held_lse = _CPU_FLASH(folded, keys.to(query.dtype), values.to(query.dtype), 0.0, False, scale=scaling)
    out, lse = merge_lse(held.float().reshape(b, heads, groups, c, d), held_lse.float().reshape(b, heads, groups, c),
                         own.float().reshape(b, heads, groups, c, d), own_lse.reshape(b, heads, groups, c))
    return out.to(query.dtype).reshape(b, hq, c, d), lse.reshape(b, heads, groups * c)


# ----- the prompt ----------------------------------------------------------------------------
def prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, mask: torch.Tensor | None = None,
                     col_sums: bool = False, token_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of a prompt over itself, as transformers' SDPA computes it: output [B, Hq, n, d]
    and, if asked, each entry's attention summed over the prompt's queries [B, H, n]
    (``prompt_attention_with_sums``, one pass that computes the weights once for both).

    ``mask`` is transformers' 4-D attention mask (padded batches) or None (causal); ``token_valid``
    [B, n] marks the real tokens for the sums."""
    if col_sums:
        return prompt_attention_with_sums(query, key, value, scaling, mask, token_valid)
    groups = query.shape[1] // key.shape[1]
    kernel = _causal_kernel(query, key, value) if mask is None and query.shape[2] > 1 else None
    if kernel is not None and key.dtype == value.dtype == query.dtype:
        return kernel.causal_attention(query, [key], [value], scaling), None
    if mask is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=groups > 1), None
    return F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scaling), None


def prompt_attention_with_sums(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                               mask: torch.Tensor | None = None, token_valid: torch.Tensor | None = None,
                               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prompt attention and its column sums in one pass: output [B, Hq, n, d] (the query's
    dtype) and Σ over the prompt's (real) queries of each entry's weight, mean over the GQA group,
    [B, H, n] float32 (H2O's score).

    ``chunk`` queries at a time (default: about 512 weight rows over every KV head and its group),
    each against the keys up to its last query: the float32 weights are computed once, in one
    buffer reused by every chunk, exponentiated in place (row max subtracted), and give the output
    P·V, its row sums (a column of ones beside V) and the column sums (1/Σ)ᵀ·P — the n × n matrix
    never exists. A query that sees nothing (a padded row) gets output 0 and no vote."""
    b, hq, n, d = query.shape
    heads = key.shape[1]
    groups = hq // heads
    bh = b * heads
    chunk = chunk or max(8, 512 // (bh * groups))
    device = query.device
    q = (query.float() * scaling).reshape(bh, groups, n, d)
    k_t = key.float().reshape(bh, n, d).transpose(1, 2)  # [BH, d, n]
    v_ones = torch.cat([value.float().reshape(bh, n, d), torch.ones(bh, n, 1, device=device)], dim=-1)  # [BH, n, d + 1]
    voting = None if token_valid is None else token_valid.to(device).repeat_interleave(heads, dim=0).float()  # [BH, n]
    out = torch.empty(bh, groups, n, d, dtype=torch.float32, device=device)
    total = torch.zeros(bh, n, dtype=torch.float32, device=device)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    buffer = None if tracked else torch.empty(bh * groups * min(chunk, n) * n, dtype=torch.float32, device=device)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        c = end - start
        rows = q[:, :, start:end].reshape(bh, groups * c, d)
        if buffer is None:  # autograd records the pass: no reused buffer
            weights = torch.bmm(rows, k_t[:, :, :end])
        else:
            weights = torch.bmm(rows, k_t[:, :, :end], out=buffer[: bh * groups * c * end].view(bh, groups * c, end))
        if mask is None:  # keys after a query are hidden: only the chunk's own diagonal block has any
            after = torch.arange(start, end, device=device)[:, None] < torch.arange(start, end, device=device)
            weights.view(bh, groups, c, end)[..., start:end].masked_fill_(after, float("-inf"))
        else:
            weights.view(b, heads, groups, c, end).add_(_mask_bias(mask[:, :, start:end, :end], heads, groups))
        peak = weights.detach().amax(-1, keepdim=True)  # a constant shift (softmax ignores it): no gradient
        weights.sub_(peak.masked_fill_(peak == float("-inf"), 0.0)).exp_()  # unnormalized, ≤ 1
        attended = torch.bmm(weights, v_ones[:, :end])  # [BH, G·c, d + 1]: P·V and the row sums
        norm = attended[..., d:]
        inv = torch.where(norm > 0, norm.reciprocal(), 0.0)  # a row that sees nothing: output 0, no vote
        out[:, :, start:end] = attended[..., :d].mul_(inv).view(bh, groups, c, d)
        votes = inv.view(bh, 1, groups * c)
        if voting is not None:  # padding queries do not vote
            votes = votes * voting[:, None, None, start:end].expand(bh, 1, groups, c).reshape(bh, 1, groups * c)
        total[:, :end] += torch.bmm(votes, weights)[:, 0]
    return out.view(b, hq, n, d).to(query.dtype), (total / groups).view(b, heads, n)


def _mask_bias(mask: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """transformers' mask slice [B, 1 | Hq, c, k] (bool: True = seen, or additive) → an additive float32
    bias broadcastable to [B, H, G, c, k]."""
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf")) \
        if mask.dtype == torch.bool else mask.float()
    if bias.shape[1] == 1:
        return bias[:, :, None]
    return bias.view(bias.shape[0], heads, groups, *bias.shape[2:])


__all__ = ["chunk_attention", "merge_summary", "merge_summary_torch", "prompt_attention", "prompt_attention_with_sums", "read_exact", "read_masked", "repeat_kv"]
