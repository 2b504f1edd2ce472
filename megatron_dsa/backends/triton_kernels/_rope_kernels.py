"""Triton kernel of partial interleaved RoPE (see `rope.py` for the entry point and the math).

The kernel is a plain function: `lazy_jit.jitted` decorates it on first launch. `rotate_pairs`, the
rounded rotation it shares with the fused RMSNorm + RoPE kernels, is decorated here: this module
imports triton at the top and is itself imported only on first launch. x and out are contiguous
`[R, Dh]` rows (R = T·H); row r belongs to token r // H.
"""

import triton
import triton.language as tl


@triton.jit
def rotate_pairs(even, odd, angles, amplitude, INVERSE: tl.constexpr, dtype: tl.constexpr,
                 COMPUTE: tl.constexpr):
    """Pairs `(even, odd)` `[rows, pairs]` (COMPUTE values that x's dtype holds) rotated by `angles`.

    Rounding follows the reference op step by step: angles and cos/sin in COMPUTE (float32, or
    float64 for float64 x), cos·amplitude and sin·amplitude rounded to x's `dtype`, each product
    rounded to `dtype`, then their sum rounded again (what eager PyTorch does for 16-bit x). The
    results are COMPUTE values that `dtype` holds. `INVERSE` rotates by −angles."""
    cos = (tl.cos(angles) * amplitude).to(dtype).to(COMPUTE)
    sin = (tl.sin(angles) * amplitude).to(dtype).to(COMPUTE)
    if INVERSE:
        sin = -sin
    new_even = (even * cos).to(dtype).to(COMPUTE) - (odd * sin).to(dtype).to(COMPUTE)
    new_odd = (odd * cos).to(dtype).to(COMPUTE) + (even * sin).to(dtype).to(COMPUTE)
    return new_even, new_odd


@triton.jit
def pair_layout(pos_ptr, freq_ptr, rows, row_ok, H, NOPE: tl.constexpr, HALF: tl.constexpr,
                WIDTH: tl.constexpr, BLOCK_HALF: tl.constexpr, ONE_TOKEN: tl.constexpr, COMPUTE: tl.constexpr):
    """`(even_offsets, mask, angles)` of the rotated pairs, `[BLOCK_R, BLOCK_HALF]`: pair i of row r
    sits at dims NOPE + 2i, NOPE + 2i + 1 and turns by positions[r // H]·freq[i] (in COMPUTE).

    `ONE_TOKEN`: the rows of the block are heads of one token (BLOCK_R divides H), so the angles are
    `[1, BLOCK_HALF]`, and the cos/sin made of them are computed once for all the block's heads (with
    64 heads of 128 dims, the per-row trigonometry made RoPE compute-bound at twice a copy's time)."""
    pairs = tl.arange(0, BLOCK_HALF)
    mask = row_ok[:, None] & (pairs[None, :] < HALF)
    freq = tl.load(freq_ptr + pairs, mask=pairs < HALF, other=0.0)
    if ONE_TOKEN:
        angles = (tl.load(pos_ptr + tl.min(rows, axis=0) // H).to(COMPUTE) * freq)[None, :]
    else:
        positions = tl.load(pos_ptr + rows // H, mask=row_ok, other=0).to(COMPUTE)
        angles = positions[:, None] * freq[None, :]
    return rows[:, None] * WIDTH + NOPE + 2 * pairs[None, :], mask, angles


def rope_kernel(x_ptr, out_ptr, pos_ptr, freq_ptr, amp_ptr, R, H,
                NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_HALF: tl.constexpr, ONE_TOKEN: tl.constexpr, INVERSE: tl.constexpr,
                COMPUTE: tl.constexpr):
    """out[:, :NOPE] = x[:, :NOPE]; pairs (x[NOPE+2i], x[NOPE+2i+1]) rotated by pos·freq[i]
    (rounded as `rotate_pairs` says). `BLOCK_D ≥ WIDTH`: whole rows are read at once (coalesced);
    the rotated dims are read a second time as interleaved pairs, from the cache."""
    dtype = out_ptr.dtype.element_ty
    WIDTH: tl.constexpr = NOPE + 2 * HALF
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    dims = tl.arange(0, BLOCK_D)
    offsets = rows[:, None] * WIDTH + dims[None, :]
    nope_mask = row_ok[:, None] & (dims[None, :] < NOPE)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=nope_mask), mask=nope_mask)

    even_offsets, mask, angles = pair_layout(pos_ptr, freq_ptr, rows, row_ok, H, NOPE, HALF, WIDTH,
                                             BLOCK_HALF, ONE_TOKEN, COMPUTE)
    even = tl.load(x_ptr + even_offsets, mask=mask, other=0.0).to(COMPUTE)
    odd = tl.load(x_ptr + even_offsets + 1, mask=mask, other=0.0).to(COMPUTE)
    new_even, new_odd = rotate_pairs(even, odd, angles, tl.load(amp_ptr), INVERSE, dtype, COMPUTE)
    tl.store(out_ptr + even_offsets, new_even.to(dtype), mask=mask)
    tl.store(out_ptr + even_offsets + 1, new_odd.to(dtype), mask=mask)
