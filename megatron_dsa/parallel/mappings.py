"""Autograd collectives between tensor-parallel regions (Megatron-Core semantics).

Each is a tiny `autograd.Function` whose backward is the adjoint of its forward:

| function | forward | backward |
|---|---|---|
| copy_to_tensor_parallel_region | identity | all-reduce |
| reduce_from_tensor_parallel_region | all-reduce | identity |
| scatter_to_sequence_parallel_region | keep own slice of dim 0 | all-gather dim 0 |
| gather_from_sequence_parallel_region | all-gather dim 0 | reduce-scatter dim 0, or keep own slice when the gradient is already complete on every rank |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter dim 0 | all-gather dim 0 |

With a group of size 1 (or None) every function returns its input unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_dsa.parallel.state import group_size


def _all_reduce(x: Tensor, group: ProcessGroup) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _single_tensor_collectives(group: ProcessGroup) -> bool:
    """Whether the group gathers into and reduce-scatters from one tensor. On NCCL that skips the list
    forms' staging copy (a cat kernel) and some host time per call; gloo keeps the list forms, which it
    has on every torch this package supports (it lacks a reduce-scatter there: `reduce_scatter_sum`)."""
    return dist.get_backend(group) != "gloo"


def start_all_gather_into(out: Tensor, x: Tensor, group: ProcessGroup, async_op: bool = False):
    """All-gather `x [n, ...]` from every rank into `out [size·n, ...]` (rank order); returns the work
    handle when `async_op`."""
    if _single_tensor_collectives(group):
        return dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    return dist.all_gather(list(out.chunk(dist.get_world_size(group))), x, group=group, async_op=async_op)


def _all_gather(x: Tensor, group: ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    start_all_gather_into(out, x, group)
    return out


def reduce_scatter_sum(x: Tensor, group: ProcessGroup) -> Tensor:
    """Sum `x [size·n, ...]` over the ranks and keep this rank's `[n, ...]` slice."""
    size = dist.get_world_size(group)
    _check_divisible(x, size)
    if not _single_tensor_collectives(group):  # gloo has no reduce_scatter: reduce all, keep own slice
        return _all_reduce(x, group).chunk(size, dim=0)[dist.get_rank(group)].contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _own_slice(x: Tensor, group: ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    _check_divisible(x, size)
    return x.chunk(size, dim=0)[dist.get_rank(group)].contiguous()


def _check_divisible(x: Tensor, size: int) -> None:
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism needs the sequence length ({x.shape[0]}) to be "
                         f"divisible by the tensor-parallel size ({size})")


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        reduce = reduce_scatter_sum if ctx.grad_is_partial else _own_slice
        return reduce(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


def _active(group: Optional[ProcessGroup]) -> bool:
    return group_size(group) > 1


def copy_to_tensor_parallel_region(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Enter a region whose ranks each use part of `x`: their gradients are summed."""
    return _CopyToRegion.apply(x, group) if _active(group) else x


def reduce_from_tensor_parallel_region(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Sum the partial results of the ranks."""
    return _ReduceFromRegion.apply(x, group) if _active(group) else x


def scatter_to_sequence_parallel_region(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Keep this rank's contiguous slice of dim 0 (the sequence)."""
    return _ScatterToSequence.apply(x, group) if _active(group) else x


def gather_from_sequence_parallel_region(x: Tensor, group: Optional[ProcessGroup],
                                         grad_is_partial: bool = True) -> Tensor:
    """All-gather dim 0. `grad_is_partial=False` when every rank's gradient of the gathered tensor is
    already the complete gradient (then backward keeps the own slice instead of summing copies)."""
    return _GatherFromSequence.apply(x, group, grad_is_partial) if _active(group) else x


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Sum partial results and keep this rank's slice of dim 0."""
    return _ReduceScatterToSequence.apply(x, group) if _active(group) else x


def all_reduce_no_grad(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """Sum a tensor that carries no gradient (e.g. the KL teacher's head-summed mass)."""
    return _all_reduce(x, group) if _active(group) else x
