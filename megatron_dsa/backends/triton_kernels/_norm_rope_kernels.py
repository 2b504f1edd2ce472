"""Triton kernels of RMSNorm (optionally weighted) then partial RoPE (see `norm_rope.py` for the entry
point and the math).

Plain functions: `lazy_jit.jitted` decorates the kernels on first launch (the helpers they call,
`load_head_rows` included, are decorated when their modules are imported, which happens only then).
x is `[R, WIDTH]` rows `X_STRIDE` elements apart (unit column stride), out, grad and dx contiguous
`[R, WIDTH]` rows (R = T·H, WIDTH = NOPE + 2·HALF); row r belongs to token r // H; the weight is
`[WIDTH]`. One program handles `BLOCK_R` whole rows at a time: `BLOCK_D ≥ WIDTH` covers a row at once,
so each row is read once from memory; the rotated dims are loaded a second time, from the cache, as
contiguous rows split into pairs in registers (`load_pairs`).
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel

from megatron_dsa.backends.triton_kernels._rms_norm_kernels import load_rows
from megatron_dsa.backends.triton_kernels._rope_kernels import load_pairs, pair_layout, rotate_pairs, store_pairs


@triton.jit
def load_head_rows(x_ptr, pos_ptr, freq_ptr, eps_ptr, block, R, H, X_STRIDE, NOPE: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   ONE_TOKEN: tl.constexpr, COMPUTE: tl.constexpr):
    """Row block `block` (`BLOCK_R` rows) of x with their statistics and RoPE layout: `(x, rstd, offsets,
    nope_mask, pair_offsets, x_pair_offsets, pair_mask, angles)` (see `load_rows` and `pair_layout`;
    `x_pair_offsets` are the rotated dims' offsets in x, `pair_offsets` in the contiguous rows)."""
    WIDTH: tl.constexpr = NOPE + 2 * HALF
    rows = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # block·BLOCK_R < R fits int32
    row_ok = rows < R
    x, rstd, offsets, dims = load_rows(x_ptr, eps_ptr, rows, row_ok, X_STRIDE, WIDTH, BLOCK_D, COMPUTE)
    nope_mask = row_ok[:, None] & (dims[None, :] < NOPE)
    pair_offsets, pair_mask, angles = pair_layout(pos_ptr, freq_ptr, rows, row_ok, H, NOPE, HALF, WIDTH,
                                                  BLOCK_HALF, ONE_TOKEN, COMPUTE)
    x_pair_offsets = pair_offsets + rows[:, None] * (X_STRIDE - WIDTH)
    return x, rstd, offsets, nope_mask, pair_offsets, x_pair_offsets, pair_mask, angles


@triton.jit
def load_weights(w_ptr, NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, COMPUTE: tl.constexpr):
    """`(w [BLOCK_D], w_even [BLOCK_HALF], w_odd [BLOCK_HALF])` in COMPUTE: the weight of every dim (0
    past WIDTH) and of the even and odd dims of the rotated pairs."""
    dims = tl.arange(0, BLOCK_D)
    pair_dims = NOPE + 2 * tl.arange(0, BLOCK_HALF)
    pair_ok = pair_dims < NOPE + 2 * HALF
    w = tl.load(w_ptr + dims, mask=dims < NOPE + 2 * HALF, other=0.0).to(COMPUTE)
    w_even = tl.load(w_ptr + pair_dims, mask=pair_ok, other=0.0).to(COMPUTE)
    w_odd = tl.load(w_ptr + pair_dims + 1, mask=pair_ok, other=0.0).to(COMPUTE)
    return w, w_even, w_odd


def norm_rope_forward_kernel(x_ptr, w_ptr, out_ptr, pos_ptr, freq_ptr, eps_ptr, R, H, X_STRIDE,
                             NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                             ONE_TOKEN: tl.constexpr, COMPUTE: tl.constexpr, CHAINED: tl.constexpr):
    """out = rope(rms_norm(x, w)): n = (x·rstd)·w rounded to x's dtype (as `rms_norm` rounds once); the
    first NOPE dims of n are stored, the pairs after them rotated (rounded as `rotate_pairs` says)."""
    wait_for_previous_kernel(CHAINED)
    dtype = out_ptr.dtype.element_ty
    x, rstd, offsets, nope_mask, pair_offsets, x_pair_offsets, pair_mask, angles = load_head_rows(
        x_ptr, pos_ptr, freq_ptr, eps_ptr, tl.program_id(0), R, H, X_STRIDE, NOPE, HALF, BLOCK_R, BLOCK_D,
        BLOCK_HALF, ONE_TOKEN, COMPUTE)
    even, odd = load_pairs(x_ptr, x_pair_offsets, pair_mask, BLOCK_R, BLOCK_HALF, COMPUTE)
    even, odd = even * rstd[:, None], odd * rstd[:, None]
    n = x * rstd[:, None]
    if HAS_WEIGHT:
        w, w_even, w_odd = load_weights(w_ptr, NOPE, HALF, BLOCK_D, BLOCK_HALF, COMPUTE)
        n, even, odd = n * w[None, :], even * w_even[None, :], odd * w_odd[None, :]
    tl.store(out_ptr + offsets, n.to(dtype), mask=nope_mask)
    # The normalised values the reference rotates: rounded to x's dtype first.
    new_even, new_odd = rotate_pairs(even.to(dtype).to(COMPUTE), odd.to(dtype).to(COMPUTE), angles, 1.0, False,
                                     dtype, COMPUTE)
    store_pairs(out_ptr, pair_offsets, pair_mask, new_even, new_odd, BLOCK_R, BLOCK_HALF)


def norm_rope_backward_kernel(x_ptr, w_ptr, grad_ptr, dx_ptr, dw_ptr, pos_ptr, freq_ptr, eps_ptr, R, H, X_STRIDE,
                              NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                              WEIGHT_GRAD: tl.constexpr, ONE_TOKEN: tl.constexpr, COMPUTE: tl.constexpr):
    """dx (and this program's partial dw) from the saved x and grad = ∂L/∂out, one pass over both.

    Program p takes row blocks p, p + programs, ...; per row: gn = ∂L/∂n is grad on the first NOPE dims
    and the pairs rotated back by −θ (rounded in x's dtype, as autograd of the reference does); dw
    accumulates Σ gn·(x·rstd); with gw = gn·w, the RMSNorm backward in COMPUTE is
    dx = rstd·gw − x·rstd³·mean(gw·x), rounded once to x's dtype. The partial dw is row p of
    `dw [programs, WIDTH]` (summed on the host side)."""
    dtype = dx_ptr.dtype.element_ty
    WIDTH: tl.constexpr = NOPE + 2 * HALF
    if HAS_WEIGHT:
        w, w_even, w_odd = load_weights(w_ptr, NOPE, HALF, BLOCK_D, BLOCK_HALF, COMPUTE)
    dw = tl.zeros([BLOCK_D], dtype=COMPUTE)
    dw_even = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    dw_odd = tl.zeros([BLOCK_HALF], dtype=COMPUTE)
    for block in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        x, rstd, offsets, nope_mask, pair_offsets, x_pair_offsets, pair_mask, angles = load_head_rows(
            x_ptr, pos_ptr, freq_ptr, eps_ptr, block, R, H, X_STRIDE, NOPE, HALF, BLOCK_R, BLOCK_D, BLOCK_HALF,
            ONE_TOKEN, COMPUTE)
        grad_nope = tl.load(grad_ptr + offsets, mask=nope_mask, other=0.0).to(COMPUTE)
        grad_even, grad_odd = load_pairs(grad_ptr, pair_offsets, pair_mask, BLOCK_R, BLOCK_HALF, COMPUTE)
        grad_even, grad_odd = rotate_pairs(grad_even, grad_odd, angles, 1.0, True, dtype, COMPUTE)
        x_even, x_odd = load_pairs(x_ptr, x_pair_offsets, pair_mask, BLOCK_R, BLOCK_HALF, COMPUTE)
        if WEIGHT_GRAD:
            dw += tl.sum(grad_nope * (x * rstd[:, None]), axis=0)
            dw_even += tl.sum(grad_even * (x_even * rstd[:, None]), axis=0)
            dw_odd += tl.sum(grad_odd * (x_odd * rstd[:, None]), axis=0)
        if HAS_WEIGHT:
            grad_nope = grad_nope * w[None, :]
            grad_even, grad_odd = grad_even * w_even[None, :], grad_odd * w_odd[None, :]
        dot = tl.sum(grad_nope * x, axis=1) + tl.sum(grad_even * x_even + grad_odd * x_odd, axis=1)
        coef = (rstd * rstd * rstd * dot / WIDTH)[:, None]
        tl.store(dx_ptr + offsets, (rstd[:, None] * grad_nope - x * coef).to(dtype), mask=nope_mask)
        store_pairs(dx_ptr, pair_offsets, pair_mask, rstd[:, None] * grad_even - x_even * coef,
                    rstd[:, None] * grad_odd - x_odd * coef, BLOCK_R, BLOCK_HALF)
    if WEIGHT_GRAD:
        row = dw_ptr + tl.program_id(0).to(tl.int64) * WIDTH
        dims = tl.arange(0, BLOCK_D)
        pair_dims = NOPE + 2 * tl.arange(0, BLOCK_HALF)
        tl.store(row + dims, dw, mask=dims < NOPE)
        tl.store(row + pair_dims, dw_even, mask=pair_dims < WIDTH)
        tl.store(row + pair_dims + 1, dw_odd, mask=pair_dims < WIDTH)
