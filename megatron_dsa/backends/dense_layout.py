"""Layout glue between our dense (`M` kind) attention contract and the vendor kernels.

Ours: `q [T, H, Dqk]`, `k [T, G, Dqk]`, `v [T, G, Dv]` flat rows in the segments of a `TokenLayout`,
causal within each segment; returns `out [T, H, Dv]` and natural-log `lse [T, H]` float32.
Rows past `cu_seqlens[-1]` (capacity tail) belong to the last segment, as in the reference (its
segment ids clamp to the last segment), so varlen kernels get the last boundary moved to `T`;
padding rows inside a segment are ordinary causal rows there, in both paths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.ops.layout import TokenLayout


def varlen_boundaries(layout: TokenLayout) -> tuple[Tensor, int]:
    """`(cu_seqlens [B+1] int32 ending at T, max_seqlen)` for FlashAttention-style varlen kernels.

    Varlen kernels size their grids from `max_seqlen` and leave rows past it unscored, so the bound must
    cover the last segment *with* the capacity tail, whose length only the device knows. Uniform layouts
    have no tail (their own `max_seqlen`); any other layout gets `T`, a bound that costs FlashAttention-4
    ~5% on 8 packed sequences of 2048 rows (H200) and needs no device read."""
    cu = layout.cu_seqlens.to(torch.int32).clone()
    cu[-1] = layout.num_rows
    longest = layout.max_seqlen if layout.uniform_shape is not None else layout.num_rows
    return cu, max(longest, 1)


def rows_first_lse(lse: Tensor, rows: int, heads: int) -> Tensor:
    """LSE as `[T, H]` float32 from a kernel that may return it head-major (`[H, T]`)."""
    if lse.shape == (heads, rows) and (heads != rows or lse.is_contiguous()):
        lse = lse.transpose(0, 1)
    return lse.float().contiguous()


def expand_groups(t: Tensor, heads: int) -> Tensor:
    """`[T, G, D]` → `[T, H, D]` (GQA: query head `h` reads group `h // (H/G)`); autograd sums back."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def to_batch(t: Tensor, batch: int, seqlen: int) -> Tensor:
    """`[B·S, H, D]` → `[B, H, S, D]`."""
    return t.view(batch, seqlen, t.shape[1], t.shape[2]).transpose(1, 2)


def from_batch(t: Tensor) -> Tensor:
    """`[B, H, S, D]` → `[B·S, H, D]`."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
