"""``kvcompress train deltakv``: fit DeltaKV's compressor and decoder on a frozen model (seed 004;
METHODS.md, "DeltaKV").

The model runs with a registered attention function that replaces, at every layer, the keys and
values of every non-reference token with their reconstruction x̂ = f_d(f_c(x) − f_c(m)) + m (m the
mean of the token's nearest earlier references, exactly as the codec stores it; RoPE undone and
re-applied), then attends causally. Loss = ``mse`` · mean over layers of the relative
reconstruction error ‖(x − x̂)/σ‖² / ‖(x − m)/σ‖² over the coded tokens (σ: the layer's per-channel
input scale, so that values weigh like keys — in raw units a few large key channels dominate and
the values were left at the references' mean; 1 = no better than that mean; every layer weighs
alike) + ``kl`` · KL(p_full ‖ p_reconstructed)
of the next-token distributions + ``next_token`` · the next-token cross-entropy of the model run on
reconstructed K/V. The paper's hybrid objective is MSE + next-token loss; here the next-token term
is the full model's distribution (KL) by default: with the cross-entropy at weight 1 the
reconstruction error did not move in 64 steps (1.00), and without a next-token term it fell to 0.56
in 60 steps while the cross-entropy rose from ~3 to 13–16 (docs/results.md). Only the codec learns
(AdamW, warm-up then cosine decay); each layer's input scale is fixed from the first sequence, and
each layer starts at the best linear code of its residuals on ``principal`` sequences (the top d_c
principal components; ``fit_principal``). With ``bits=4`` the forward rounds each token's code to
4 bits as the store does (straight-through gradients), so the codec learns what is read back.

Data, resuming and snapshots: ``train/loop.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..models import model_facts, rotary_embedding
from ..store.deltakv import DeltaKVWeights, four_bit, nearest_references, reference_mask, split_vectors, token_vectors
from .loop import GENERATED_DATA, fit, mean_tail, training_sequences, use_attention

CODED = "kvcompress_deltakv_train"


@dataclass
class DeltaKVTraining:
    """Hyperparameters of a run (stored in config.json); the defaults made the shipped checkpoint."""

    steps: int = 800
    seq_len: int = 512
    hidden: int = 128  # the compressor's width d_h
    code_ratio: float = 0.5  # d_c / (2·H·d); the paper's is 0.25 (why half in 4 bits: docs/results.md, "Why commit 1858615's codec failed")
    bits: int | None = 4  # codes as the method stores them by default: 4 bits per number (None: float)
    stride: int = 10
    top_k: int = 4
    sinks: int = 4
    lr: float = 1e-4  # from the principal start; 1e-3 (the random start's) undid it: KL 0.05 → 0.25 in 50 steps
    warmup: float = 0.02
    mse: float = 1.0
    next_token: float = 0.0
    kl: float = 1.0
    seed: int = 0
    save_every: int = 100
    principal: int = 16  # sequences whose residuals start each layer at its best linear code (0: a random start)


class _Coding:
    """What the coding attention function reads during a forward: the codec (None: plain attention)
    and where each layer's relative reconstruction error goes."""

    weights: DeltaKVWeights | None = None
    errors: list[torch.Tensor] = []
    fitting_scale = False  # set each layer's input scale from the plain model's keys and values
    residuals: dict[int, list[torch.Tensor]] | None = None  # collect each layer's scaled residuals (plain model)
    layers: set[int] | None = None  # the layers coded (None: all)
    bits: int | None = None  # codes rounded to 4 bits in the forward (gradients pass straight through)


def coded_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention over reconstructed keys and values (references exact); records the layer's
    relative error. Plain SDPA when no codec is set, while fitting scales or collecting residuals,
    and on the layers ``_Coding.layers`` leaves out."""
    weights, layer = _Coding.weights, module.layer_idx
    plain = weights is None or _Coding.fitting_scale or _Coding.residuals is not None
    if plain or (_Coding.layers is not None and layer not in _Coding.layers):
        if weights is not None and _Coding.fitting_scale:
            weights.fit_scale(layer, token_vectors(key, value, torch.arange(key.shape[2]), weights.inv_freq))
        elif weights is not None and _Coding.residuals is not None:
            x, means, coded = _token_means(weights, key, value)
            _Coding.residuals.setdefault(layer, []).append(((x - means) / weights.scale[layer])[:, coded].flatten(0, 1))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    x, means, coded = _token_means(weights, key, value)
    positions = torch.arange(key.shape[2], device=key.device)
    z = weights.code(layer, x, means)
    if _Coding.bits == 4:
        z = z + (four_bit(z.detach()) - z).detach()  # the stored code's value, the float code's gradient
    x_hat = weights.reconstruct(layer, z, means)
    x_hat = torch.where(coded[None, :, None], x_hat, x)
    scale, target = weights.scale[layer], x.detach()  # errors per channel in units of its spread: values weigh like keys
    error = (((x_hat - target) / scale)[:, coded].pow(2).sum()
             / ((means.detach() - target) / scale)[:, coded].pow(2).sum().clamp_min(1e-12))
    _Coding.errors.append(error)
    keys, values = split_vectors(x_hat, positions, key.shape[1], weights.inv_freq)
    return sdpa_attention_forward(module, query, keys.to(query.dtype), values.to(query.dtype), attention_mask,
                                  dropout=dropout, scaling=scaling, **kwargs)


def _token_means(weights: DeltaKVWeights, key: torch.Tensor, value: torch.Tensor):
    """Token vectors x [B, n, 2Hd] of a layer's keys/values [B, H, n, d], each token's reference mean
    [B, n, 2Hd] (itself for references) and which tokens are coded [n]."""
    positions = torch.arange(key.shape[2], device=key.device)
    x = token_vectors(key, value, positions, weights.inv_freq)
    is_ref = reference_mask(positions, weights.stride, weights.sinks)
    means = torch.stack([_reference_means(row, positions, is_ref, weights.top_k) for row in x])
    return x, means, ~is_ref


def _reference_means(x: torch.Tensor, positions: torch.Tensor, is_ref: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's mean of its k nearest earlier references [n, 2Hd] (the first token, a reference, gets
    itself: it is never coded)."""
    refs = x[is_ref]
    coded = ~is_ref
    means = x.clone()
    nearest = nearest_references(x[coded].detach(), refs.detach(), positions[is_ref], positions[coded], k)
    means[coded] = refs[nearest].mean(1)
    return means


def losses(model, weights: DeltaKVWeights, ids: torch.Tensor, settings: DeltaKVTraining) -> dict:
    """Relative reconstruction error, next-token cross-entropy, KL to the full model and their weighted sum."""
    teacher = None
    if settings.kl:
        _Coding.weights = None
        with torch.no_grad():
            teacher = F.log_softmax(model(ids).logits.float(), dim=-1)
    _Coding.weights, _Coding.errors, _Coding.bits = weights, [], settings.bits
    try:
        student = F.log_softmax(model(ids).logits.float(), dim=-1)
        mse = torch.stack(_Coding.errors).mean()
    finally:
        _Coding.weights, _Coding.errors, _Coding.bits = None, [], None
    ce = F.nll_loss(student[:, :-1].reshape(-1, student.shape[-1]), ids[:, 1:].reshape(-1))
    kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean() if teacher is not None else ce.new_zeros(())
    total = settings.mse * mse + settings.next_token * ce + settings.kl * kl
    return {"loss": total, "mse": mse, "ce": ce, "kl": kl}


def new_weights(model, settings: DeltaKVTraining) -> DeltaKVWeights:
    """An untrained codec for ``model`` (its RoPE frequencies; widths from ``settings``)."""
    facts = model_facts(model)
    rotary = rotary_embedding(model)
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ValueError("deltakv re-applies plain RoPE; this model's rotary embedding scales attention "
                         f"({rotary.attention_scaling}), which the codec does not reproduce")
    width = 2 * facts.num_kv_heads * facts.head_dim
    return DeltaKVWeights(facts.num_layers, facts.num_kv_heads, facts.head_dim, rotary.inv_freq, hidden=settings.hidden,
                          code_width=max(1, round(settings.code_ratio * width)), stride=settings.stride,
                          top_k=settings.top_k, sinks=settings.sinks, seed=settings.seed)


def train_deltakv(model, tokenizer, out: Path | str, settings: DeltaKVTraining, *, data: str | None = None,
                  model_name: str = "", full_layers: tuple[int, ...] = (0,), progress: bool = True) -> dict:
    """Train a codec for every layer of ``model`` (frozen) and write ``out``/model.safetensors + config.json
    (``full_layers``: the layers the method leaves uncoded by default; ``layer_kl``: each layer's cost when
    coded alone, on two held-out sequences — ``profile_layers``); returns the final losses. Resumes from
    ``out``/state.pt when a previous run left one."""
    out = Path(out)
    torch.manual_seed(settings.seed)
    weights = new_weights(model, settings)
    restore = _use_coded_attention(model)
    try:
        start = training_sequences(tokenizer, settings.seq_len, settings.seed, data)
        _fit_scale(model, weights, next(start))
        if settings.principal:
            fit_principal(model, weights, [next(start) for _ in range(settings.principal)])
        history, seconds = fit(
            model, weights, lambda ids: losses(model, weights, ids, settings), out, asdict(settings),
            tokenizer=tokenizer, data=data, steps=settings.steps, seq_len=settings.seq_len, seed=settings.seed,
            lr=settings.lr, warmup=settings.warmup, save_every=settings.save_every,
            save=lambda folder, about: weights.save(folder, model=model_name, full_layers=list(full_layers), **about),
            what="deltakv", shown=("mse", "kl"), progress=progress)
    finally:
        restore()
    final = mean_tail(history)
    held_out = training_sequences(tokenizer, settings.seq_len, settings.seed + 1, data)  # samples training never saw
    profile = profile_layers(model, weights, [next(held_out) for _ in range(2)], bits=settings.bits)
    weights.save(out, model=model_name, full_layers=list(full_layers), settings=asdict(settings), data=data or GENERATED_DATA,
                 final_losses=final, train_seconds=round(seconds, 1), layer_kl=profile,
                 history=history[:: max(1, len(history) // 100)])
    return final


def profile_layers(model, weights: DeltaKVWeights, sequences: list[list[int]], bits: int | None = None) -> list[float]:
    """Per layer, KL(p_full ‖ p) of the next-token distributions when only that layer is coded (every
    non-reference token rebuilt, codes in ``bits``), averaged over ``sequences``: which layers to leave full."""
    restore = _use_coded_attention(model)
    totals = [0.0] * weights.w_gate.shape[0]
    _Coding.bits = bits
    try:
        with torch.no_grad():
            for ids in sequences:
                ids = torch.tensor([ids], device=model.device)
                _Coding.weights = None
                full = F.log_softmax(model(ids).logits.float(), dim=-1)
                for layer in range(len(totals)):
                    _Coding.weights, _Coding.layers = weights, {layer}
                    coded = F.log_softmax(model(ids).logits.float(), dim=-1)
                    totals[layer] += float(F.kl_div(coded, full, log_target=True, reduction="none").sum(-1).mean()) / len(sequences)
    finally:
        _Coding.weights, _Coding.errors, _Coding.layers, _Coding.bits = None, [], None, None
        restore()
    return [round(t, 5) for t in totals]


def fit_principal(model, weights: DeltaKVWeights, sequences: list[list[int]]) -> None:
    """Start every layer of ``weights`` at the best linear code of its residuals on ``sequences`` run
    through the plain model (``DeltaKVWeights.fit_principal``)."""
    restore = _use_coded_attention(model)
    _Coding.weights, _Coding.residuals = weights, {}
    try:
        with torch.no_grad():
            for ids in sequences:
                model(torch.tensor([ids], device=model.device))
        for layer, parts in _Coding.residuals.items():
            weights.fit_principal(layer, torch.cat(parts))
    finally:
        _Coding.weights, _Coding.residuals = None, None
        restore()


def _fit_scale(model, weights: DeltaKVWeights, ids: list[int]) -> None:
    """Each layer's input scale from one sequence run through the (untrained) codec."""
    _Coding.weights, _Coding.errors, _Coding.fitting_scale = weights, [], True
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device))
    finally:
        _Coding.weights, _Coding.errors, _Coding.fitting_scale = None, [], False


def _use_coded_attention(model):
    """Switch ``model`` to the coding attention; returns the undo."""
    return use_attention(model, CODED, coded_attention)
