"""Triton kernels of RMSNorm (see `rms_norm.py` for the entry point and the math).

Plain functions: `lazy_jit.jitted` decorates the kernels on first launch (`load_rows`, which the
RMSNorm + RoPE kernels share, is decorated when this module is imported, which happens only then).
x is `[R, D]` rows `X_STRIDE` elements apart (unit column stride: a column slice of a wider tensor reads
in place), out, grad and dx are contiguous `[R, D]` rows; weight and the partial weight gradients are
`[D]` and `[programs, D]`. One program holds `BLOCK_R` whole rows (`BLOCK_D ≥ D`), so each row is read
from memory once per pass.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel


@triton.jit
def load_rows(x_ptr, eps_ptr, rows, row_ok, X_STRIDE, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr,
              COMPUTE: tl.constexpr):
    """`(x [BLOCK_R, BLOCK_D] in COMPUTE (0 past the row), rstd [BLOCK_R], offsets, dims)`:
    rstd = rsqrt(mean(x²) + eps), the reference's statistics in COMPUTE; x's rows are `X_STRIDE` apart,
    `offsets` are those of contiguous `[R, WIDTH]` rows (the output and gradients)."""
    dims = tl.arange(0, BLOCK_D)
    offsets = rows[:, None] * WIDTH + dims[None, :]
    x = tl.load(x_ptr + rows[:, None] * X_STRIDE + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < WIDTH),
                other=0.0).to(COMPUTE)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / WIDTH + tl.load(eps_ptr))
    return x, rstd, offsets, dims


def rms_norm_forward_kernel(x_ptr, w_ptr, out_ptr, eps_ptr, R, X_STRIDE, D: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_D: tl.constexpr, HAS_WEIGHT: tl.constexpr, COMPUTE: tl.constexpr,
                            CHAINED: tl.constexpr):
    """out = (x·rstd)·w in COMPUTE, rounded once to out's dtype (the reference's single rounding)."""
    wait_for_previous_kernel(CHAINED)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x, rstd, offsets, dims = load_rows(x_ptr, eps_ptr, rows, row_ok, X_STRIDE, D, BLOCK_D, COMPUTE)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(COMPUTE)[None, :]
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims[None, :] < D))


def rms_norm_backward_kernel(x_ptr, w_ptr, grad_ptr, dx_ptr, dw_ptr, eps_ptr, R, X_STRIDE, D: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                             WEIGHT_GRAD: tl.constexpr, COMPUTE: tl.constexpr):
    """dx (and this program's partial dw) from the saved x and grad = ∂L/∂out.

    Program p takes row blocks p, p + programs, ...; per row, in COMPUTE: gn = grad·w,
    dx = rstd·gn − x·rstd³·mean(gn·x) rounded once to dx's dtype; dw accumulates Σ grad·(x·rstd) over
    the program's rows and is stored as row p of `dw [programs, D]` (summed on the host side)."""
    programs = tl.num_programs(0)
    dims = tl.arange(0, BLOCK_D)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(COMPUTE)
    dw = tl.zeros([BLOCK_D], dtype=COMPUTE)
    for block in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), programs):
        rows = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = rows < R
        x, rstd, offsets, _ = load_rows(x_ptr, eps_ptr, rows, row_ok, X_STRIDE, D, BLOCK_D, COMPUTE)
        mask = row_ok[:, None] & (dims[None, :] < D)
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
        if WEIGHT_GRAD:
            dw += tl.sum(grad * (x * rstd[:, None]), axis=0)
        if HAS_WEIGHT:
            grad = grad * w[None, :]
        coef = rstd * rstd * rstd * tl.sum(grad * x, axis=1) / D
        tl.store(dx_ptr + offsets, (rstd[:, None] * grad - x * coef[:, None]).to(dx_ptr.dtype.element_ty),
                 mask=mask)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * D + dims, dw, mask=dims < D)
