"""Triton kernel of partial interleaved RoPE (see `rope.py` for the entry point and the math).

The kernel is a plain function: `lazy_jit.jitted` decorates it on first launch. The helpers it shares
with the fused RMSNorm + RoPE kernels (`rotate_pairs`, the rounded rotation; `pair_layout`, `load_pairs`
and `store_pairs`, the rotated dims as contiguous rows split into pairs) are decorated here: this module
imports triton at the top and is itself imported only on first launch. x and out are contiguous
`[R, Dh]` rows (R = T·H); row r belongs to token r // H.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel


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
    """`(pair_offsets, pair_mask, angles)` of the rotated dims: offsets and mask `[BLOCK_R, 2·BLOCK_HALF]`
    of the contiguous dims NOPE … WIDTH − 1 of each row (read them with `load_pairs`); pair i (dims
    NOPE + 2i, NOPE + 2i + 1) of row r turns by `angles[r, i] = positions[r // H]·freq[i]` (in COMPUTE).

    `ONE_TOKEN`: the rows of the block are heads of one token (BLOCK_R divides H), so the angles are
    `[1, BLOCK_HALF]` and the cos/sin made of them are computed once for all the block's heads."""
    dims = tl.arange(0, 2 * BLOCK_HALF)
    pair_mask = row_ok[:, None] & (dims[None, :] < 2 * HALF)
    pairs = tl.arange(0, BLOCK_HALF)
    freq = tl.load(freq_ptr + pairs, mask=pairs < HALF, other=0.0)
    if ONE_TOKEN:
        angles = (tl.load(pos_ptr + tl.min(rows, axis=0) // H).to(COMPUTE) * freq)[None, :]
    else:
        positions = tl.load(pos_ptr + rows // H, mask=row_ok, other=0).to(COMPUTE)
        angles = positions[:, None] * freq[None, :]
    return rows[:, None] * WIDTH + NOPE + dims[None, :], pair_mask, angles


@triton.jit
def load_pairs(ptr, pair_offsets, pair_mask, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
               COMPUTE: tl.constexpr):
    """`(even, odd)` `[BLOCK_R, BLOCK_HALF]` in COMPUTE (0 outside the mask): the rotated dims are read
    as contiguous rows and split into pairs in registers (stride-2 loads and stores of 16-bit values
    took RoPE on [4096·64, 128] rows to twice a copy's time)."""
    values = tl.load(ptr + pair_offsets, mask=pair_mask, other=0.0).to(COMPUTE)
    return tl.split(tl.reshape(values, [BLOCK_R, BLOCK_HALF, 2]))


@triton.jit
def store_pairs(ptr, pair_offsets, pair_mask, even, odd, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Interleave `(even, odd)` `[BLOCK_R, BLOCK_HALF]` back into contiguous rows and store them (in
    ptr's dtype) where `pair_mask` holds."""
    values = tl.reshape(tl.join(even, odd), [BLOCK_R, 2 * BLOCK_HALF])
    tl.store(ptr + pair_offsets, values.to(ptr.dtype.element_ty), mask=pair_mask)


def rope_kernel(x_ptr, out_ptr, pos_ptr, freq_ptr, amp_ptr, R, H,
                NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_HALF: tl.constexpr, ONE_TOKEN: tl.constexpr, INVERSE: tl.constexpr,
                COMPUTE: tl.constexpr, CHAINED: tl.constexpr):
    """out[:, :NOPE] = x[:, :NOPE]; pairs (x[NOPE+2i], x[NOPE+2i+1]) rotated by pos·freq[i]
    (rounded as `rotate_pairs` says). The first NOPE dims and the rotated dims are each read and
    written once, as contiguous row blocks."""
    wait_for_previous_kernel(CHAINED)
    dtype = out_ptr.dtype.element_ty
    WIDTH: tl.constexpr = NOPE + 2 * HALF
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    dims = tl.arange(0, BLOCK_D)
    offsets = rows[:, None] * WIDTH + dims[None, :]
    nope_mask = row_ok[:, None] & (dims[None, :] < NOPE)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=nope_mask), mask=nope_mask)

    pair_offsets, pair_mask, angles = pair_layout(pos_ptr, freq_ptr, rows, row_ok, H, NOPE, HALF, WIDTH,
                                                  BLOCK_HALF, ONE_TOKEN, COMPUTE)
    even, odd = load_pairs(x_ptr, pair_offsets, pair_mask, BLOCK_R, BLOCK_HALF, COMPUTE)
    new_even, new_odd = rotate_pairs(even, odd, angles, tl.load(amp_ptr), INVERSE, dtype, COMPUTE)
    store_pairs(out_ptr, pair_offsets, pair_mask, new_even, new_odd, BLOCK_R, BLOCK_HALF)
