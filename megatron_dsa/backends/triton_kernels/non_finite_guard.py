"""The non-finite guard's passes (`backends.dense_layout.isolate_non_finite`) as Triton kernels.

In: `finite_stand_in_with_flags` is `ops.dense_attention.finite_stand_in` and `non_finite_heads` of one
tensor at once. Unfused they are three passes: `aminmax` reads t for the flags, `nan_to_num` reads it again and
writes the stand-in (and a few small kernels turn the minima and maxima into flags); here each head vector is read
once, written once (0 in place of each NaN and infinity) and flagged.

Out: `fill_flagged` is `torch.where(flagged[..., None], fill, t)`, the guard's NaN in the rows that see a
non-finite element (and 0 in their gradient). torch's `where` broadcasts the `[R, H, 1]` condition, which keeps it
from its vectorised kernel; here flagged vectors are written without being read.

Outputs are always fresh, contiguous storage; t is never written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.rope import row_block
from megatron_dsa.backends.triton_kernels.tiles import cdiv, on_device

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check(t: Tensor, op: str) -> None:
    if t.dim() != 3:
        raise ValueError(f"{op} needs t [R, H, D], got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op} supports {SUPPORTED_DTYPES}, got {t.dtype}")


def _launch(kernel, t: Tensor, *args) -> None:
    """`kernel` over the head vectors of `t [R, H, D]` (unit last stride), `args` before its shape arguments."""
    rows, heads, width = t.shape
    block_d, block_n, warps = row_block(width)
    with on_device(t.device):
        launcher(kernel)[(cdiv(rows * heads, block_n),)](
            *args, rows * heads, heads, t.stride(0), t.stride(1), D=width, BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=warps)


def finite_stand_in_with_flags(t: Tensor) -> tuple[Tensor, Tensor]:
    """`t [R, H, D]` (any strides) → `(stand_in [R, H, D]` contiguous, t's dtype, 0 in place of every NaN and
    infinity; `flagged [R, H]` bool, the head vector held one)`: the values of `(finite_stand_in(t),
    non_finite_heads(t))`, no autograd (the guard's `_StandIn` owns the gradient)."""
    _check(t, "finite_stand_in_with_flags")
    require_triton(t.device, "finite_stand_in_with_flags", "t's device")
    stand_in = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if stand_in.numel() == 0:  # no element, nothing non-finite
        return stand_in, torch.zeros(t.shape[:2], dtype=torch.bool, device=t.device)
    flags = torch.empty(t.shape[:2], dtype=torch.int8, device=t.device)  # the kernel writes every flag
    t = t if t.stride(2) == 1 else t.contiguous()
    from megatron_dsa.backends.triton_kernels import _non_finite_guard_kernels as kernels

    _launch(kernels.finite_stand_in_kernel, t, t, stand_in, flags)
    return stand_in, flags.view(torch.bool)


def fill_flagged(t: Tensor, flagged: Tensor, fill: float) -> Tensor:
    """`t [R, H, D]` (any strides) with `fill` in every head vector where `flagged [R, H]` (bool) is set: the
    values of `torch.where(flagged.unsqueeze(-1), fill, t)` in t's dtype, as a new contiguous tensor; no autograd."""
    _check(t, "fill_flagged")
    if flagged.shape != t.shape[:2] or flagged.dtype != torch.bool:
        raise ValueError(f"fill_flagged needs flagged [R, H] bool for t {tuple(t.shape)}, got "
                         f"{tuple(flagged.shape)} {flagged.dtype}")
    require_triton(t.device, "fill_flagged", "t's device")
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if out.numel() == 0:
        return out
    t = t if t.stride(2) == 1 else t.contiguous()
    from megatron_dsa.backends.triton_kernels import _non_finite_guard_kernels as kernels

    _launch(kernels.fill_flagged_kernel, t, t, flagged.contiguous().view(torch.int8), out, float(fill))
    return out
