"""CompressedCache: a transformers ``Cache`` whose layers hold only retained entries.

Per layer, the state is a ragged set of entries per (batch row, KV head):

* ``keys``, ``values`` [N, d] and original ``positions`` [N] of every retained entry,
  flattened segment after segment (segment = one (batch row, KV head), in that order),
  with ``lengths`` [B·H] giving each segment's size. Heads hold different numbers of
  entries without padding to the longest: the bytes counted are the bytes held.
* optional per-entry ``log_weights`` [N] added to the logits (KeepKV votes: log p),
* optional per-entry method state ``extras`` (e.g. H2O's accumulated attention),
* an optional ``summary`` of what left, merged through log-sum-exp (MomentKV moments).

How it hooks into transformers: ``update`` does not concatenate anything; it hands the
layer to the ``kvcompress`` attention function (registered through transformers'
attention interface), which stores the new entries, attends through the read path of
``attention.py`` and lets the method compress (after the prefill) or evict (while
decoding). Models keep calling ``model.generate`` unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import attention
from .models import attention_modules, model_facts, rotary_embedding

if TYPE_CHECKING:
    from .methods.base import Method

ATTENTION_NAME = "kvcompress"
POSITION_DTYPE = torch.int32  # 4 bytes of metadata per retained entry


@dataclass
class PaddedView:
    """A layer's entries as [B, H, L, ...] tensors, L = the longest head.

    ``valid`` is None when every head holds L entries (then the view is free: no copy).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor  # int64 [B, H, L]
    valid: torch.Tensor | None  # bool [B, H, L]


@dataclass
class LayerContext:
    """What a method may know about the layer it compresses or decodes.

    ``module`` is the layer's attention module (q_proj, q-norm live there), ``rotary`` the
    model's rotary embedding; while decoding, ``query`` [B, Hq, q, d] (after RoPE) and
    ``query_positions`` [B, q] are the step's queries (KeepKV merges against them).
    """

    layer_idx: int
    num_layers: int
    module: torch.nn.Module | None
    scaling: float
    rotary: torch.nn.Module | None = None
    query: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None


class LayerCache(CacheLayerMixin):
    """Retained entries of one layer for a batch; see the module docstring."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.batch_size = 0
        self.flat_keys: torch.Tensor | None = None
        self.flat_values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None  # int64 [B·H], on CPU
        self.log_weights: torch.Tensor | None = None
        self.extras: dict[str, torch.Tensor] = {}
        self.summary: attention.Summary | None = None  # merged into every read (never mutated in place)
        self.state: dict[str, Any] = {}  # per-layer method state, e.g. MomentKV's moments (counted in nbytes)
        self.seen = 0  # token columns processed (incl. padding): the next position to come
        self.tokens_seen: torch.Tensor | None = None  # int64 [B]: real tokens per row
        self.observations: dict[str, torch.Tensor] = {}  # prefill facts for compression
        self.notes: set[str] = set()
        self._view: PaddedView | None = None

    # ----- transformers' layer protocol -------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        raise RuntimeError("LayerCache is written by the kvcompress attention function, not by update().")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # noqa: D102
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:  # noqa: D102
        return self.seen

    def get_max_length(self) -> int:  # noqa: D102
        return -1

    # ----- sizes -------------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return 0 if self.flat_keys is None else self.flat_keys.shape[0]

    def head_lengths(self) -> torch.Tensor:
        """Entries held per (batch row, KV head): int64 [B, H]."""
        return self.lengths.view(self.batch_size, self.num_kv_heads)

    def nbytes(self) -> int:
        """Bytes of state really held: entries, positions, log-weights, extras, summary, method state."""
        if self.flat_keys is None:
            return 0
        tensors = [self.flat_keys, self.flat_values, self.positions, self.lengths, *self.extras.values()]
        if self.log_weights is not None:
            tensors.append(self.log_weights)
        held = sum(t.numel() * t.element_size() for t in tensors)
        objects = {id(o): o for o in [self.summary, *self.state.values()] if o is not None and hasattr(o, "nbytes")}
        return held + sum(o.nbytes() for o in objects.values())

    def full_nbytes(self) -> int:
        """Bytes a plain (uncompressed) KV cache would hold for the same real tokens."""
        if self.flat_keys is None:
            return 0
        per_token = 2 * self.num_kv_heads * self.head_dim * self.flat_keys.element_size()
        return int(self.tokens_seen.sum()) * per_token

    def full_entries(self) -> int:
        return 0 if self.tokens_seen is None else int(self.tokens_seen.sum()) * self.num_kv_heads

    # ----- views -------------------------------------------------------------------------
    def padded_view(self) -> PaddedView:
        """All entries as [B, H, L, ...] (free when heads are equally long)."""
        if self._view is None:
            self._view = PaddedView(
                keys=self.padded(self.flat_keys),
                values=self.padded(self.flat_values),
                positions=self.padded(self.positions).long(),
                valid=self._valid_mask(),
            )
        return self._view

    def _valid_mask(self) -> torch.Tensor | None:
        lengths = self.lengths
        if bool((lengths == lengths.max()).all()):
            return None
        span = torch.arange(int(lengths.max()))
        return (span[None, :] < lengths[:, None]).view(self.batch_size, self.num_kv_heads, -1).to(self.flat_keys.device)

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """A per-entry tensor [N, ...] laid out as [B, H, L, ...], zeros on padding."""
        b, h = self.batch_size, self.num_kv_heads
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if self.num_entries == b * h * longest:
            return flat.view(b, h, longest, *flat.shape[1:])
        valid = self._valid_mask()
        out = flat.new_zeros(b, h, longest, *flat.shape[1:])
        out[valid] = flat
        return out

    # ----- writes ------------------------------------------------------------------------
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        token_valid: torch.Tensor | None = None,
    ) -> None:
        """Add new entries [B, H, q, d] at positions [B, q]; ``token_valid`` [B, q] drops padding."""
        b, h, q, _ = keys.shape
        if token_valid is None:
            token_valid = torch.ones(b, q, dtype=torch.bool, device=keys.device)
        new_valid = token_valid[:, None, :].expand(b, h, q)
        new_positions = positions[:, None, :].expand(b, h, q).to(POSITION_DTYPE)
        if self.flat_keys is None:
            self.batch_size = b
            self.tokens_seen = torch.zeros(b, dtype=torch.int64)
            self.lengths = torch.zeros(b * h, dtype=torch.int64)
            self.is_initialized = True
            fields = {"keys": keys, "values": values, "positions": new_positions}
            self._assign({name: t[new_valid] for name, t in fields.items()}, new_valid)
        else:
            old = self._entry_fields()
            view_valid = self.padded_view().valid
            merged = {}
            for name, flat in old.items():
                incoming = {"keys": keys, "values": values, "positions": new_positions}.get(name)
                if incoming is None:  # log-weights and extras of new entries start at 0
                    incoming = flat.new_zeros(b, h, q, *flat.shape[1:])
                merged[name] = torch.cat([self.padded(flat), incoming], dim=2)
            keep = new_valid if view_valid is None and bool(new_valid.all()) else None
            if keep is not None:  # every head equally long before and after: a plain concat
                self._assign({n: t.reshape(-1, *t.shape[3:]) for n, t in merged.items()}, None, added=q)
            else:
                old_valid = view_valid if view_valid is not None else torch.ones_like(merged["positions"][..., :-q], dtype=torch.bool)
                mask = torch.cat([old_valid, new_valid], dim=2)
                self._assign({n: t[mask] for n, t in merged.items()}, mask)
        self.seen += q
        self.tokens_seen = self.tokens_seen + token_valid.sum(dim=1).cpu()  # never in place: clones share it

    def retain(self, keep: torch.Tensor) -> None:
        """Keep the entries marked True in ``keep`` [B, H, L] (the padded view's layout)."""
        view = self.padded_view()
        if view.valid is not None:
            keep = keep & view.valid
        fields = {name: self.padded(flat)[keep] for name, flat in self._entry_fields().items()}
        self._assign(fields, keep)

    def _entry_fields(self) -> dict[str, torch.Tensor]:
        fields = {"keys": self.flat_keys, "values": self.flat_values, "positions": self.positions}
        if self.log_weights is not None:
            fields["log_weights"] = self.log_weights
        fields.update({f"extra:{k}": v for k, v in self.extras.items()})
        return fields

    def _assign(self, fields: dict[str, torch.Tensor], mask: torch.Tensor | None, added: int = 0) -> None:
        self.flat_keys = fields["keys"]
        self.flat_values = fields["values"]
        self.positions = fields["positions"]
        self.log_weights = fields.get("log_weights")
        self.extras = {k[len("extra:") :]: v for k, v in fields.items() if k.startswith("extra:")}
        if mask is not None:
            self.lengths = mask.sum(dim=-1).reshape(-1).cpu()
        else:
            self.lengths = self.lengths + added
        self.observations = {k: v for k, v in self.observations.items() if not k.startswith("entry:")}
        self._view = None

    def set_log_weights(self, log_weights: torch.Tensor | None) -> None:
        """Per-entry log-weights [N] (float32), or None for all-zero."""
        self.log_weights = None if log_weights is None else log_weights.float()
        self._view = None

    def clone(self) -> LayerCache:
        """An independent copy (tensors are replaced, never written in place, so sharing is safe)."""
        twin = copy.copy(self)
        twin.extras = dict(self.extras)
        twin.observations = dict(self.observations)
        twin.notes = set(self.notes)
        twin.state = dict(self.state)  # summaries and state are replaced on update, never written in place
        return twin


# ----- the attention function ---------------------------------------------------------------
def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface entry: a CompressedCache layer if one is pending, else SDPA."""
    pending = module.__dict__.pop("_kvcompress_pending", None)
    if pending is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cache, layer_idx = pending
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = cache.attend(layer_idx, module, query, key, value, attention_mask, scaling, kwargs.get("position_ids"))
    return out, None


def register_attention() -> None:
    """Make ``attn_implementation="kvcompress"`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_kvcompress_attention(model) -> None:
    """Switch a model to the kvcompress attention (plain caches still get SDPA through it)."""
    register_attention()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


def _token_valid_from_mask(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """Which prefill tokens are real (not padding), read from the last query row of the 4D mask."""
    if mask is None:
        return None
    last_row = mask[:, 0, -1, -length:]
    valid = last_row if last_row.dtype == torch.bool else last_row == 0
    valid = valid.expand(batch, length)
    return None if bool(valid.all()) else valid


class CompressedCache(Cache):
    """A transformers ``Cache`` that compresses each layer with a kvcompress method.

    Use it like any cache: ``model.generate(ids, past_key_values=CompressedCache(model, method))``.
    The first forward (the prefill) runs full attention, then each layer is compressed by
    ``method``; later tokens are appended and the method may evict while decoding. The model
    is switched to the ``kvcompress`` attention implementation, which behaves as SDPA for
    any other cache.

    Args:
        model: a supported transformers causal LM (see ``kvcompress.models``).
        method: a method from ``kvcompress.get_method`` (None = keep everything).
        compress_on_prefill: False keeps the full prefill (and what methods need to
            compress it) so that ``fork`` can compress copies with several methods.
        observation_window: prefill queries to keep for scoring (default: what the method needs).
        attention_sums: accumulate every prefill query's attention per entry (H2O scores).
        hidden_stats: keep the per-channel mean and std of each layer's attention input (GVote).
    """

    def __init__(
        self,
        model,
        method: Method | None = None,
        *,
        compress_on_prefill: bool = True,
        observation_window: int | None = None,
        attention_sums: bool | None = None,
        hidden_stats: bool | None = None,
    ):
        from .methods import get_method

        self.method = method if method is not None else get_method("full")
        facts = model_facts(model)
        self._modules = attention_modules(model)
        self._rotary = rotary_embedding(model)
        use_kvcompress_attention(model)
        self._config = model.config
        layers = [LayerCache(i, facts.num_kv_heads, facts.head_dim) for i in range(facts.num_layers)]
        super().__init__(layers=layers)
        self.num_layers = facts.num_layers
        self.compress_on_prefill = compress_on_prefill
        needs = self.method.needs()
        self.observation_window = needs.window if observation_window is None else observation_window
        self.attention_sums = needs.attention_sums if attention_sums is None else attention_sums
        self.hidden_stats = needs.hidden_stats if hidden_stats is None else hidden_stats
        if self.hidden_stats:
            watch_attention_inputs(self._modules)
        self.timings: dict[str, float] = {"compress_s": 0.0}
        self.recorder: dict[int, tuple] | None = None  # set to {} to record each layer's next step
        self.merge_error: float | None = None  # methods with a reference query report its error here

    # ----- transformers' cache protocol ---------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Hand the layer to the kvcompress attention function (which stores the entries)."""
        if self._config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"CompressedCache needs attn_implementation='{ATTENTION_NAME}' but the model uses "
                f"'{self._config._attn_implementation}'; build the cache after any set_attn_implementation call."
            )
        self._modules[layer_idx]._kvcompress_pending = (self, layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # noqa: D102
        return self.layers[layer_idx].seen

    def reorder_cache(self, beam_idx):  # noqa: D102
        raise NotImplementedError("CompressedCache does not support beam search; use greedy or sampling.")

    def crop(self, max_length):  # noqa: D102
        raise NotImplementedError("CompressedCache cannot be cropped (assisted decoding is not supported).")

    def batch_repeat_interleave(self, repeats):  # noqa: D102
        raise NotImplementedError("CompressedCache does not support num_return_sequences > 1 or beam search.")

    def batch_select_indices(self, indices):  # noqa: D102
        raise NotImplementedError("CompressedCache does not support selecting batch rows.")

    # ----- the attention step -------------------------------------------------------------
    def attend(self, layer_idx, module, query, key, value, mask, scaling, position_ids) -> torch.Tensor:
        """Store the new entries of one layer, attend, and compress or evict as the method says."""
        layer = self.layers[layer_idx]
        batch, _, q, _ = query.shape
        if position_ids is None:
            position_ids = torch.arange(layer.seen, layer.seen + q, device=query.device).expand(batch, q)
        position_ids = position_ids.expand(batch, q)
        context = LayerContext(layer_idx, self.num_layers, module, scaling, self._rotary, query, position_ids)
        if layer.seen == 0:
            return self._prefill(layer, context, query, key, value, mask, position_ids)
        layer.append(key, value, position_ids)
        out, probs = attention.read(module, layer, query, position_ids, scaling, self.method.wants_decode_probs)
        if self.recorder is not None:  # diagnose: what this layer saw and answered
            self.recorder[layer_idx] = (query, key, value, position_ids, out)
        self.method.after_decode_step(layer, probs, context)
        return out

    def _prefill(self, layer, context, query, key, value, mask, position_ids) -> torch.Tensor:
        out, _ = sdpa_attention_forward(context.module, query, key, value, mask, dropout=0.0, scaling=context.scaling)
        token_valid = _token_valid_from_mask(mask, query.shape[0], query.shape[2])
        layer.append(key, value, position_ids, token_valid)
        self._observe(layer, query, position_ids, token_valid, context.scaling)
        if self.compress_on_prefill:
            self._compress_layer(layer, context)
        return out

    def _observe(self, layer, query, position_ids, token_valid, scaling) -> None:
        """Keep what methods score with: the last queries and, if asked, attention sums per entry."""
        w = min(self.observation_window, query.shape[2])
        if w > 0:
            layer.observations["window_queries"] = query[:, :, -w:]
            layer.observations["window_positions"] = position_ids[:, -w:]
        if self.attention_sums:
            layer.observations["entry:attention_sums"] = _attention_sums(layer, query, position_ids, token_valid, scaling)
        if self.hidden_stats:
            mean, std = self._modules[layer.layer_idx].__dict__.pop("_kvcompress_hidden_stats")
            layer.observations["hidden_mean"], layer.observations["hidden_std"] = mean, std

    def _compress_layer(self, layer: LayerCache, context: LayerContext) -> None:
        import time

        start = time.perf_counter()
        self.method.compress(layer, context)
        layer.observations = {}
        errors = [other.state["merge_error"] for other in self.layers if "merge_error" in other.state]
        if errors:  # methods with a reference query (KeepKV, CaM, D2O): its error right after compression
            self.merge_error = sum(errors) / len(errors)
        self.timings["compress_s"] += time.perf_counter() - start

    # ----- prefill once, compress many ----------------------------------------------------
    def fork(self, method: Method) -> CompressedCache:
        """A copy of this (uncompressed) cache compressed with ``method``; this cache is untouched."""
        if self.compress_on_prefill:
            raise ValueError("fork() needs a cache built with compress_on_prefill=False.")
        needs = method.needs()
        missing = (
            needs.window > self.observation_window
            or (needs.attention_sums and not self.attention_sums)
            or (needs.hidden_stats and not self.hidden_stats)
        )
        if missing:
            raise ValueError(
                f"{method.name} needs observation_window>={needs.window}, attention_sums={needs.attention_sums} and "
                f"hidden_stats={needs.hidden_stats}; build the shared prefill cache with those settings."
            )
        twin = copy.copy(self)
        twin.layers = [layer.clone() for layer in self.layers]
        twin.method = method
        twin.compress_on_prefill = True
        twin.timings = {"compress_s": 0.0}
        twin.recorder = None
        twin.merge_error = None
        for layer in twin.layers:
            module = self._modules[layer.layer_idx]
            twin._compress_layer(layer, LayerContext(layer.layer_idx, self.num_layers, module, self._scaling(layer), self._rotary))
        return twin

    def _scaling(self, layer: LayerCache) -> float:
        return getattr(self._modules[layer.layer_idx], "scaling", layer.head_dim**-0.5)

    # ----- accounting -----------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of KV state really held over all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def kv_bytes_full(self) -> int:
        """Bytes a plain KV cache would hold for the same tokens (keys + values)."""
        return sum(layer.full_nbytes() for layer in self.layers)

    def stats(self) -> dict[str, Any]:
        """kr (bytes held ÷ full), cr (entries attended per step ÷ full), sizes and notes."""
        full = self.kv_bytes_full()
        held = self.kv_bytes()
        entries = sum(layer.num_entries for layer in self.layers)
        full_entries = sum(layer.full_entries() for layer in self.layers)
        heads = sum(layer.batch_size * layer.num_kv_heads for layer in self.layers)
        notes = sorted(set().union(*(layer.notes for layer in self.layers)))
        merge_counts = {name: sum(int(layer.state.get(name, 0)) for layer in self.layers)
                        for name in ("merged", "merge_groups", "dropped", "zip_fallbacks")}
        offloaded = sum(int(layer.state.get("external_kv_bytes", 0)) for layer in self.layers)  # KeepKV's CPU copy, not in kr
        return {
            "kr": held / full if full else 1.0,
            "cr": entries / full_entries if full_entries else 1.0,
            "kv_bytes": held,
            "kv_bytes_full": full,
            "entries": entries,
            "entries_full": full_entries,
            "entries_per_head": entries / heads if heads else 0.0,  # mean realized budget per (layer, row, KV head)
            "notes": notes,
            **({"merge_counts": merge_counts} if any(merge_counts.values()) else {}),
            **({"offloaded_bytes": offloaded} if offloaded else {}),
        }


def watch_attention_inputs(modules) -> None:
    """Hook each attention module once to record the per-channel mean and std of its input at prefill.

    GVote samples future queries from N(mean, std²) of the layer's attention-input hidden
    states (after the input norm); padding tokens are left out of the statistics.
    """
    for module in modules:
        if getattr(module, "_kvcompress_input_hook", None) is None:
            module._kvcompress_input_hook = module.register_forward_pre_hook(_record_input_stats, with_kwargs=True)


def _record_input_stats(module, args, kwargs):
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if hidden is None or hidden.shape[1] < 2:  # decoding steps: nothing to record
        return None
    valid = _token_valid_from_mask(kwargs.get("attention_mask"), hidden.shape[0], hidden.shape[1])
    weight = torch.ones(hidden.shape[:2], device=hidden.device) if valid is None else valid.float()
    count = weight.sum(1, keepdim=True).clamp(min=1)[..., None]  # [B, 1, 1]
    mean = (hidden.float() * weight[..., None]).sum(1, keepdim=True) / count
    var = (((hidden.float() - mean) ** 2) * weight[..., None]).sum(1, keepdim=True) / count
    module._kvcompress_hidden_stats = (mean[:, 0], var[:, 0].sqrt())  # [B, hidden] each
    return None


def _attention_sums(layer, query, position_ids, token_valid, scaling, chunk: int = 256) -> torch.Tensor:
    """Σ over prefill queries of each entry's attention weight, mean over the GQA group: [N] float32.

    Computed in query chunks so that the n×n weights never exist at once (H2O's score).
    """
    view = layer.padded_view()
    grouped = attention.group_queries(query, layer.num_kv_heads)
    total = torch.zeros(view.positions.shape, dtype=torch.float32, device=query.device)
    for start in range(0, query.shape[2], chunk):
        sl = slice(start, start + chunk)
        probs = attention.attention_probs(
            grouped[:, :, :, sl], view.keys, scaling, position_ids[:, sl], view.positions, view.valid
        )
        if token_valid is not None:  # padding queries do not vote
            probs = probs * token_valid[:, None, None, sl, None]
        total += probs.sum(dim=3).mean(dim=2)
    return total[view.valid] if view.valid is not None else total.reshape(-1)
