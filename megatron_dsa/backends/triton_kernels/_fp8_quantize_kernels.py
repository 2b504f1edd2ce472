"""Triton kernel of the FP8 row quantization (see `fp8_quantize.py` for the entry point and the math).

Plain functions: `lazy_jit.jitted` decorates the kernels on first launch. `quantize_each_row_kernel` rounds
whole rows in one launch, a program per row (the few-rows FP8 GEMM's operand). The other two run over a grid of
`[BLOCK_R, BLOCK_K]` tiles, so that a few rows with many columns (the weight gradient's `dyᵀ`: out features ×
tokens) still fill the GPU: `row_amax_kernel` gathers each row's amax across its tiles with atomics, then
`quantize_kernel` divides and rounds. t is `[R, K]` with any strides (`STRIDE_R`, `STRIDE_K`: a transposed
view reads in place, the loads coalescing along whichever side is contiguous); q is a contiguous
`[R_OUT, K_OUT]` e4m3 and scale a contiguous `[R_OUT]` float32, the rows and columns past t's zero (the
GEMM's alignment padding).
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel


E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2⁻⁶; below it e4m3 steps by 2⁻⁹
SUBNORMAL_ROUNDER = tl.constexpr(24576.0)  # 1.5·2¹⁴: float32 sums near it step by 2⁻⁹
SIGN_BIT = tl.constexpr(-0x80000000)  # float32's sign bit as an int32


@triton.jit
def round_to_e4m3(y):
    """float32 `y` (|y| ≤ 448 or NaN) rounded to the nearest e4m3 value, ties to even, still in float32.

    What the GPU's float32 → e4m3 conversion does; done here so that the cast that follows is exact, because
    Triton 3.6's CPU interpreter converts wrongly when rounding carries into the exponent (126.9 → 64). Normal
    range: three mantissa bits kept by integer rounding on the bits (the carry may raise the exponent);
    subnormal range: an addition to |y| whose float32 ulp is e4m3's step there, y's sign bit put back on (a
    negative value rounded to zero stays −0, as the conversion keeps it: on the GPU a negation `-0.0` compiled
    to `0 − 0.0 = +0`, and those −0s came out +0)."""
    bits = y.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFFF + ((bits >> 20) & 1))) & -0x100000
    normal = rounded.to(tl.float32, bitcast=True)
    magnitude = (tl.abs(y) + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER
    subnormal = (magnitude.to(tl.int32, bitcast=True) | (bits & SIGN_BIT)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < E4M3_MIN_NORMAL, subnormal, normal)


@triton.jit
def row_scale(amax, INV_FP8_MAX: tl.constexpr, TINY: tl.constexpr):
    """A row's scale `max(amax, TINY) · (1/FP8_MAX)` from its float32 `amax` (NaN stays NaN)."""
    return tl.where(amax != amax, amax, tl.maximum(amax, TINY) * INV_FP8_MAX)  # maximum may drop a NaN


@triton.jit
def e4m3_values(x, scale, FP8_MAX: tl.constexpr):
    """float32 `x [R, K]` over its rows' `scale [R]`, clamped to ±FP8_MAX and rounded to e4m3 (still float32, so
    the cast to e4m3 that follows is exact). The quotient is correctly rounded, as the reference's tensor
    division: on the GPU Triton's float32 `/` is approximate, and Triton 3.6's `fdiv` ignores its
    `ieee_rounding` flag. The clamp keeps NaN."""
    y = tl.math.div_rn(x, scale[:, None])
    return round_to_e4m3(tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)))


def row_amax_kernel(t_ptr, amax_bits_ptr, R, K, STRIDE_R, STRIDE_K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """amax_bits `[R]` int32, zeroed by the caller: per row, the atomic max over this program's tile of the
    float32 bits of `|t|`. Non-negative floats order as their bits do, and a NaN's bits lie above inf's, so a
    row with a NaN ends NaN (and one with an inf, inf), as the reference's reduction does."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(t_ptr + rows[:, None] * STRIDE_R + k[None, :] * STRIDE_K,
                mask=(rows < R)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x|: the sign bit cleared
    tl.atomic_max(amax_bits_ptr + rows, tl.max(bits, axis=1), mask=rows < R)


def quantize_kernel(t_ptr, amax_bits_ptr, q_ptr, scale_ptr, R, K, STRIDE_R, STRIDE_K, R_OUT, K_OUT,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                    INV_FP8_MAX: tl.constexpr, TINY: tl.constexpr):
    """Per row: scale = max(amax, TINY) · (1/FP8_MAX) and q = clamp(t / scale) rounded to nearest e4m3, in
    float32, with a correctly rounded division (the reference's numbers: `fp8_quantize.quantize_rows` says how
    close on a GPU). The programs of the first column block store the scales."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    amax = tl.load(amax_bits_ptr + rows, mask=rows < R, other=0).to(tl.float32, bitcast=True)
    scale = row_scale(amax, INV_FP8_MAX, TINY)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + rows, scale, mask=rows < R_OUT)
    x = tl.load(t_ptr + rows[:, None] * STRIDE_R + k[None, :] * STRIDE_K,
                mask=(rows < R)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
    y = e4m3_values(x, scale, FP8_MAX)
    tl.store(q_ptr + rows[:, None] * K_OUT + k[None, :], y.to(q_ptr.dtype.element_ty),
             mask=(rows < R_OUT)[:, None] & (k < K_OUT)[None, :])


def quantize_each_row_kernel(t_ptr, q_ptr, scale_ptr, R, K, STRIDE_R, STRIDE_K, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr, ONE_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                         INV_FP8_MAX: tl.constexpr, TINY: tl.constexpr, CHAINED: tl.constexpr):
    """Rows `[BLOCK_R]` of t `[R, K]` (any strides) → their e4m3 codes in q `[R, K]` (contiguous) and scales
    `[R]` float32: `scale = max(amax, TINY)·(1/FP8_MAX)`, `q = clamp(t / scale)` rounded to nearest (as
    `ops.fp8_linear.quantize_rows`). The amax is a maximum of `|t|`'s float32 bits: non-negative floats order as
    their bits do and a NaN's lie above inf's, so a row with a NaN gets a NaN scale, as the reference's.
    `ONE_BLOCK`: a row fits one block (`K ≤ BLOCK_K`): it is read once and rounded from registers (a decode
    step's rows: one load's latency instead of one per block and pass)."""
    wait_for_previous_kernel(CHAINED)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    if ONE_BLOCK:
        k = tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (k < K)[None, :]
        x = tl.load(t_ptr + rows[:, None] * STRIDE_R + k[None, :] * STRIDE_K, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True),
                          INV_FP8_MAX, TINY)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        tl.store(q_ptr + rows[:, None] * K + k[None, :], e4m3_values(x, scale, FP8_MAX).to(q_ptr.dtype.element_ty),
                 mask=mask)
    else:
        amax_bits = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.int32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            x = tl.load(t_ptr + rows[:, None] * STRIDE_R + k[None, :] * STRIDE_K,
                        mask=row_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            amax_bits = tl.maximum(amax_bits, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        scale = row_scale(tl.max(amax_bits, axis=1).to(tl.float32, bitcast=True), INV_FP8_MAX, TINY)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (k < K)[None, :]
            x = tl.load(t_ptr + rows[:, None] * STRIDE_R + k[None, :] * STRIDE_K, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + rows[:, None] * K + k[None, :],
                     e4m3_values(x, scale, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask)
