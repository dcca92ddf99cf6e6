"""Per-row slot tables (or log-weight tables) of the paged read as one padded tensor, for the reads that need one."""

from __future__ import annotations

import torch
import torch.nn.functional as F


KIVI_FIELDS = ("key_codes", "key_zero", "key_scale", "value_codes", "value_zero", "value_scale")  # the kernels' order


def stacked(tables: list[torch.Tensor], length: int, fill) -> torch.Tensor:
    """Per-row [H, capacity_r] tables (capacities may differ) → one contiguous [R, H, length], ``fill`` past a
    table's own columns."""
    return torch.stack([F.pad(t[:, :length], (0, max(0, length - t.shape[1])), value=fill) for t in tables]).contiguous()


def stacked_log_weights(tables: list[torch.Tensor], log_weights: list[torch.Tensor | None] | None, length: int) -> torch.Tensor | None:
    """The rows' log-weights as one float32 [R, H, length] (0 where a row has none, and past a table's columns); None
    when no row has any."""
    if log_weights is None or all(w is None for w in log_weights):
        return None
    return stacked([torch.zeros(t.shape, device=t.device) if w is None else w.float() for t, w in zip(tables, log_weights)], length, 0.0)


__all__ = ["KIVI_FIELDS", "stacked", "stacked_log_weights"]
