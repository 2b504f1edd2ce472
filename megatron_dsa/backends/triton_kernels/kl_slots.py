"""The per-slot inputs of the cuDNN indexer backward (`backends.cudnn.indexer_kl_backward`) in one Triton
kernel: the student's softmax over the valid slots, the row-weighted teacher target and int32 ids, padded
to the kernel's slot width.

The torch form (`backends.cudnn.kl_slots`, used where Triton cannot run) takes about fifteen small ops;
here one program per row reads each input once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.tiles import pow2

MAX_WIDTH = 8192  # slots one program holds in registers


def kl_slots(candidates: Tensor, keys: int, student: Tensor, target: Tensor, grad_rows: Tensor,
             width: int) -> tuple[Tensor, Tensor, Tensor]:
    """`(weighted, predict, ids)`, each `[T, width]` (float32, float32, int32), for `candidates [T, C]`
    int32/int64 rows of a key buffer of `keys` rows (anything outside `[0, keys)` is invalid), float32
    `student` and `target [T, C]`, `grad_rows [T]`, and `width >= C`. Same values as the torch form."""
    _check(candidates, student, target, grad_rows, width)
    from megatron_dsa.backends.triton_kernels import _kl_slots_kernels as kernels

    rows, cols = candidates.shape
    weighted = torch.empty((rows, width), dtype=torch.float32, device=candidates.device)
    predict, ids = torch.empty_like(weighted), torch.empty((rows, width), dtype=torch.int32, device=weighted.device)
    if weighted.numel() == 0:
        return weighted, predict, ids
    launcher(kernels.kl_slots_kernel)[(rows,)](
        candidates.contiguous(), student.contiguous(), target.contiguous(), grad_rows.contiguous(), weighted,
        predict, ids, cols, width, keys, BLOCK=pow2(width))
    return weighted, predict, ids


def _check(candidates: Tensor, student: Tensor, target: Tensor, grad_rows: Tensor, width: int) -> None:
    if candidates.dim() != 2 or student.shape != candidates.shape or target.shape != candidates.shape:
        raise ValueError(f"kl_slots needs candidates, student and target of one [T, C] shape, got "
                         f"{tuple(candidates.shape)}, {tuple(student.shape)}, {tuple(target.shape)}")
    if grad_rows.shape != candidates.shape[:1]:
        raise ValueError(f"kl_slots grad_rows must be [T] with T = {candidates.shape[0]}, got {tuple(grad_rows.shape)}")
    if not candidates.shape[1] <= width <= MAX_WIDTH:
        raise ValueError(f"kl_slots width must cover the {candidates.shape[1]} candidates and be at most "
                         f"{MAX_WIDTH}, got {width}")
    if candidates.dtype not in (torch.int32, torch.int64) or any(
            t.dtype != torch.float32 for t in (student, target, grad_rows)):
        raise TypeError(f"kl_slots needs int32/int64 candidates and float32 student, target and grad_rows, got "
                        f"{candidates.dtype}, {student.dtype}, {target.dtype}, {grad_rows.dtype}")
    if len({candidates.device, student.device, target.device, grad_rows.device}) != 1:
        raise ValueError("kl_slots inputs must share one device")
    require_triton(candidates.device, "kl_slots", "candidates' device")
