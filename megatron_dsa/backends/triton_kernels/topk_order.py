"""Top-k picks of a kernel that promises no order, put in the `ops.indices.topk_columns` order with one
Triton kernel: valid picks by score (highest first), ties to the lower column, −1 after them.

The torch equivalent (`backends.cudnn` uses it where Triton cannot run) takes about twenty small ops
and a full radix sort of `[T, K]` int64 keys; here each row's keys are sorted in registers by one
program.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import jitted
from megatron_dsa.backends.triton_kernels.tiles import pow2

MAX_WIDTH = 4096  # picks per row one program sorts in registers


def order_picks(picked: Tensor, ranked: Tensor, valid: Tensor) -> Tensor:
    """`picked [T, K]` int32/int64 column ids (any order; invalid ids allowed), `ranked [T, RC]` float32
    scores with `RC >= C`, `valid [T, C]` bool → `[T, K]` int64 in reference order, −1 padded.

    A pick counts when it is in `[0, C)` and valid there; its score is `ranked[t, pick]`."""
    _check(picked, ranked, valid)
    from megatron_dsa.backends.triton_kernels import _topk_order_kernels as kernels

    rows, width = picked.shape
    out = torch.empty((rows, width), dtype=torch.long, device=picked.device)
    if out.numel() == 0:
        return out
    jitted(kernels.order_picks_kernel)[(rows,)](
        picked.contiguous(), ranked.contiguous(), valid.contiguous(), out, width, valid.shape[1],
        ranked.shape[1], BLOCK_K=pow2(width))
    return out


def _check(picked: Tensor, ranked: Tensor, valid: Tensor) -> None:
    if picked.dim() != 2 or ranked.dim() != 2 or valid.dim() != 2:
        raise ValueError(f"order_picks needs 2-D picked, ranked and valid, got {tuple(picked.shape)}, "
                         f"{tuple(ranked.shape)}, {tuple(valid.shape)}")
    rows = picked.shape[0]
    if ranked.shape[0] != rows or valid.shape[0] != rows or ranked.shape[1] < valid.shape[1]:
        raise ValueError(f"order_picks rows disagree or ranked is narrower than valid: picked "
                         f"{tuple(picked.shape)}, ranked {tuple(ranked.shape)}, valid {tuple(valid.shape)}")
    if picked.shape[1] > MAX_WIDTH:
        raise ValueError(f"order_picks sorts at most {MAX_WIDTH} picks per row, got {picked.shape[1]}")
    if picked.dtype not in (torch.int32, torch.int64) or ranked.dtype != torch.float32 or valid.dtype != torch.bool:
        raise TypeError(f"order_picks needs int32/int64 picked, float32 ranked and bool valid, got "
                        f"{picked.dtype}, {ranked.dtype}, {valid.dtype}")
    if len({picked.device, ranked.device, valid.device}) != 1:
        raise ValueError(f"order_picks inputs must share one device, got {picked.device}, {ranked.device}, "
                         f"{valid.device}")
    require_triton(picked.device, "order_picks", "picked's device")
