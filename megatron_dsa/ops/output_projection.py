"""Grouped low-rank output projection "wo_a" (docs/math.md §10)."""

from __future__ import annotations

import torch
from torch import Tensor


def _group_major(rows: Tensor, groups: int) -> Tensor:
    """`[T, G·w]` → a `[G, T, w]` view (row stride `G·w`): what a strided batched GEMM reads in place."""
    return rows.view(rows.shape[0], groups, -1).transpose(0, 1)


class GroupedProjection(torch.autograd.Function):
    """`o [T, G·i]`, `weight [G, Ro, i]` (o's dtype) → `[T, G·Ro]`, group by group.

    Each group is one slice of a batched GEMM that reads and writes the token-major layouts through
    strides: no permuted copy of `o` (or of its gradient, the size of the attention output) is made.
    """

    @staticmethod
    def forward(ctx, o: Tensor, weight: Tensor) -> Tensor:
        groups, rank = weight.shape[0], weight.shape[1]
        ctx.save_for_backward(o, weight)
        out = o.new_empty(o.shape[0], groups * rank)
        torch.bmm(_group_major(o, groups), weight.transpose(1, 2), out=_group_major(out, groups))
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        o, weight = ctx.saved_tensors
        groups = weight.shape[0]
        grad_groups = _group_major(grad_out.contiguous(), groups)  # [G, T, Ro]
        grad_o = torch.empty_like(o)
        torch.bmm(grad_groups, weight, out=_group_major(grad_o, groups))
        grad_weight = torch.bmm(grad_groups.transpose(1, 2), _group_major(o, groups))
        return grad_o, grad_weight


def grouped_output_projection(o: Tensor, weight: Tensor, groups: int) -> Tensor:
    """`o [..., H·D]` → `[..., G·Ro]`: group `g` (heads `g·H/G … (g+1)·H/G − 1`, head-major then dim)
    is mapped by `weight.view(G, Ro, H·D/G)[g]`. weight: `[G·Ro, H·D/G]` (Megatron `linear_o_group_proj`).
    """
    width = o.shape[-1]
    if width % groups or weight.shape[1] != width // groups or weight.shape[0] % groups:
        raise ValueError(f"grouped projection: o width {width}, weight {tuple(weight.shape)}, groups {groups}")
    w = weight.view(groups, weight.shape[0] // groups, width // groups).to(o.dtype)
    rows = o.reshape(-1, width).contiguous()
    if torch.compiler.is_compiling():
        # The compiler plans the layouts itself and cannot trace a strided `out=` GEMM.
        grouped = torch.einsum("tgi,gri->tgr", rows.view(rows.shape[0], groups, -1), w)
        return grouped.reshape(*o.shape[:-1], -1)
    return GroupedProjection.apply(rows, w).view(*o.shape[:-1], -1)
