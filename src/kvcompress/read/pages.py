"""The best pages of each KV head by their bound, as the entry columns a decoding read takes (Quest's choice).

    top_pages(query, bounds, useful, count, protected, open, page_size, pages) -> columns [B, H, W + pages · page_size]

A page's bound, for grouped queries [B, H, G, d] and each page's per-channel minimum and maximum key ``bounds``
[B, H, P, 2, d] (the store's), is Σ_c max(q_c·min_c, q_c·max_c), the largest q·k any key inside the page can reach
(``page_bounds_torch``). Per (row, KV head): a page's score is the largest of its query heads' bounds where ``useful``
[B, H, P], else -inf; pages rank by score, of equal scores the earlier page first (a stable descending sort), and the
first ``pages`` are laid out page after page: column p · page_size + t where the page is among the head's ``count``
[B, H] best, scores above -inf, and ``open`` [B, H, P · page_size] holds at that column, else -1 (a hole). The head's
``protected`` columns [B, H, W] (-1: none) come first, as given. Bounds are never NaN.

On the CPU the compiled kernel (``kvcompress/csrc/top_pages.cpp``, built with the decoding read's) does it in one call
per layer, bounds and ranking (the PyTorch path is a score of small operations, each paying its dispatch); elsewhere, or
where the kernels are not built, ``top_pages_torch`` over ``page_bounds_torch``, the references it is tested against.
"""

from __future__ import annotations

import torch

from ..kernels import cpu_kernels


def top_pages(query: torch.Tensor, bounds: torch.Tensor, useful: torch.Tensor, count: torch.Tensor, protected: torch.Tensor,
              open_columns: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """The columns a head reads: its protected ones, then its best pages' by bound (see the module docstring)."""
    kernel = cpu_kernels() if query.device.type == "cpu" else None
    if kernel is None:
        return top_pages_torch(page_bounds_torch(query, bounds), useful, count, protected, open_columns, page_size, pages)
    return kernel.top_pages(query.float().contiguous(), bounds, useful.contiguous(), count.long().contiguous(),
                            protected.long().contiguous(), open_columns.contiguous(), page_size, pages)


def page_bounds_torch(query: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Each page's upper bound of q·k [B, H, G, P], float32 (see the module docstring), in plain PyTorch: the reference."""
    q = query.float()
    # max(q_c·min_c, q_c·max_c) = min(q_c, 0)·min_c + max(q_c, 0)·max_c (min_c ≤ max_c): one product of [q⁻, q⁺] with
    # each page's [min, max] (the bounds' own layout, flattened)
    signed = torch.cat([q.clamp(max=0), q.clamp(min=0)], dim=-1)  # [B, H, G, 2d]
    return signed @ bounds.float().flatten(-2).transpose(-1, -2)


def top_pages_torch(bound: torch.Tensor, useful: torch.Tensor, count: torch.Tensor, protected: torch.Tensor,
                    open_columns: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """``top_pages`` in plain PyTorch from the bounds ``bound`` [B, H, G, P] (``page_bounds_torch``): the reference."""
    score = bound.float().amax(dim=2).masked_fill(~useful, float("-inf"))  # [B, H, P]: the group's best
    best, chosen = score.sort(dim=-1, descending=True, stable=True)
    best, chosen = best[..., :pages], chosen[..., :pages]
    taken = (torch.arange(pages, device=bound.device) < count[..., None].to(bound.device)) & (best > float("-inf"))
    columns = (chosen[..., None] * page_size + torch.arange(page_size, device=bound.device)).flatten(-2)  # [B, H, pages · size]
    inside = taken.repeat_interleave(page_size, dim=-1) & open_columns.gather(-1, columns)
    return torch.cat([protected.long(), columns.masked_fill(~inside, -1)], dim=-1)


__all__ = ["page_bounds_torch", "top_pages", "top_pages_torch"]
