"""Layout glue between our dense (`M` kind) attention contract and the vendor kernels.

Ours: `q [T, H, Dqk]`, `k [T, G, Dqk]`, `v [T, G, Dv]` flat rows in the segments of a `TokenLayout`,
causal within each segment; returns `out [T, H, Dv]` and natural-log `lse [T, H]` float32.
Rows past `cu_seqlens[-1]` (capacity tail) belong to the last segment, as in the reference (its
segment ids clamp to the last segment), so varlen kernels get the last boundary moved to `T`;
padding rows inside a segment are ordinary causal rows there, in both paths. Tail rows are padding:
where the tail runs the last segment past `max_seqlen`, the reference looks back at most `max_seqlen`
rows while FlashAttention-4 looks back to the segment start (both finite; the layer zeroes these rows),
and real rows never see tail keys. Passing `T` as the bound instead changed no FA4 output on an H200
and cost it ~5% on 8 packed sequences of 2048 rows, so the given `max_seqlen` stays for FA4.
FlashAttention-2 launches row blocks only up to `max_seqlen` per segment and leaves rows past it
unwritten (`torch.empty`: possibly NaN, also in dk/dv); the host cannot know whether a tail exists
without reading the device, so FA2 and FA3 (whose grids we could not inspect on a GPU) get `T` for
every non-uniform layout (`cover_tail`; a uniform layout has no tail).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.ops.layout import TokenLayout


def varlen_boundaries(layout: TokenLayout, cover_tail: bool = False) -> tuple[Tensor, int]:
    """`(cu_seqlens [B+1] int32 ending at T, max_seqlen)` for FlashAttention-style varlen kernels.

    `cover_tail`: the bound also covers a capacity tail joined to the last segment (`T` unless the
    layout is uniform), for kernels that skip rows past `max_seqlen`.
    """
    cu = layout.cu_seqlens.to(torch.int32).clone()
    cu[-1] = layout.num_rows
    longest = layout.num_rows if cover_tail and layout.uniform_shape is None else layout.max_seqlen
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
