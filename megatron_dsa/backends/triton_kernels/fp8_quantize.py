"""FP8 row quantization as one Triton kernel: `ops.fp8_linear.quantize_rows` with the GEMM's alignment
padding built in, for the `fp8_gemm` family's `torch_scaled_mm` backend.

Unfused, quantizing one operand of an FP8 GEMM takes a reduction, a float32 quotient, an in-place clamp and
a cast that also transposes a strided operand (the backward's `dyᵀ`, `xᵀ`, `Wᵀ`): about 19 bytes of memory
traffic per element, plus a padded copy where K or N is not a multiple of 16. This kernel reads the operand
twice in place, whatever its strides (once for the row's amax, once to divide and round), and writes one
byte per element and the scales: about 5 bytes. On an H200 the unfused quantization made the FP8 layer
step 2–3× slower than the bf16 one (C at S = 4096: 21.3 ms against 9.4 ms, CUDA graphs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.tiles import cdiv
from megatron_dsa.ops.fp8_linear import FP8, FP8_MAX

BLOCK_R = 16  # rows per program
BLOCK_K = 256  # columns per step of a program's two passes
WARPS = 4
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_rows(t: Tensor, rows: int, width: int) -> tuple[Tensor, Tensor]:
    """`t [R, K]` (any strides; bf16, fp16 or fp32) → `(q [rows, width]` e4m3 row-major, `scale [rows, 1]`
    float32): `ops.fp8_linear.quantize_rows` of t zero-padded to `rows ≥ R` rows and `width ≥ K` columns,
    bit for bit."""
    require_triton(t.device, "fp8 quantization", "t's device")
    if t.dim() != 2 or t.dtype not in DTYPES:
        raise ValueError(f"fp8 quantize_rows: t must be a 2-D {', '.join(map(str, DTYPES))} tensor, got "
                         f"{t.dim()}-D {t.dtype}")
    if rows < t.shape[0] or width < t.shape[1]:
        raise ValueError(f"fp8 quantize_rows: the padded shape ({rows}, {width}) must hold t's {tuple(t.shape)}")
    from megatron_dsa.backends.triton_kernels import _fp8_quantize_kernels as kernels

    q = torch.empty((rows, width), dtype=FP8, device=t.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=t.device)
    if q.numel():
        launcher(kernels.quantize_rows_kernel)[(cdiv(rows, BLOCK_R),)](
            t, q, scale, t.shape[0], t.shape[1], t.stride(0), t.stride(1), rows, width, BLOCK_R=BLOCK_R,
            BLOCK_K=BLOCK_K, FP8_MAX=FP8_MAX, TINY=torch.finfo(torch.float32).tiny, num_warps=WARPS)
    return q, scale
