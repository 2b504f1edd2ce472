"""RMSNorm (weightless or weighted) then partial interleaved RoPE as one Triton kernel: a drop-in for
`megatron_dsa.ops.rope.norm_rope`, i.e. `rope(rms_norm(x, weight, eps), positions, inv_freq)`.

Forward, per row of `Dh = NOPE + P` dims: `rstd = rsqrt(mean(x²) + eps)` in float32 (float64 for
float64 x), `n = (x·rstd)·w` rounded to x's dtype (as `rms_norm` rounds once), the first NOPE dims of
n written, its last P dims rotated as interleaved pairs with the reference's rounding steps. One read
of x and one write of the output, against about five float32 passes plus one RoPE pass unfused.

Backward, one pass over x and the output gradient g: `gn = ∂L/∂n` is g on the first NOPE dims and
the pairs rotated back by −θ (the rotation's Jacobian is its transpose); then the RMSNorm backward
`dx = rstd·gw − x·rstd³·mean(gw·x)` with `gw = gn·w`, in float32, rounded once; the weight gradient
`Σ_rows gn·(x·rstd)` is summed per program into a `[programs, Dh]` buffer (at most
`DWEIGHT_PROGRAMS` rows), then over programs (deterministic, no atomics), as Triton's RMSNorm does.
Only x, the weight, positions and the frequencies are saved; the statistics are recomputed. The
output is always fresh storage and no input is written. A 2-D x may be rows of a wider tensor (unit
column stride, see `tiles.kernel_rows`): read in place, not copied.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.rms_norm import DWEIGHT_PROGRAMS, check_weight, eps_tensor
from megatron_dsa.backends.triton_kernels.rope import check_inputs, rotary_row_args
from megatron_dsa.backends.triton_kernels.tiles import cdiv, fresh_rows, kernel_rows
from megatron_dsa.ops.precision import compute_dtype


def _forward(x: Tensor, weight: Optional[Tensor], positions: Tensor, freq: Tensor, eps: Tensor) -> Tensor:
    """x `[R, Dh]` (`kernel_rows`), `weight [Dh]` or None, `positions [R / heads]`; `freq [P/2]` and `eps [1]`
    in the statistics dtype → a new `[R, Dh]` output."""
    from megatron_dsa.backends.triton_kernels import _norm_rope_kernels as kernels

    out = fresh_rows(x)
    if out.numel() == 0:
        return out
    args = rotary_row_args(x, positions, freq)
    launcher(kernels.norm_rope_forward_kernel)[(cdiv(x.shape[0], args["BLOCK_R"]),)](
        x, weight, out, positions, freq, eps, x.shape[0], X_STRIDE=x.stride(0), HAS_WEIGHT=weight is not None,
        **args, **chained_launch(x.device))
    return out


def _backward(x: Tensor, weight: Optional[Tensor], positions: Tensor, freq: Tensor, eps: Tensor, grad: Tensor,
              weight_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
    """`(dx [R, Dh], dw [Dh] or None)` for the contiguous upstream `grad [R, Dh]` (others as `_forward`)."""
    from megatron_dsa.backends.triton_kernels import _norm_rope_kernels as kernels

    grad_x = fresh_rows(x)
    if grad_x.numel() == 0:
        return grad_x, torch.zeros_like(weight) if weight_grad else None
    args = rotary_row_args(x, positions, freq)
    blocks = cdiv(x.shape[0], args["BLOCK_R"])
    programs = min(blocks, DWEIGHT_PROGRAMS) if weight_grad else blocks
    partial = (torch.empty((programs, x.shape[1]), dtype=compute_dtype(x.dtype), device=x.device)
               if weight_grad else None)  # every program writes its whole row
    launcher(kernels.norm_rope_backward_kernel)[(programs,)](
        x, weight, grad, grad_x, partial, positions, freq, eps, x.shape[0], X_STRIDE=x.stride(0),
        HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, **args)
    return grad_x, partial.sum(0).to(weight.dtype) if weight_grad else None


class TritonNormRope(torch.autograd.Function):
    """`(x [R, Dh], weight [Dh] or None, positions, freq [P/2], eps [1]) → rope(rms_norm(x, weight)) [R, Dh]`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], positions: Tensor, freq: Tensor, eps: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight, positions, freq, eps)
        return _forward(x, weight, positions, freq, eps)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, positions, freq, eps = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        grad_x, grad_weight = _backward(x, weight, positions, freq, eps, grad_out.contiguous(), weight_grad)
        return grad_x, grad_weight, None, None, None


def norm_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, eps: float, weight: Optional[Tensor] = None) -> Tensor:
    """`rope(rms_norm(x, weight, eps), positions, inv_freq)` for `x [T, Dh]` or `x [T, H, Dh]` (new storage).

    `positions [T]`; `inv_freq [P/2]`: the pair frequencies (any float dtype/device, converted to the
    statistics dtype as the reference does); `eps`: the RMSNorm epsilon; `weight [Dh]` or None
    (weightless). Same contract as `megatron_dsa.ops.rope.norm_rope`; positions and inv_freq get no
    gradient, the weight gets its gradient in its own dtype.
    """
    check_inputs(x, positions, inv_freq, op="norm_rope")
    check_weight(x, weight, op="norm_rope")
    compute = compute_dtype(x.dtype)
    eps_t = eps_tensor(eps, "norm_rope", compute, x.device)
    freq = inv_freq.to(x.device, compute).contiguous()
    w = weight.contiguous() if weight is not None else None
    return TritonNormRope.apply(kernel_rows(x), w, positions.contiguous(), freq, eps_t).view(x.shape)
