"""Row selections whose map is known ahead: `out = x[index]` with a gradient gathered back, not scattered.

`x.index_select(0, index)`'s backward adds the gradient into a zero-filled tensor with atomics
(`index_add_`): on an H200 ~330 µs for 16k rows of 4096 bf16 features, ten times the gather of the
forward. When every source row is taken at most once, the backward is a gather too: source row `i` takes
the gradient of the output row that took it, and the rows no output took get zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class RowMap:
    """`out = x[index]` for `x [sources, ...]` and a fixed `index [n]` (long, on the device).

    inverse: `[sources]` an output row that took each source row (0 where none took it), or None when some
    source row is taken twice or the index is empty (then the backward is `index_select`'s own). uncovered:
    `[u]` the source rows whose gradient is zero (no output row took them, or they are `free`)."""

    index: Tensor
    inverse: Optional[Tensor]
    uncovered: Optional[Tensor]

    @classmethod
    def build(cls, index: Tensor, sources: int, device: torch.device, free: Iterable[int] = ()) -> "RowMap":
        """From `index [n]` (long, on the host) into `sources` rows. `free`: source rows the caller needs no
        gradient of (a zero row appended for padding), which may be taken any number of times."""
        index = index.to(torch.long).cpu()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= sources):
            raise ValueError(f"row map index must lie in [0, {sources}), got [{int(index.min())}, {int(index.max())}]")
        free_rows = torch.zeros(sources, dtype=torch.bool)
        free_rows[list(free)] = True
        taken = torch.bincount(index, minlength=sources)
        if not index.numel() or bool(((taken > 1) & ~free_rows).any()):
            return cls(index.to(device), None, None)
        inverse = torch.zeros(sources, dtype=torch.long)
        inverse[index] = torch.arange(index.numel())
        uncovered = torch.nonzero((taken == 0) | free_rows).flatten()
        return cls(index.to(device), inverse.to(device), uncovered.to(device))

    def take(self, x: Tensor) -> Tensor:
        """`x [sources, ...]` → `x[index]` `[n, ...]`, differentiable in `x`."""
        if self.inverse is None or not (torch.is_grad_enabled() and x.requires_grad):
            return x.index_select(0, self.index)
        return _TakeRows.apply(x, self.index, self.inverse, self.uncovered)


class _TakeRows(torch.autograd.Function):
    """`x[index]`, with the gradient gathered through the inverse map (`RowMap`)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor, uncovered: Tensor) -> Tensor:
        ctx.save_for_backward(inverse, uncovered)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        inverse, uncovered = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse)
        if uncovered.numel():
            grad_x.index_fill_(0, uncovered, 0)
        return grad_x, None, None, None
