"""Layout glue between our dense (`M` kind) attention contract and the vendor kernels, shared by the
dense backends (FlashAttention's varlen bounds; cuDNN's and torch's batched SDPA kernels).

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

import functools
from typing import Callable

import torch
from torch import Tensor

from megatron_dsa.backends.registry import OpFamily, count_variant
from megatron_dsa.backends.triton_kernels import non_finite_guard as triton_guard
from megatron_dsa.backends.triton_kernels.availability import triton_decline_reason
from megatron_dsa.ops.dense_attention import finite_stand_in, non_finite_heads
from megatron_dsa.ops.layout import TokenLayout

# (q [T, H, Dqk], k [T, G, Dqk], v [T, G, Dv], layout, scale) -> (out [T, H, Dv], lse [T, H])
DenseAttention = Callable[[Tensor, Tensor, Tensor, TokenLayout, float], tuple[Tensor, Tensor]]


def varlen_boundaries(layout: TokenLayout, cover_tail: bool = False) -> tuple[Tensor, int]:
    """`(cu_seqlens [B+1] int32 ending at T, max_seqlen)` for FlashAttention-style varlen kernels.

    `cover_tail`: the bound also covers a capacity tail joined to the last segment (`T` unless the
    layout is uniform), for kernels that skip rows past `max_seqlen`.
    """
    cu = layout.cu_seqlens.to(torch.int32).clone()
    cu[-1:].fill_(layout.num_rows)  # a fill kernel: a host int set by index is a synchronous copy (no graph capture)
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


def isolate_non_finite(attend: DenseAttention) -> DenseAttention:
    """`attend` with the reference's handling of NaN and infinity: a row whose visible set (its query
    and the keys and values of its segment up to it) holds a non-finite element gets NaN `out` and
    `lse`; every other row is exactly what it is without that element.

    Fused kernels multiply masked probabilities (0) with every key row of a tile, and 0·NaN = NaN: a
    NaN at a later token of the tile, or (kernels that load whole tiles across a varlen boundary) in
    the next sequence, would reach rows that cannot see it. So the kernel runs on finite stand-ins (0
    per non-finite element; their gradient passes through, `_StandIn`) and the rows that do see one are
    set to NaN afterwards (`_DeadRows`), from per-segment prefix counts: a few elementwise kernels, no
    host synchronisation. The NaN rows pass no gradient. Where Triton runs, each of q, k and v is read once
    for its stand-in and flags, and the NaN rows are written without being read (`triton_kernels.
    non_finite_guard`; counted once per call as Triton's `non_finite_guard` variant of `dense_attention`).
    """

    @functools.wraps(attend)
    def isolated(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout, scale: float) -> tuple[Tensor, Tensor]:
        if _guard_runs_triton(q):
            count_variant("triton", OpFamily.DENSE_ATTENTION, "non_finite_guard")
        heads = q.shape[1]
        (q_in, bad_q), (k_in, bad_k), (v_in, bad_v) = (_StandIn.apply(t) for t in (q, k, v))
        bad_key = expand_groups((bad_k | bad_v).unsqueeze(-1), heads)[..., 0]
        out, lse = attend(q_in, k_in, v_in, layout, scale)
        dead = bad_q | _sees_earlier_in_segment(bad_key, layout)
        return _DeadRows.apply(out, dead), torch.where(dead, float("nan"), lse)

    return isolated


def _guard_runs_triton(t: Tensor) -> bool:
    """The guard's passes over `t` run as Triton kernels: on a CUDA device (the CPU interpreter serves named
    requests only) and a dtype they take."""
    return triton_decline_reason(t.device) is None and t.dtype in triton_guard.SUPPORTED_DTYPES


def stand_in_and_flags(t: Tensor) -> tuple[Tensor, Tensor]:
    """`t [R, H, D]` → `(finite_stand_in(t), non_finite_heads(t))`: in one pass over t where Triton runs, else the
    two torch ops."""
    if _guard_runs_triton(t):
        return triton_guard.finite_stand_in_with_flags(t)
    return finite_stand_in(t), non_finite_heads(t)


def fill_dead_rows(t: Tensor, dead: Tensor, fill: float) -> Tensor:
    """`torch.where(dead.unsqueeze(-1), fill, t)` for `t [R, H, D]`, `dead [R, H]` bool: one Triton pass that does
    not read the dead rows where Triton runs."""
    if _guard_runs_triton(t):
        return triton_guard.fill_flagged(t, dead, fill)
    return torch.where(dead.unsqueeze(-1), fill, t)


class _StandIn(torch.autograd.Function):
    """`(finite_stand_in(t), non_finite_heads(t))` (`stand_in_and_flags`) whose backward passes the kernel's
    gradient through unchanged; the flags have none.

    `finite_stand_in`'s own backward multiplies by `isfinite(t)`, so autograd kept q, k and v for it and read
    them again, to zero gradients the kernel already makes 0. Every row holding a non-finite element is dead
    (its head's query), or is a key or value row that only dead rows see; dead rows' outputs and LSE are
    replaced by NaN, which passes them no gradient, so their dP and delta are 0 and so is every dS, dQ, dK and
    dV they contribute to; rows that cannot see the key meet it with probability 0. Where a live row's output
    gradient is itself non-finite, both versions pass the kernel's value (NaN · 0 is NaN)."""

    @staticmethod
    def forward(ctx, t: Tensor) -> tuple[Tensor, Tensor]:
        stand_in, flagged = stand_in_and_flags(t)
        ctx.mark_non_differentiable(flagged)
        return stand_in, flagged

    @staticmethod
    def backward(ctx, grad: Tensor, _flags_grad: None) -> Tensor:
        return grad


class _DeadRows(torch.autograd.Function):
    """`out [T, H, Dv]` with NaN in the rows `dead [T, H]` marks; their gradient is 0 (`torch.where`'s, with
    `fill_dead_rows` both ways)."""

    @staticmethod
    def forward(ctx, out: Tensor, dead: Tensor) -> Tensor:
        ctx.save_for_backward(dead)
        return fill_dead_rows(out, dead, float("nan"))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (dead,) = ctx.saved_tensors
        return fill_dead_rows(grad, dead, 0.0), None


def _sees_earlier_in_segment(flagged: Tensor, layout: TokenLayout) -> Tensor:
    """`[T, H]` bool: some row of the same segment at or before this one is `flagged [T, H]`.

    The prefix counts run along the rows of a head-major copy: torch scans a tensor's last dim in parallel,
    its first dim one column per thread (0.76 ms for `[4096, 64]` on an H200, 3 ms at 16384 rows)."""
    counts = flagged.t().to(torch.int32).cumsum(1, dtype=torch.int32)  # [H, T]
    before = torch.cat((torch.zeros_like(counts[:, :1]), counts), dim=1)[:, layout.segment_starts]
    return (counts > before).t()


# (q [B,H,S,Dqk], k [B,H,S,Dqk], v [B,H,S,Dv], scale) -> (out [B,H,S,Dv], lse [B,H,≥S])
BatchedKernel = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]


def batched_dense_attention(kernel: BatchedKernel) -> Callable[..., tuple[Tensor, Tensor]]:
    """The `dense_attention` contract on a batched causal kernel that returns its LSE (NaN and
    infinity isolated per row as in the reference, `isolate_non_finite`)."""

    @isolate_non_finite
    def dense_attention(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout,
                        scale: float) -> tuple[Tensor, Tensor]:
        shape = layout.uniform_shape
        if shape is None:
            raise ValueError("batched attention kernels need a uniform layout (the probe declines others)")
        batch, seqlen = shape
        heads = q.shape[1]
        out, lse = kernel(to_batch(q, batch, seqlen), to_batch(expand_groups(k, heads), batch, seqlen),
                          to_batch(expand_groups(v, heads), batch, seqlen), float(scale))
        lse = lse.reshape(batch, heads, -1)[..., :seqlen]  # some kernels pad S (or add a unit dim)
        return from_batch(out).to(q.dtype), lse.transpose(1, 2).reshape(-1, heads).float()

    return dense_attention
