"""The transformers adapter: ``CompressedCache`` (a ``Cache``) and the registered attention function.

How it hooks in: building a ``CompressedCache`` switches the model to the attention
implementation ``"kvcompress"`` (registered in ``AttentionInterface``, with SDPA's mask
function). In each layer the model calls ``cache.update(k, v, layer_idx)``; ours stores
nothing there: it marks the layer as pending on its attention module and returns the new
states. The registered attention function then hands the layer to the ``Session``, which
prefills (the first forward) or decodes. With any other cache the same attention function is
plain SDPA, so a model switched to ``kvcompress`` still works with ``DynamicCache``. A method that
scores by a replay of the prompt (KVzip) is replayed as soon as the prefill's forward returns (a
forward hook on the decoder stack: ``replay.py``).

``get_seq_length`` returns the number of token positions seen, not entries held, so RoPE
positions of new tokens stay right after eviction. Beam search, cropping and batch
reordering raise ``NotImplementedError``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from transformers import AttentionInterface, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..methods import Needs, Policy, get_method
from ..models import attention_modules, decoder_stack, model_facts, rotary_embedding
from ..session import Session
from ..store.slots import SlotPool
from .layers import HandOverCache, PositionsLayer, take_pending
from .replay import ReplayPrompts, replay_through, run_replay

ATTENTION_NAME = "kvcompress"


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface entry: a CompressedCache layer if one is pending, else SDPA."""
    pending = take_pending(module)
    hidden = module.__dict__.pop("_kvcompress_hidden", None)  # the input hook's record: never kept past its forward
    if pending is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cache, layer_idx = pending
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = cache.attend(layer_idx, module, query, key, value, attention_mask, scaling, kwargs.get("position_ids"), hidden)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``attn_implementation="kvcompress"`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_kvcompress_attention(model) -> None:
    """Switch a model to the kvcompress attention (plain caches still get SDPA through it)."""
    register_attention()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


def token_valid_from_mask(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """Which prefill tokens are real (not padding), read from the last query row of the 4D mask."""
    if mask is None:
        return None
    last_row = mask[:, 0, -1, -length:]
    valid = last_row if last_row.dtype == torch.bool else last_row == 0
    valid = valid.expand(batch, length)
    return None if bool(valid.all()) else valid


class CompressedCache(HandOverCache):
    """A transformers ``Cache`` that compresses each layer with a kvcompress method.

    Use it like any cache: ``model.generate(ids, past_key_values=CompressedCache(model, method))``.
    The first forward (the prefill) runs full attention, then the layers are compressed by
    ``method`` (layer by layer, or all at once for a method with a global plan); later tokens
    are appended and the method may evict while decoding. The model is switched to the
    ``kvcompress`` attention implementation, which behaves as SDPA for any other cache.

    Args:
        model: a supported transformers causal LM (see ``kvcompress.models``).
        method: a method from ``kvcompress.get_method`` (None = keep everything).
        compress_on_prefill: False keeps the full prefill (and what methods need to
            compress it) so that ``fork`` can compress copies with several methods.
        observation_window: prefill queries to keep for scoring (default: what the method needs).
        attention_sums: accumulate every prefill query's attention per entry (H2O scores).
        hidden_stats: keep the per-channel mean and std of each layer's attention input (GVote).
        key_pages: keep each key channel's min and max per page of this many entries (Quest).
        hidden_states: keep each token's attention input, at prefill and at each step (retention gates).
        replay: replay the prompt after its prefill in chunks of this many tokens and keep each entry's
            most attention from it (KVzip; 0 = no replay).
        pool: the slot pool to hold the entries (default: a private, growable one).
        tokenizer: the model's tokenizer, for a method that replays the prompt (KVzip writes its "repeat
            the previous context" prompt with it); default: loaded from ``model.config.name_or_path``.
    """

    def __init__(self, model, method: Policy | None = None, *, compress_on_prefill: bool = True,
                 observation_window: int | None = None, attention_sums: bool | None = None,
                 hidden_stats: bool | None = None, key_pages: int | None = None, hidden_states: bool | None = None,
                 replay: int | None = None, pool: SlotPool | None = None, tokenizer=None):
        method = method if method is not None else get_method("full")
        method.check_model(model.config)
        facts = model_facts(model)
        modules = attention_modules(model)
        use_kvcompress_attention(model)
        self._config = model.config
        self.attention_modules = modules
        needs = method.needs()
        observe = dataclasses.replace(
            needs,
            window=needs.window if observation_window is None else observation_window,
            attention_sums=needs.attention_sums if attention_sums is None else attention_sums,
            hidden_stats=needs.hidden_stats if hidden_stats is None else hidden_stats,
            key_pages=needs.key_pages if key_pages is None else key_pages,
            hidden_states=needs.hidden_states if hidden_states is None else hidden_states,
            replay=needs.replay if replay is None else replay,
        )
        if observe.hidden_stats or observe.hidden_states:
            watch_attention_inputs(modules)
        self._replay_prompts = None
        if observe.replay:
            self._replay_prompts = ReplayPrompts.from_tokenizer(tokenizer if tokenizer is not None else _own_tokenizer(model))
            watch_prefills(model)
        if pool is None:
            weight = next(model.parameters())
            pool = SlotPool(facts.head_dim, dtype=weight.dtype, device=weight.device)
        self.session = Session(method, pool, num_layers=facts.num_layers, num_kv_heads=facts.num_kv_heads,
                               modules=modules, rotary=rotary_embedding(model), observe=observe,
                               compress_on_prefill=compress_on_prefill)
        super().__init__(layers=[PositionsLayer(self._seen_by(i)) for i in range(facts.num_layers)])
        self.recorder: dict[int, tuple] | None = None  # set to {} to record each layer's next step (diagnose)

    @classmethod
    def shared(cls, model, methods: list[Policy], tokenizer=None) -> CompressedCache:
        """An uncompressed cache that records what every one of ``methods`` needs, to ``fork`` each from
        one prefill (prefill once, compress many)."""
        needs = Needs()
        for method in methods:
            needs = needs.union(method.needs())
        return cls(model, compress_on_prefill=False, observation_window=needs.window,
                   attention_sums=needs.attention_sums, hidden_stats=needs.hidden_stats, key_pages=needs.key_pages,
                   hidden_states=needs.hidden_states, replay=needs.replay, tokenizer=tokenizer)

    def _seen_by(self, layer_idx: int):
        """The token positions a layer has seen (0 before its prefill), as transformers asks for them."""

        def seen() -> int:
            layer = self.session.layers[layer_idx]
            return 0 if layer is None else layer.seen

        return seen

    @property
    def method(self) -> Policy:
        return self.session.method

    @property
    def timings(self) -> dict[str, float]:
        return self.session.timings

    @property
    def merge_error(self) -> float | None:
        """The reference query's relative output error right after compression (methods that merge)."""
        return self.session.stats().get("merge_error")

    # ----- transformers' cache protocol ---------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Hand the layer to the kvcompress attention function (which stores the entries)."""
        if self._config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"CompressedCache needs attn_implementation='{ATTENTION_NAME}' but the model uses "
                f"'{self._config._attn_implementation}'; build the cache after any set_attn_implementation call."
            )
        return super().update(key_states, value_states, layer_idx)

    def reorder_cache(self, beam_idx):  # noqa: D102
        raise NotImplementedError("CompressedCache does not support beam search; use greedy or sampling.")

    def crop(self, max_length):  # noqa: D102
        raise NotImplementedError("CompressedCache cannot be cropped (assisted decoding is not supported).")

    def batch_repeat_interleave(self, repeats):  # noqa: D102
        raise NotImplementedError("CompressedCache does not support num_return_sequences > 1 or beam search.")

    def batch_select_indices(self, indices):  # noqa: D102
        raise NotImplementedError("CompressedCache does not support selecting batch rows.")

    # ----- the attention step -------------------------------------------------------------
    def attend(self, layer_idx, module, query, key, value, mask, scaling, position_ids, hidden=None) -> torch.Tensor:
        """Prefill or decode one layer through the session: output [B, Hq, q, d] (``hidden``: the layer's attention
        input, passed on to a method that needs it)."""
        layer = self.session.layers[layer_idx]
        batch, _, q, _ = query.shape
        seen = 0 if layer is None else layer.seen
        if position_ids is None:
            position_ids = torch.arange(seen, seen + q, device=query.device).expand(batch, q)
        position_ids = position_ids.expand(batch, q)
        observe = self.session.observe
        if layer is None:
            token_valid = token_valid_from_mask(mask, batch, q)
            stats = hidden_statistics(hidden, token_valid) if observe.hidden_stats and hidden is not None else None
            return self.session.prefill(layer_idx, query, key, value, position_ids, scaling, mask=mask, token_valid=token_valid,
                                        hidden_stats=stats, hidden=hidden if observe.hidden_states else None)
        out = self.session.decode(layer_idx, query, key, value, position_ids, hidden=hidden if observe.hidden_states else None)
        if self.recorder is not None:  # diagnose: what this layer saw and answered
            self.recorder[layer_idx] = (query, key, value, position_ids, out)
        return out

    @property
    def replay_prompts(self) -> ReplayPrompts | None:
        """The prompts a replay (KVzip) puts before each chunk of the prompt; None for a method that does not replay."""
        return self._replay_prompts

    def replay(self, decoder, input_ids: torch.Tensor | None) -> None:
        """Right after the prefill of ``input_ids`` (a method that replays the prompt): replay it through transformers'
        ``decoder`` stack, then compress."""
        run_replay(replay_through(decoder, self.session, self.attention_modules), self.session, self._replay_prompts, input_ids)

    # ----- prefill once, compress many ----------------------------------------------------
    def fork(self, method: Policy) -> CompressedCache:
        """A copy of this (uncompressed) cache compressed with ``method``; this cache is untouched."""
        method.check_model(self._config)
        twin = copy.copy(self)
        twin.session = self.session.fork(method)
        twin.layers = [PositionsLayer(twin._seen_by(i)) for i in range(len(self.layers))]
        twin.recorder = None
        return twin

    def release(self) -> None:
        """Give the entries back to the pool (a fork of a shared prefill that is done)."""
        self.session.release()

    # ----- accounting -----------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of KV state really held over all layers."""
        return self.session.kv_bytes()

    def kv_bytes_full(self) -> int:
        """Bytes a plain KV cache would hold for the same tokens (keys + values)."""
        return self.session.kv_bytes_full()

    def stats(self) -> dict[str, Any]:
        """kr (bytes held ÷ full), cr (entries attended per step ÷ full), sizes, notes and the method's statistics."""
        return self.session.stats()


def _own_tokenizer(model):
    """The tokenizer saved beside the model's weights (kvcompress's own checkpoints and hub models have one)."""
    try:
        return AutoTokenizer.from_pretrained(model.config.name_or_path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"this method replays the prompt with a prompt of its own (KVzip) and found no tokenizer at "
                         f"{model.config.name_or_path!r}: pass CompressedCache(model, method, tokenizer=tokenizer)") from err


def watch_prefills(model) -> None:
    """Hook the decoder stack once so that a prefill into a ``CompressedCache`` whose method replays the prompt
    (KVzip) is replayed and compressed as soon as the decoder's forward returns."""
    decoder = decoder_stack(model)
    if getattr(decoder, "_kvcompress_replay_hook", None) is None:
        decoder._kvcompress_replay_hook = decoder.register_forward_hook(_after_decoder, with_kwargs=True)


def _after_decoder(module, args, kwargs, output):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers ≥ 5.24 names it `cache`
    if isinstance(cache, CompressedCache) and cache.session.replay_pending:
        cache.replay(module, kwargs.get("input_ids", args[0] if args else None))
    return None


def watch_attention_inputs(modules) -> None:
    """Hook each attention module once to record its input at every forward (``_kvcompress_hidden``, [B, q, D]),
    which the kvcompress attention function hands to the cache: retention gates read it, and GVote the per-channel
    mean and std of the prompt's (``hidden_statistics``)."""
    for module in modules:
        if getattr(module, "_kvcompress_input_hook", None) is None:
            module._kvcompress_input_hook = module.register_forward_pre_hook(_record_input, with_kwargs=True)


def _record_input(module, args, kwargs):
    module._kvcompress_hidden = kwargs.get("hidden_states", args[0] if args else None)
    return None


def hidden_statistics(hidden: torch.Tensor, token_valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std [B, D] of a prompt's attention inputs [B, n, D] (after the input norm), padding
    (``token_valid`` [B, n] False) left out: GVote samples future queries from N(mean, std²)."""
    weight = torch.ones(hidden.shape[:2], device=hidden.device) if token_valid is None else token_valid.float()
    count = weight.sum(1, keepdim=True).clamp(min=1)[..., None]  # [B, 1, 1]
    mean = (hidden.float() * weight[..., None]).sum(1, keepdim=True) / count
    var = (((hidden.float() - mean) ** 2) * weight[..., None]).sum(1, keepdim=True) / count
    return mean[:, 0], var[:, 0].sqrt()


__all__ = ["ATTENTION_NAME", "CompressedCache", "hidden_statistics", "kvcompress_attention", "register_attention",
           "use_kvcompress_attention", "watch_attention_inputs"]
