"""RMSNorm as one Triton kernel per pass: a drop-in for `megatron_dsa.ops.norms.rms_norm`.

Forward, per row of D dims: `rstd = rsqrt(mean(x²) + eps)` and `y = (x·rstd)·w` in float32 (float64
for float64 x), rounded once to x's dtype, as the reference does. One read of x and one write of y,
against about seven kernels and their float32 intermediates unfused.

x may be rows of a wider tensor (unit column stride, see `kernel_rows`): read in place, not copied.

Backward, one pass over x and the output gradient g, in the same compute dtype: `gn = g·w`,
`dx = rstd·gn − x·rstd³·mean(gn·x)` rounded once to x's dtype, and `dw = Σ_rows g·(x·rstd)`: each
program sums its rows into one row of a `[programs, D]` buffer (at most `DWEIGHT_PROGRAMS` rows),
which is then summed and rounded to w's dtype (deterministic, no atomics). Only x, w and eps are
saved. The output is always fresh storage and no input is written.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.rope import row_block
from megatron_dsa.backends.triton_kernels.tiles import cdiv, fresh_rows, kernel_rows
from megatron_dsa.device_cache import device_scalar
from megatron_dsa.ops.precision import compute_dtype

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Programs of a backward with a weight gradient, each looping over its share of the row blocks:
# enough to fill a GPU several times over, while the partial sums stay small (512·D floats).
DWEIGHT_PROGRAMS = 512


def eps_tensor(eps: float, op: str, compute: torch.dtype, device: torch.device) -> Tensor:
    """`eps [1]` in the statistics dtype, after checking it (the message names `op`).

    Made once per value (see `megatron_dsa.device_cache.device_scalar`); float64 eps stays exact."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{op} eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op} eps must be finite and >= 0, got {eps}")
    return device_scalar(eps, compute, device)


def _launch_args(x: Tensor, weight: Optional[Tensor]) -> dict:
    import triton.language as tl

    block_d, block_r, warps = row_block(x.shape[1])
    return dict(D=x.shape[1], BLOCK_R=block_r, BLOCK_D=block_d, HAS_WEIGHT=weight is not None,
                COMPUTE=tl.float64 if x.dtype == torch.float64 else tl.float32, num_warps=warps)


def _forward(x: Tensor, weight: Optional[Tensor], eps: Tensor) -> Tensor:
    """`x [R, D]` (`kernel_rows`), `weight [D]` or None (contiguous); `eps [1]` → a new `[R, D]` in x's dtype."""
    from megatron_dsa.backends.triton_kernels import _rms_norm_kernels as kernels

    out = fresh_rows(x)
    if out.numel() == 0:
        return out
    args = _launch_args(x, weight)
    launcher(kernels.rms_norm_forward_kernel)[(cdiv(x.shape[0], args["BLOCK_R"]),)](
        x, weight, out, eps, x.shape[0], x.stride(0), **args, **chained_launch(x.device))
    return out


def _backward(x: Tensor, weight: Optional[Tensor], eps: Tensor, grad: Tensor,
              weight_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
    """`(dx [R, D], dw [D] or None)` for the contiguous upstream `grad [R, D]` (others as `_forward`; dx is
    contiguous)."""
    from megatron_dsa.backends.triton_kernels import _rms_norm_kernels as kernels

    grad_x = fresh_rows(x)
    if grad_x.numel() == 0:
        return grad_x, torch.zeros_like(weight) if weight_grad else None
    args = _launch_args(x, weight)
    blocks = cdiv(x.shape[0], args["BLOCK_R"])
    programs = min(blocks, DWEIGHT_PROGRAMS) if weight_grad else blocks
    partial = (torch.empty((programs, x.shape[1]), dtype=compute_dtype(x.dtype), device=x.device)
               if weight_grad else None)  # every program writes its whole row
    launcher(kernels.rms_norm_backward_kernel)[(programs,)](
        x, weight, grad, grad_x, partial, eps, x.shape[0], x.stride(0), WEIGHT_GRAD=weight_grad, **args)
    return grad_x, partial.sum(0).to(weight.dtype) if weight_grad else None


class TritonRMSNorm(torch.autograd.Function):
    """`(x [R, D], weight [D] or None, eps [1]) → rms_norm(x, weight) [R, D]`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], eps: Tensor) -> Tensor:
        # rstd is recomputed in backward, not saved: backward reads the row anyway, the sum is free.
        ctx.save_for_backward(x, weight, eps)
        return _forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, eps = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        grad_x, grad_weight = _backward(x, weight, eps, grad_out.contiguous(), weight_grad)
        return grad_x, grad_weight, None


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """`x · rsqrt(mean(x², -1) + eps) · weight` over the last dim of `x [..., D]` (new storage);
    `weight [D]` or None (weightless). Same contract as `megatron_dsa.ops.norms.rms_norm`: 16-bit x
    is normalised in float32 and rounded once; the weight gets its gradient in its own dtype."""
    _check_inputs(x, weight)
    eps_t = eps_tensor(eps, "rms_norm", compute_dtype(x.dtype), x.device)
    w = weight.contiguous() if weight is not None else None
    return TritonRMSNorm.apply(kernel_rows(x), w, eps_t).view(x.shape)


def _check_inputs(x: Tensor, weight: Optional[Tensor]) -> None:
    """Raise `ValueError`/`TypeError` naming the argument Triton's RMSNorm cannot take."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm expects x [..., D] with D >= 1, got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton rms_norm needs x of dtype among {SUPPORTED_DTYPES}, got {x.dtype}")
    check_weight(x, weight)
    require_triton(x.device, "rms_norm", "x's device")


def check_weight(x: Tensor, weight: Optional[Tensor], op: str = "rms_norm") -> None:
    """Raise `ValueError`/`TypeError` naming the norm `weight` (`[D]` for `x [..., D]`) `op` cannot take."""
    if weight is None:
        return
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"{op} weight must be [D] with D = {x.shape[-1]}, got {tuple(weight.shape)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton {op} needs weight of dtype among {SUPPORTED_DTYPES}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{op} weight on {weight.device} but x on {x.device}")
