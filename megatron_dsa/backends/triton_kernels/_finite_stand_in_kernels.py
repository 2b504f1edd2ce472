"""Triton kernel of the non-finite guard (see `finite_stand_in.py` for the entry point).

Plain functions: `lazy_jit.jitted` decorates the kernel on first launch. t is `[R, H, D]` with a unit last
stride and row / head strides `ROW_STRIDE` / `HEAD_STRIDE` (a head slice of a wider tensor reads in place);
the stand-in is contiguous `[R, H, D]` and the flags contiguous `[R, H]` bytes. One program holds `BLOCK_N`
whole head vectors (`BLOCK_D ≥ D`), so every element is read once.
"""

import triton
import triton.language as tl


def finite_stand_in_kernel(t_ptr, out_ptr, flags_ptr, N, H, ROW_STRIDE, HEAD_STRIDE, D: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = t with 0 in place of every NaN and infinity; flags[n] = 1 where vector n held one."""
    vectors = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    mask = (vectors < N)[:, None] & (dims < D)[None, :]
    rows, heads = vectors // H, vectors % H
    t = tl.load(t_ptr + (rows * ROW_STRIDE + heads * HEAD_STRIDE)[:, None] + dims[None, :], mask=mask, other=0.0)
    wide = t.to(tl.float32)
    finite = (wide - wide) == 0.0  # x − x is NaN exactly for NaN and ±inf
    tl.store(out_ptr + vectors[:, None] * D + dims[None, :], tl.where(finite, t, tl.zeros_like(t)), mask=mask)
    flagged = tl.max((~finite).to(tl.int32), axis=1)
    tl.store(flags_ptr + vectors, flagged.to(tl.int8), mask=vectors < N)
