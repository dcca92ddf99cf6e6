"""Shared builders for tests: tiny random models and layers filled with random entries."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from kvcompress.cache import LayerCache, LayerContext


def tiny_model(kind: str = "llama", layers: int = 2, seed: int = 0):
    """A randomly initialised Llama, Mistral, Qwen2 (q/k/v bias) or Qwen3 (q/k-norm) small enough for unit tests."""
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, pad_token_id=0,
    )
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    config = config_class(head_dim=16, **common)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # random models would stop at random; always decode in full
    return model


def random_layer(batch=1, heads=2, group=2, length=64, dim=8, window=8, seed=0, lengths=None):
    """A LayerCache holding random entries at positions 0..length-1 plus the last ``window`` queries.

    ``lengths`` (per batch row) left-pads shorter rows: their first tokens are padding.
    Returns (layer, context, queries [B, H·G, length, d], positions [B, length]).
    """
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, dim, generator=g)
    values = torch.randn(batch, heads, length, dim, generator=g)
    queries = torch.randn(batch, heads * group, length, dim, generator=g) * 2
    valid = None
    positions = torch.arange(length).expand(batch, length).clone()
    if lengths is not None:
        valid = torch.arange(length)[None, :] >= (length - torch.tensor(lengths))[:, None]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    layer = LayerCache(0, heads, dim)
    layer.append(keys, values, positions, valid)
    layer.observations["window_queries"] = queries[:, :, -window:]
    layer.observations["window_positions"] = positions[:, -window:]
    context = LayerContext(layer_idx=0, num_layers=4, module=None, scaling=dim**-0.5)
    return layer, context, queries, positions, valid


def kept_positions(layer) -> list[list[list[int]]]:
    """Per (row, head): the sorted original positions the layer holds."""
    lengths = layer.head_lengths()
    flat = layer.positions.tolist()
    out, i = [], 0
    for row in lengths.tolist():
        heads = []
        for n in row:
            heads.append(sorted(flat[i : i + n]))
            i += n
        out.append(heads)
    return out


def left_padded_batch(lengths: list[int], seed: int = 0, vocab: int = 128):
    """Random rows of the given lengths, left-padded into one batch: (rows, ids [B, n], mask [B, n])."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, vocab, (1, n), generator=gen) for n in lengths]
    width = max(lengths)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, width - row.shape[1] :] = row
        mask[i, width - row.shape[1] :] = 1
    return rows, batch, mask
