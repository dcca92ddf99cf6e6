"""Per-row slot tables (and log-weight tables) of the paged read: a decoding read's selection laid over them
(``select_pages``: compiled on the CPU, ``csrc/select_tables.cpp``; ``select_tables_torch`` its reference and the path
elsewhere), and the tables as one padded tensor, for the reads that need one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import NOTHING, cpu_kernels
from ..store.view import Pages


KIVI_FIELDS = ("key_codes", "key_zero", "key_scale", "value_codes", "value_zero", "value_scale")  # the kernels' order


def kernel_log_weights(log_weights: list[torch.Tensor | None] | None, rows: int) -> list[torch.Tensor]:
    """Each row's log-weights as the compiled kernels take them: an empty tensor for none."""
    return [NOTHING if w is None else w for w in log_weights] if log_weights else [NOTHING] * rows


def select_pages(pages: Pages, columns: torch.Tensor) -> Pages:
    """The entries at ``columns`` [B, H, k] (int64, -1: none) of each head, where they live: per row the slot table
    [H, k] (0, a hole, where -1) and its log-weights (0 on a hole); each head reads up to its last chosen column (its
    trailing holes left out: a selection of every entry reads as the plain read does)."""
    kernel = cpu_kernels() if columns.device.type == "cpu" else None
    if kernel is None:
        return Pages(pages.arrays, *select_tables_torch(pages.tables, pages.log_weights, columns))
    rows = len(pages.tables)
    selected = kernel.select_tables(pages.tables, kernel_log_weights(pages.log_weights, rows), columns.long().contiguous())
    log_weights = [None if w is None else t for w, t in zip(pages.log_weights, selected[rows : 2 * rows])]
    return Pages(pages.arrays, selected[:rows], selected[2 * rows], log_weights)


def select_tables_torch(tables: list[torch.Tensor], log_weights: list[torch.Tensor | None], columns: torch.Tensor
                        ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor | None]]:
    """``select_pages``' tables, lengths and log-weights in plain PyTorch: the reference."""
    hole, safe = columns < 0, columns.clamp(min=0).long()
    selected = [t.gather(-1, safe[r]).masked_fill_(hole[r], 0) for r, t in enumerate(tables)]
    weights = [None if w is None else w.gather(-1, safe[r]).masked_fill_(hole[r], 0.0) for r, w in enumerate(log_weights)]
    reach = torch.arange(1, columns.shape[-1] + 1, device=columns.device).masked_fill(hole, 0)  # [B, H, k]: j + 1 where chosen
    lengths = reach.amax(-1).cpu() if columns.shape[-1] else torch.zeros(columns.shape[:2], dtype=torch.long)
    return selected, lengths, weights


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


__all__ = ["KIVI_FIELDS", "kernel_log_weights", "select_pages", "select_tables_torch", "stacked", "stacked_log_weights"]
