"""Grouped low-rank output projection "wo_a" (spec §1.2 step 6)."""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_output_projection(o: Tensor, weight: Tensor, groups: int) -> Tensor:
    """`o [..., H·D]` → `[..., G·Ro]`: group `g` (heads `g·H/G … (g+1)·H/G − 1`, head-major then dim)
    is mapped by `weight.view(G, Ro, H·D/G)[g]`. weight: `[G·Ro, H·D/G]` (Megatron `linear_o_group_proj`).
    """
    width = o.shape[-1]
    if width % groups or weight.shape[1] != width // groups or weight.shape[0] % groups:
        raise ValueError(f"grouped projection: o width {width}, weight {tuple(weight.shape)}, groups {groups}")
    grouped = o.unflatten(-1, (groups, width // groups))
    w = weight.view(groups, weight.shape[0] // groups, width // groups)
    return torch.einsum("...gi,gri->...gr", grouped, w.to(o.dtype)).flatten(-2)
