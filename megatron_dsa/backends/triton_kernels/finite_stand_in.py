"""The non-finite guard's pass over q, k or v as one Triton kernel: `ops.dense_attention.finite_stand_in`
and `non_finite_heads` of the same tensor at once.

Unfused they are three passes: `aminmax` reads t for the flags, `nan_to_num` reads it again and writes the
stand-in (and a few small kernels turn the minima and maxima into flags). Here each head vector is read
once, written once (0 in place of each NaN and infinity) and flagged. The stand-in is always fresh,
contiguous storage; t is never written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.rope import row_block
from megatron_dsa.backends.triton_kernels.tiles import cdiv, on_device

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def finite_stand_in_with_flags(t: Tensor) -> tuple[Tensor, Tensor]:
    """`t [R, H, D]` (any strides) → `(stand_in [R, H, D]` contiguous, t's dtype, 0 in place of every NaN and
    infinity; `flagged [R, H]` bool, the head vector held one)`: the values of `(finite_stand_in(t),
    non_finite_heads(t))`, no autograd (the guard's `_StandIn` owns the gradient)."""
    if t.dim() != 3:
        raise ValueError(f"finite_stand_in_with_flags needs t [R, H, D], got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"finite_stand_in_with_flags supports {SUPPORTED_DTYPES}, got {t.dtype}")
    require_triton(t.device, "finite stand-in", "t's device")
    rows, heads, width = t.shape
    stand_in = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if stand_in.numel() == 0:  # no element, nothing non-finite
        return stand_in, torch.zeros(rows, heads, dtype=torch.bool, device=t.device)
    flags = torch.empty(rows, heads, dtype=torch.int8, device=t.device)  # the kernel writes every flag
    if t.stride(2) != 1:
        t = t.contiguous()
    from megatron_dsa.backends.triton_kernels import _finite_stand_in_kernels as kernels

    block_d, block_n, warps = row_block(width)
    with on_device(t.device):
        launcher(kernels.finite_stand_in_kernel)[(cdiv(rows * heads, block_n),)](
            t, stand_in, flags, rows * heads, heads, t.stride(0), t.stride(1), D=width, BLOCK_N=block_n,
            BLOCK_D=block_d, num_warps=warps)
    return stand_in, flags.view(torch.bool)
