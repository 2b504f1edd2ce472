"""Partial interleaved RoPE as a Triton kernel: a drop-in for `megatron_dsa.ops.rope.rope`.

The last `P = 2·len(inv_freq)` dims of each head are `P/2` adjacent pairs rotated by
`θ_i = pos·f_i` (amplitude `a` scales cos and sin); the first `Dh − P` dims are copied. The result is
always fresh storage: the input is never written, so a tensor autograd saved cannot change.

Backward: the Jacobian of a rotation by θ scaled by `a` is its transpose, `a`·(rotation by −θ), on
the rotated dims and the identity elsewhere, so the gradient is the same kernel with `inverse`
flipped. Nothing but the small `positions`/`inv_freq`/`amplitude` tensors is saved.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.tiles import cdiv, pow2
from megatron_dsa.device_cache import device_scalar
from megatron_dsa.ops.precision import compute_dtype

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# A program holds BLOCK_R whole rows (coalesced loads) of about ROW_BLOCK_ELEMENTS elements, one warp per
# ROW_BLOCK_ELEMENTS. Measured on an H200 in bf16: the fused RMSNorm + RoPE backward of the query rows
# [4096·64, 512] took 215 µs with one warp over 2 rows against 329 µs with 8 warps over 8 rows (the row
# sums then cross warps; a copy of that traffic takes 193 µs), its forward 132 against 147 µs; RoPE of
# 512-wide rows runs at a copy's speed either way. More than 8 rows per program ran 2–4x slower on
# [4096·64, 128] rows (142 against 68 µs with 16 rows, before the pairs were read as contiguous rows;
# not pinned down), hence the cap.
ROW_BLOCK_ELEMENTS = 1024
MAX_BLOCK_ROWS = 8


def row_block(width: int) -> tuple[int, int, int]:
    """`(BLOCK_D, BLOCK_R, num_warps)`: a power-of-two block covering one row of `width`, the rows per
    program and the warps that run them."""
    block_d = pow2(width)
    block_r = max(1, min(MAX_BLOCK_ROWS, ROW_BLOCK_ELEMENTS // block_d))
    return block_d, block_r, max(1, block_r * block_d // ROW_BLOCK_ELEMENTS)


def rotary_row_args(x: Tensor, positions: Tensor, freq: Tensor) -> dict:
    """Launch arguments shared by the kernels over rotary rows `x [R, Dh]` (RoPE, fused RMSNorm + RoPE):
    `H` (heads per token; row r is token r // H), the pair layout, tiles, warps, and `ONE_TOKEN` when
    every row block lies within one token's heads."""
    import triton.language as tl

    width, half = x.shape[1], freq.shape[0]
    block_d, block_r, warps = row_block(width)
    heads = x.shape[0] // positions.shape[0]
    return dict(H=heads, NOPE=width - 2 * half, HALF=half, BLOCK_R=block_r, BLOCK_D=block_d,
                BLOCK_HALF=pow2(half), ONE_TOKEN=heads % block_r == 0,
                COMPUTE=tl.float64 if x.dtype == torch.float64 else tl.float32, num_warps=warps)


def _launch(x: Tensor, positions: Tensor, freq: Tensor, amplitude: Tensor, inverse: bool) -> Tensor:
    """`x [R, Dh]` contiguous → rotated copy; `positions [R / heads]`; freq, amplitude in the angle dtype."""
    from megatron_dsa.backends.triton_kernels import _rope_kernels as kernels

    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    args = rotary_row_args(x, positions, freq)
    launcher(kernels.rope_kernel)[(cdiv(x.shape[0], args["BLOCK_R"]),)](
        x, out, positions, freq, amplitude, x.shape[0], INVERSE=inverse, **args, **chained_launch(x.device))
    return out


class TritonRope(torch.autograd.Function):
    """`(x [R, Dh], positions, freq [P/2], amplitude [1], inverse) → rotated x [R, Dh]`."""

    @staticmethod
    def forward(ctx, x: Tensor, positions: Tensor, freq: Tensor, amplitude: Tensor, inverse: bool) -> Tensor:
        ctx.save_for_backward(positions, freq, amplitude)
        ctx.inverse = inverse
        return _launch(x, positions, freq, amplitude, inverse)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        positions, freq, amplitude = ctx.saved_tensors
        grad_x = _launch(grad_out.contiguous(), positions, freq, amplitude, not ctx.inverse)
        return grad_x, None, None, None, None


def rope(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
         amplitude: float = 1.0) -> Tensor:
    """Rotate `x [T, Dh]` or `x [T, H, Dh]` at `positions [T]` (new storage; x is not modified).

    `inv_freq [P/2]`: the pair frequencies (any float dtype/device; converted to the angle dtype as the
    reference does). Same contract as `megatron_dsa.ops.rope.rope`; positions and inv_freq get no
    gradient.
    """
    check_inputs(x, positions, inv_freq)
    angle_dtype = compute_dtype(x.dtype)
    freq = inv_freq.to(x.device, angle_dtype).contiguous()
    scalar = device_scalar(amplitude, angle_dtype, x.device)  # by pointer: float64 stays exact
    flat = x.contiguous().view(-1, x.shape[-1])
    return TritonRope.apply(flat, positions.contiguous(), freq, scalar, bool(inverse)).view(x.shape)


def check_inputs(x: Tensor, positions: Tensor, inv_freq: Tensor, op: str = "rope") -> None:
    """Raise `ValueError`/`TypeError` naming the argument of `op` that Triton's RoPE cannot take."""
    if x.dim() not in (2, 3):
        raise ValueError(f"{op} expects x [T, Dh] or [T, H, Dh], got {tuple(x.shape)}")
    if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"{op} positions must be [T] with T = {x.shape[0]}, got {tuple(positions.shape)}")
    if inv_freq.dim() != 1 or inv_freq.shape[0] == 0:
        raise ValueError(f"{op} inv_freq must be a non-empty [P/2] vector, got {tuple(inv_freq.shape)}")
    if x.shape[-1] < 2 * inv_freq.shape[0]:
        raise ValueError(f"rotary dims (2*{inv_freq.shape[0]}) exceed the head dim {x.shape[-1]}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton {op} needs x of dtype among {SUPPORTED_DTYPES}, got {x.dtype}")
    if not positions.is_floating_point() and positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op} positions must be int32, int64 or floating, got {positions.dtype}")
    if positions.device != x.device:
        raise ValueError(f"{op} positions on {positions.device} but x on {x.device}")
    require_triton(x.device, op, "x's device")
