"""Triton kernels of the non-finite guard (see `non_finite_guard.py` for the entry points).

Plain functions: `lazy_jit.jitted` decorates them on first launch. t is `[R, H, D]` with a unit last stride and
row / head strides `ROW_STRIDE` / `HEAD_STRIDE` (a head slice of a wider tensor reads in place); outputs are
contiguous `[R, H, D]`, flags contiguous `[R, H]` bytes. One program holds `BLOCK_N` whole head vectors
(`BLOCK_D ≥ D`), so every element is read at most once.
"""

import triton
import triton.language as tl


@triton.jit
def _vectors(ROW_STRIDE, HEAD_STRIDE, N, H, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """`(vectors [BLOCK_N], valid [BLOCK_N], mask [BLOCK_N, BLOCK_D], t's offsets, contiguous offsets)` of
    this program's head vectors."""
    vectors = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    valid = vectors < N
    mask = valid[:, None] & (dims < D)[None, :]
    rows, heads = vectors // H, vectors % H
    return (vectors, valid, mask, (rows * ROW_STRIDE + heads * HEAD_STRIDE)[:, None] + dims[None, :],
            vectors[:, None] * D + dims[None, :])


def finite_stand_in_kernel(t_ptr, out_ptr, flags_ptr, N, H, ROW_STRIDE, HEAD_STRIDE, D: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = t with 0 in place of every NaN and infinity; flags[n] = 1 where vector n held one."""
    vectors, valid, mask, t_offsets, offsets = _vectors(ROW_STRIDE, HEAD_STRIDE, N, H, D, BLOCK_N, BLOCK_D)
    t = tl.load(t_ptr + t_offsets, mask=mask, other=0.0)
    wide = t.to(tl.float32)
    finite = (wide - wide) == 0.0  # x − x is NaN exactly for NaN and ±inf
    tl.store(out_ptr + offsets, tl.where(finite, t, tl.zeros_like(t)), mask=mask)
    flagged = tl.max((~finite).to(tl.int32), axis=1)
    tl.store(flags_ptr + vectors, flagged.to(tl.int8), mask=valid)


def fill_flagged_kernel(t_ptr, flags_ptr, out_ptr, fill, N, H, ROW_STRIDE, HEAD_STRIDE, D: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = t, with `fill` in every element of the vectors whose flag is set (those are not read)."""
    vectors, valid, mask, t_offsets, offsets = _vectors(ROW_STRIDE, HEAD_STRIDE, N, H, D, BLOCK_N, BLOCK_D)
    flagged = tl.load(flags_ptr + vectors, mask=valid, other=0) != 0
    t = tl.load(t_ptr + t_offsets, mask=mask & ~flagged[:, None], other=fill)
    tl.store(out_ptr + offsets, t, mask=mask)
