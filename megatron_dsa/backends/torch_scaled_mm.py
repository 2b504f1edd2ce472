"""The `torch_scaled_mm` backend: the `fp8_gemm` family on torch's rowwise-scaled FP8 GEMM
(`torch._scaled_mm`, cuBLASLt / CUTLASS), on GPUs with FP8 tensor cores (compute capability 8.9: Ada,
9.0: Hopper, and later).

What `_scaled_mm` takes (torch's `_check_scaled_mm_sizes` and `ScaledBlas.cpp`): the first operand
row-major `[M, K]`, the second column-major `[K, N]` (here `qb.t()` of a row-major `[N, K]`), both FP8; K and
N multiples of 16 (M free); rowwise scales float32 `[M, 1]` and `[1, N]`, contiguous (torch >= 2.5); a
bf16 output on every GPU it runs on (fp32 output only through cuBLAS on SM90). So K and N are
zero-padded to multiples of 16 here (zeros change neither a row's amax nor a sum; only unaligned
shapes, as the tiny preset's, pay the copy), the product comes out in bf16 and is cast to the
requested dtype (bf16 rounding, 2⁻⁹, is far below the operands' e4m3 rounding, 2⁻⁴). `use_fast_accum`
stays off (torch's default, the more precise accumulation): on Hopper the FP8 tensor cores' own
accumulation keeps fewer than fp32's bits, an error DeepSeek-V3's report measured at K = 4096.

The operands are quantized by one Triton kernel where Triton runs (`triton_kernels.fp8_quantize`: the
padding built in, transposed operands read in place; variant `triton_quantize`), else by the torch ops of
`ops.fp8_linear.quantize_rows` (variant `torch_quantize`): the same numbers either way.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_dsa.backends import probes
from megatron_dsa.backends.registry import Backend, OpFamily, count_variant, register_backend
from megatron_dsa.backends.triton_kernels import fp8_quantize
from megatron_dsa.backends.triton_kernels.availability import triton_decline_reason
from megatron_dsa.ops.fp8_linear import group_by_group, quantize_rows

NAME = "torch_scaled_mm"
ALIGNMENT = 16  # K and N of `_scaled_mm`
MIN_TORCH = (2, 5)  # rowwise (per-row) scales
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _padded(t: Tensor, rows: int, columns: int) -> Tensor:
    return t if t.shape == (rows, columns) else F.pad(t, (0, columns - t.shape[1], 0, rows - t.shape[0]))


def _torch_quantize(t: Tensor, rows: int, width: int) -> tuple[Tensor, Tensor]:
    """`ops.fp8_linear.quantize_rows` of `t [R, K]` zero-padded to `[rows, width]`, float32 scales."""
    q, scale = quantize_rows(_padded(t, rows, width))
    return q, scale.float()


def _quantizer(device: torch.device) -> Callable[[Tensor, int, int], tuple[Tensor, Tensor]]:
    """The Triton kernel where Triton runs (one pass, in place whatever t's strides), else the torch ops: the
    same numbers either way. Counted once per GEMM under the variant that quantized its operands."""
    if triton_decline_reason(device) is None:  # a CUDA device (the CPU interpreter serves named requests only)
        count_variant(NAME, OpFamily.FP8_GEMM, "triton_quantize")
        return fp8_quantize.quantize_rows
    count_variant(NAME, OpFamily.FP8_GEMM, "torch_quantize")
    return _torch_quantize


def _padded_codes(codes: Tensor, scales: Tensor, rows: int, width: int) -> tuple[Tensor, Tensor]:
    """Codes `[R, K]` already rounded (`quantize_rows`) and their scales `[R, 1]`, zero-padded to `[rows, width]`
    (as bytes: torch pads no float8) with float32 scales (a padded row's scale is 1: its codes are 0)."""
    if codes.shape != (rows, width):
        codes = F.pad(codes.view(torch.uint8), (0, width - codes.shape[1], 0, rows - codes.shape[0])).view(codes.dtype)
        scales = F.pad(scales, (0, 0, 0, rows - scales.shape[0]), value=1.0)
    return codes.contiguous(), scales.float().contiguous()


def fp8_gemm(a: Tensor, b: Tensor, out_dtype: torch.dtype, b_scales: Optional[Tensor] = None) -> Tensor:
    """The `fp8_gemm` contract (`ops.fp8_linear.Fp8Gemm`) on `torch._scaled_mm` with per-row scales (grouped kept
    codes: one `_scaled_mm` per group)."""
    if b.dim() == 3:
        return group_by_group(fp8_gemm, a, b, out_dtype, b_scales)
    k, n = a.shape[1], b.shape[0]
    width, outputs = probes.round_up(k, ALIGNMENT), probes.round_up(n, ALIGNMENT)
    quantize = _quantizer(a.device)
    qa, scale_a = quantize(a, a.shape[0], width)
    qb, scale_b = quantize(b, outputs, width) if b_scales is None else _padded_codes(b, b_scales, outputs, width)
    out = torch._scaled_mm(qa, qb.t(), scale_a=scale_a, scale_b=scale_b.view(1, -1),
                           out_dtype=torch.bfloat16)
    if outputs != n:
        out = out[:, :n].contiguous()
    return out.to(out_dtype)


def torch_problem() -> Optional[str]:
    """None when this torch has the rowwise-scaled `_scaled_mm`, else what is missing."""
    if not hasattr(torch, "_scaled_mm") or probes.version_tuple(torch.__version__)[:2] < MIN_TORCH:
        return (f"torch {torch.__version__} has no rowwise-scaled _scaled_mm (needs torch >= "
                f"{'.'.join(map(str, MIN_TORCH))})")
    return None


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    device = call.get("device")
    return probes.first_problem(torch_problem(), _fp8_gpu_problem(device), probes.dtype_problem(call, DTYPES))


def _fp8_gpu_problem(device: Optional[torch.device]) -> Optional[str]:
    if device is not None and torch.device(device).type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU (tensors on {torch.device(device).type})"
    if probes.cuda_capability(device) is None:
        return "FP8 GEMMs need a CUDA GPU (none available)"
    return probes.fp8_capability_problem(device, "FP8 GEMMs")


TORCH_SCALED_MM = Backend(
    name=NAME,
    ops={OpFamily.FP8_GEMM: fp8_gemm},
    probe=probe,
    version=lambda: f"torch {torch.__version__}",
)

register_backend(TORCH_SCALED_MM)
