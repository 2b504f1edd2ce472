"""FP8 row quantization as Triton kernels: `ops.fp8_linear.quantize_rows` with the GEMM's alignment padding
built in, for the `fp8_gemm` family's `torch_scaled_mm` backend (`quantize_rows`), and in one launch for its
few-rows Triton GEMM (`quantize_each_row`).

Unfused, quantizing one operand of an FP8 GEMM takes a reduction, a float32 quotient, an in-place clamp and
a cast that also transposes a strided operand (the backward's `dyᵀ`, `xᵀ`, `Wᵀ`): about 19 bytes of memory
traffic per element, plus a padded copy where K or N is not a multiple of 16. Two kernels over tiles read
the operand twice in place, whatever its strides (once for the rows' amax, once to divide and round), and
write one byte per element and the scales: about 5 bytes. On an H200 the unfused quantization made the FP8
layer step 2–3× slower than the bf16 one (C at S = 4096: 21.3 ms against 9.4 ms, CUDA graphs); one kernel
over row blocks (a program per 16 rows looping over K) took 60 µs per operand on average, a third of the
FP8 layer's GPU time, because an operand of few rows left most of the GPU idle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.tiles import cdiv, pow2
from megatron_dsa.ops.fp8_linear import FP8, FP8_MAX

# Tiles `(BLOCK_R, BLOCK_K)` of 4096 elements: long along whichever side of t is contiguous.
ROW_MAJOR_TILE = (16, 256)
COLUMN_MAJOR_TILE = (128, 32)
WARPS = 4
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EACH_ROW_BLOCK_K = 8192  # a row up to this long is read once
# Each thread divides its values one by one (a correctly rounded division): more threads per row, a shorter chain
# (H200, 32 rows of 4096 / 8192: 2.77 / 4.88 µs with 4 warps, 2.25 / 3.12 with 16, 2.23 / 2.97 with 32).
EACH_ROW_WARPS = 16


def quantize_rows(t: Tensor, rows: int, width: int) -> tuple[Tensor, Tensor]:
    """`t [R, K]` (any strides; bf16, fp16 or fp32) → `(q [rows, width]` e4m3 row-major, `scale [rows, 1]`
    float32): `ops.fp8_linear.quantize_rows` of t zero-padded to `rows ≥ R` rows and `width ≥ K` columns, bit
    for bit (`tests/test_triton_fp8_quantize.py`: in the CPU interpreter, and against torch on the GPU)."""
    kernels = _checked_kernels(t, "quantize_rows")
    if rows < t.shape[0] or width < t.shape[1]:
        raise ValueError(f"fp8 quantize_rows: the padded shape ({rows}, {width}) must hold t's {tuple(t.shape)}")
    q = torch.empty((rows, width), dtype=FP8, device=t.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=t.device)
    amax_bits = torch.zeros(t.shape[0], dtype=torch.int32, device=t.device)
    block_r, block_k = _tile(t)
    if t.numel():
        launcher(kernels.row_amax_kernel)[(cdiv(t.shape[0], block_r), cdiv(t.shape[1], block_k))](
            t, amax_bits, t.shape[0], t.shape[1], t.stride(0), t.stride(1), BLOCK_R=block_r, BLOCK_K=block_k,
            num_warps=WARPS)
    if q.numel():
        launcher(kernels.quantize_kernel)[(cdiv(rows, block_r), cdiv(width, block_k))](
            t, amax_bits, q, scale, t.shape[0], t.shape[1], t.stride(0), t.stride(1), rows, width,
            BLOCK_R=block_r, BLOCK_K=block_k, FP8_MAX=FP8_MAX, INV_FP8_MAX=1.0 / FP8_MAX,
            TINY=torch.finfo(torch.float32).tiny, num_warps=WARPS)
    return q, scale


def _checked_kernels(t: Tensor, name: str):
    """The kernels' module, once t is a 2-D operand of a supported dtype on a device Triton runs on."""
    require_triton(t.device, "fp8 quantization", "t's device")
    if t.dim() != 2 or t.dtype not in DTYPES:
        raise ValueError(f"fp8 {name}: t must be a 2-D {', '.join(map(str, DTYPES))} tensor, got {t.dim()}-D "
                         f"{t.dtype}")
    from megatron_dsa.backends.triton_kernels import _fp8_quantize_kernels as kernels

    return kernels


def _tile(t: Tensor) -> tuple[int, int]:
    """`(BLOCK_R, BLOCK_K)` for t: a transposed view (rows contiguous) reads tall tiles."""
    return COLUMN_MAJOR_TILE if t.stride(1) != 1 and t.stride(0) == 1 else ROW_MAJOR_TILE


def quantize_each_row(t: Tensor) -> tuple[Tensor, Tensor]:
    """`t [R, K]` (any strides) → `(codes [R, K]` e4m3 contiguous, `scales [R]` float32): `ops.fp8_linear.
    quantize_rows` in one launch, one program per row, a row of up to `EACH_ROW_BLOCK_K` values read once (H200, 32
    rows of 4096: 3.1 µs as two passes over 1024-value blocks with 4 warps, 2.25 read once with 16). The tiled
    `quantize_rows` fills the GPU where rows are few and long and pads for cuBLASLt; this one is a single launch,
    for the few-rows FP8 GEMM (`fp8_gemm`), which needs no padding."""
    kernels = _checked_kernels(t, "quantize_each_row")
    rows, width = t.shape
    codes = torch.empty((rows, width), dtype=FP8, device=t.device)
    scales = torch.empty(rows, dtype=torch.float32, device=t.device)
    if t.numel():
        launcher(kernels.quantize_each_row_kernel)[(rows,)](
            t, codes, scales, rows, width, t.stride(0), t.stride(1), BLOCK_R=1,
            BLOCK_K=min(EACH_ROW_BLOCK_K, pow2(width, 16)), ONE_BLOCK=width <= EACH_ROW_BLOCK_K,
            FP8_MAX=FP8_MAX, INV_FP8_MAX=1.0 / FP8_MAX,
            TINY=torch.finfo(torch.float32).tiny, num_warps=EACH_ROW_WARPS, **chained_launch(t.device))
    return codes, scales
