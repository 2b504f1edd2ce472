"""Weightless RMSNorm then partial interleaved RoPE as one Triton kernel: a drop-in for
`megatron_dsa.ops.rope.norm_rope`, i.e. `rope(rms_norm(x, None, eps), positions, inv_freq)`.

Forward, per row of `Dh = NOPE + P` dims: `rstd = rsqrt(mean(x²) + eps)` in float32 (float64 for
float64 x), `n = x·rstd` rounded to x's dtype (as `rms_norm` rounds once), the first NOPE dims of n
written, its last P dims rotated as interleaved pairs with the reference's rounding steps. One read
of x and one write of the output, against about five float32 passes plus one RoPE pass unfused.

Backward, one pass over x and the output gradient g: `gn = ∂L/∂n` is g on the first NOPE dims and
the pairs rotated back by −θ (the rotation's Jacobian is its transpose); then the RMSNorm backward
`dx = rstd·gn − x·rstd³·mean(gn·x)` in float32, rounded once. Only x, positions and the frequencies
are saved; the statistics are recomputed. The output is always fresh storage and no input is written.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.lazy_jit import jitted
from megatron_dsa.backends.triton_kernels.rms_norm import eps_tensor
from megatron_dsa.backends.triton_kernels.rope import NUM_WARPS, check_inputs, row_block
from megatron_dsa.backends.triton_kernels.tiles import cdiv, pow2
from megatron_dsa.ops.precision import compute_dtype


def _launch(x: Tensor, positions: Tensor, freq: Tensor, eps: Tensor, grad: Optional[Tensor] = None) -> Tensor:
    """The forward (`grad` None) or, given `grad = ∂L/∂out`, the backward over the rows of `x [R, Dh]`.

    x and grad contiguous `[R, Dh]`; `positions [R / heads]`; `freq [P/2]` and `eps [1]` in the
    statistics dtype. Returns a new `[R, Dh]` tensor: the output, or ∂L/∂x."""
    from megatron_dsa.backends.triton_kernels import _norm_rope_kernels as kernels
    import triton.language as tl

    out = torch.empty_like(x)
    rows, width, half = x.shape[0], x.shape[1], freq.shape[0]
    if out.numel() == 0:
        return out
    block_d, block_r = row_block(width)
    if grad is None:
        kernel, row_tensors = kernels.norm_rope_forward_kernel, (x, out)
    else:
        kernel, row_tensors = kernels.norm_rope_backward_kernel, (x, grad, out)
    jitted(kernel)[(cdiv(rows, block_r),)](
        *row_tensors, positions, freq, eps, rows, rows // positions.shape[0],
        NOPE=width - 2 * half, HALF=half, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_HALF=pow2(half),
        COMPUTE=tl.float64 if x.dtype == torch.float64 else tl.float32, num_warps=NUM_WARPS)
    return out


class TritonNormRope(torch.autograd.Function):
    """`(x [R, Dh], positions, freq [P/2], eps [1]) → rope(rms_norm(x)) [R, Dh]`."""

    @staticmethod
    def forward(ctx, x: Tensor, positions: Tensor, freq: Tensor, eps: Tensor) -> Tensor:
        ctx.save_for_backward(x, positions, freq, eps)
        return _launch(x, positions, freq, eps)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, positions, freq, eps = ctx.saved_tensors
        grad_x = _launch(x, positions, freq, eps, grad=grad_out.contiguous())
        return grad_x, None, None, None


def norm_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """`rope(rms_norm(x, None, eps), positions, inv_freq)` for `x [T, Dh]` or `x [T, H, Dh]` (new storage).

    `positions [T]`; `inv_freq [P/2]`: the pair frequencies (any float dtype/device, converted to the
    statistics dtype as the reference does); `eps`: the RMSNorm epsilon. Same contract as
    `megatron_dsa.ops.rope.norm_rope`; positions and inv_freq get no gradient.
    """
    check_inputs(x, positions, inv_freq, op="norm_rope")
    compute = compute_dtype(x.dtype)
    eps_t = eps_tensor(eps, "norm_rope", compute, x.device)
    freq = inv_freq.to(x.device, compute).contiguous()
    flat = x.contiguous().view(-1, x.shape[-1])
    return TritonNormRope.apply(flat, positions.contiguous(), freq, eps_t).view(x.shape)
