"""Triton kernel of the FP8 row quantization (see `fp8_quantize.py` for the entry point and the math).

Plain functions: `lazy_jit.jitted` decorates the kernel on first launch. t is `[R, K]` with any strides
(`STRIDE_R`, `STRIDE_K`: a transposed view reads in place, the loads coalescing along whichever side is
contiguous); q is a contiguous `[R_OUT, K_OUT]` e4m3 and scale a contiguous `[R_OUT]` float32, the rows
and columns past t's zero (the GEMM's alignment padding).
"""

import triton
import triton.language as tl


E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2⁻⁶; below it e4m3 steps by 2⁻⁹
SUBNORMAL_ROUNDER = tl.constexpr(24576.0)  # 1.5·2¹⁴: float32 sums near it step by 2⁻⁹


@triton.jit
def round_to_e4m3(y):
    """float32 `y` (|y| ≤ 448 or NaN) rounded to the nearest e4m3 value, ties to even, still in float32.

    What the GPU's float32 → e4m3 conversion does; done here so that the cast that follows is exact, because
    Triton 3.6's CPU interpreter converts wrongly when rounding carries into the exponent (126.9 → 64). Normal
    range: three mantissa bits kept by integer rounding on the bits (the carry may raise the exponent);
    subnormal range: an addition to |y| whose float32 ulp is e4m3's step there."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    magnitude = (tl.abs(y) + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER
    subnormal = tl.where(y < 0, -magnitude, magnitude)  # keeps the sign of a value rounded to zero
    return tl.where(tl.abs(y) < E4M3_MIN_NORMAL, subnormal, normal)


def quantize_rows_kernel(t_ptr, q_ptr, scale_ptr, R, K, STRIDE_R, STRIDE_K, R_OUT, K_OUT, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
    """Per row: scale = max(amax(|row|), TINY) / FP8_MAX and q = clamp(row / scale) rounded to nearest e4m3,
    in float32 with a correctly rounded division: the reference's numbers bit for bit. A NaN anywhere in a row
    makes its scale NaN (and an inf, inf), as the reference's reduction does."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_in, row_out = rows < R, rows < R_OUT
    columns = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    nan = tl.zeros([BLOCK_R], dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        k = start + columns
        x = tl.load(t_ptr + rows[:, None] * STRIDE_R + k[None, :] * STRIDE_K,
                    mask=row_in[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
    # Both divisions are `div_rn`: on the GPU Triton's float32 `/` is approximate, and Triton 3.6's `fdiv`
    # ignores its `ieee_rounding` flag.
    scale = tl.math.div_rn(tl.where(nan > 0, float("nan"), tl.maximum(amax, TINY)), FP8_MAX)
    tl.store(scale_ptr + rows, scale, mask=row_out)
    for start in range(0, K_OUT, BLOCK_K):
        k = start + columns
        x = tl.load(t_ptr + rows[:, None] * STRIDE_R + k[None, :] * STRIDE_K,
                    mask=row_in[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, scale[:, None])
        y = round_to_e4m3(tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)))  # the clamp keeps NaN
        tl.store(q_ptr + rows[:, None] * K_OUT + k[None, :], y.to(q_ptr.dtype.element_ty),
                 mask=row_out[:, None] & (k[None, :] < K_OUT))
