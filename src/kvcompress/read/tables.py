"""Per-row slot tables (or log-weight tables) of the paged read as one padded tensor, for the reads that need one."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def stacked(tables: list[torch.Tensor], length: int, fill) -> torch.Tensor:
    """Per-row [H, capacity_r] tables (capacities may differ) → one contiguous [R, H, length], ``fill`` past a
    table's own columns."""
    return torch.stack([F.pad(t[:, :length], (0, max(0, length - t.shape[1])), value=fill) for t in tables]).contiguous()


__all__ = ["stacked"]
