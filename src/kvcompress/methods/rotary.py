"""RoPE helpers shared by scorers that model future queries (GVote's samples, Expected Attention's statistics)."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import rotate_half


def averaged_rotary(rotary: torch.nn.Module, start: torch.Tensor, count: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, d] float32 averaged over positions ``start[b] … start[b] + count − 1`` (the model's own rotary)."""
    positions = start.long().to(like.device)[:, None] + torch.arange(count, device=like.device)[None, :]
    cos, sin = rotary(like.float(), positions)
    return cos.float().mean(dim=1), sin.float().mean(dim=1)


def apply_rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE, ``q·cos + rotate_half(q)·sin``, for q [B, Hq, S, d] and cos/sin [B, d]."""
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    return q * cos + rotate_half(q) * sin


__all__ = ["apply_rotary", "averaged_rotary"]
