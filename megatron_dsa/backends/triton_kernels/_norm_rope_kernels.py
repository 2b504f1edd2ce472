"""Triton kernels of weightless RMSNorm then partial RoPE (see `norm_rope.py` for the entry point and
the math).

Plain functions: `lazy_jit.jitted` decorates the kernels on first launch (the helpers they call,
`load_head_rows` included, are decorated when their modules are imported, which happens only then).
x, out, grad and dx are contiguous `[R, WIDTH]` rows (R = T·H, WIDTH = NOPE + 2·HALF); row r belongs to
token r // H. One program handles `BLOCK_R` whole rows: `BLOCK_D ≥ WIDTH` covers a row at once, so
each row is read once from memory; the rotated dims are loaded a second time as interleaved pairs,
from the cache.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._rms_norm_kernels import load_rows
from megatron_dsa.backends.triton_kernels._rope_kernels import pair_layout, rotate_pairs


@triton.jit
def load_head_rows(x_ptr, pos_ptr, freq_ptr, eps_ptr, R, H, NOPE: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   COMPUTE: tl.constexpr):
    """This program's `BLOCK_R` rows of x with their statistics and RoPE layout: `(x, rstd, offsets,
    nope_mask, even_offsets, pair_mask, angles)` (see `load_rows` and `pair_layout`)."""
    WIDTH: tl.constexpr = NOPE + 2 * HALF
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x, rstd, offsets, dims = load_rows(x_ptr, eps_ptr, rows, row_ok, WIDTH, BLOCK_D, COMPUTE)
    nope_mask = row_ok[:, None] & (dims[None, :] < NOPE)
    even_offsets, pair_mask, angles = pair_layout(pos_ptr, freq_ptr, rows, row_ok, H, NOPE, HALF, WIDTH,
                                                  BLOCK_HALF, COMPUTE)
    return x, rstd, offsets, nope_mask, even_offsets, pair_mask, angles


def norm_rope_forward_kernel(x_ptr, out_ptr, pos_ptr, freq_ptr, eps_ptr, R, H,
                             NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, COMPUTE: tl.constexpr):
    """out = rope(rms_norm(x)): n = x·rstd rounded to x's dtype (as `rms_norm` rounds once); the
    first NOPE dims of n are stored, the pairs after them rotated (rounded as `rotate_pairs` says)."""
    dtype = out_ptr.dtype.element_ty
    x, rstd, offsets, nope_mask, even_offsets, mask, angles = load_head_rows(
        x_ptr, pos_ptr, freq_ptr, eps_ptr, R, H, NOPE, HALF, BLOCK_R, BLOCK_D, BLOCK_HALF, COMPUTE)
    tl.store(out_ptr + offsets, (x * rstd[:, None]).to(dtype), mask=nope_mask)

    even = tl.load(x_ptr + even_offsets, mask=mask, other=0.0).to(COMPUTE)
    odd = tl.load(x_ptr + even_offsets + 1, mask=mask, other=0.0).to(COMPUTE)
    even = (even * rstd[:, None]).to(dtype).to(COMPUTE)  # the normalised value the reference rotates
    odd = (odd * rstd[:, None]).to(dtype).to(COMPUTE)
    new_even, new_odd = rotate_pairs(even, odd, angles, 1.0, False, dtype, COMPUTE)
    tl.store(out_ptr + even_offsets, new_even.to(dtype), mask=mask)
    tl.store(out_ptr + even_offsets + 1, new_odd.to(dtype), mask=mask)


def norm_rope_backward_kernel(x_ptr, grad_ptr, dx_ptr, pos_ptr, freq_ptr, eps_ptr, R, H,
                              NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, COMPUTE: tl.constexpr):
    """dx from the saved x and grad = ∂L/∂out, in one pass over both.

    gn = ∂L/∂n: grad on the first NOPE dims, the pairs rotated back by −θ (rounded in x's dtype, as
    autograd of the reference does). RMSNorm backward in COMPUTE:
    dx = rstd·gn − x·rstd³·mean(gn·x), rounded once to x's dtype."""
    dtype = dx_ptr.dtype.element_ty
    WIDTH: tl.constexpr = NOPE + 2 * HALF
    x, rstd, offsets, nope_mask, even_offsets, mask, angles = load_head_rows(
        x_ptr, pos_ptr, freq_ptr, eps_ptr, R, H, NOPE, HALF, BLOCK_R, BLOCK_D, BLOCK_HALF, COMPUTE)
    grad_nope = tl.load(grad_ptr + offsets, mask=nope_mask, other=0.0).to(COMPUTE)

    grad_even = tl.load(grad_ptr + even_offsets, mask=mask, other=0.0).to(COMPUTE)
    grad_odd = tl.load(grad_ptr + even_offsets + 1, mask=mask, other=0.0).to(COMPUTE)
    grad_even, grad_odd = rotate_pairs(grad_even, grad_odd, angles, 1.0, True, dtype, COMPUTE)
    x_even = tl.load(x_ptr + even_offsets, mask=mask, other=0.0).to(COMPUTE)
    x_odd = tl.load(x_ptr + even_offsets + 1, mask=mask, other=0.0).to(COMPUTE)

    dot = tl.sum(grad_nope * x, axis=1) + tl.sum(grad_even * x_even + grad_odd * x_odd, axis=1)
    coef = (rstd * rstd * rstd * dot / WIDTH)[:, None]
    tl.store(dx_ptr + offsets, (rstd[:, None] * grad_nope - x * coef).to(dtype), mask=nope_mask)
    tl.store(dx_ptr + even_offsets, (rstd[:, None] * grad_even - x_even * coef).to(dtype), mask=mask)
    tl.store(dx_ptr + even_offsets + 1, (rstd[:, None] * grad_odd - x_odd * coef).to(dtype), mask=mask)
