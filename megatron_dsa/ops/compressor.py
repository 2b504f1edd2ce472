"""Gated-pooling compressor (docs/math.md §4): `r` token rows → one compressed entry.

ratio 4 ("CSA", overlapping): entry `j` pools 8 slots, the previous group's tokens through the
first `Dc` channels and its own group's tokens through the last `Dc` channels (`coff = 2`);
ratio ≥ 8 ("HCA"): entry `j` pools the `r` tokens of its own group through all `Dc` channels.
The pooling weights are an independent softmax per channel over the slots.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from megatron_dsa.ops.hadamard import hadamard_transform
from megatron_dsa.ops.layout import CompressedLayout
from megatron_dsa.ops.precision import compute_dtype
from megatron_dsa.ops.rope import norm_rope

OVERLAP_RATIO = 4


def channel_factor(ratio: int) -> int:
    """`coff`: 2 for the overlapping ratio-4 compressor, else 1."""
    return 2 if ratio == OVERLAP_RATIO else 1


def gated_pool(kv: Tensor, gate: Tensor, ape: Tensor, layout: CompressedLayout) -> Tensor:
    """Pool token projections into compressed entries.

    kv, gate: `[T, coff·Dc]` token projections (`x @ Wkv^T`, `x @ Wgate^T`).
    ape:      `[r, coff·Dc]` learned bias added to the gate logits at each in-group slot.
    Returns   `[capacity, Dc]` in `kv.dtype`; unused capacity rows hold finite garbage.

    The softmax and the weighted sum run in float32 (float64 for float64 inputs) and are rounded once,
    like the fused kernels (Megatron's eager path rounds the weights to bf16 first; docs/math.md §4.4, §14).
    """
    r, coff = layout.ratio, channel_factor(layout.ratio)
    if kv.shape != gate.shape or kv.shape[-1] % coff or ape.shape != (r, kv.shape[-1]):
        raise ValueError(f"compressor shapes disagree: kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, "
                         f"ape {tuple(ape.shape)} for ratio {r} (expected ape [{r}, {kv.shape[-1]}])")
    dc = kv.shape[-1] // coff
    compute = compute_dtype(kv.dtype)
    first = layout.group_first_rows
    if coff == 2:
        # 2r slots: the previous group's tokens through the first Dc channels, then this group's
        # tokens through the last Dc. Both come straight from token rows, so an entry never depends
        # on another compressed row (a rank can pool any entry whose tokens it holds).
        own = first.unsqueeze(1) + torch.arange(r, device=kv.device)
        previous = (own - r).clamp_min(0)
        k = torch.cat((kv[previous][..., :dc], kv[own][..., dc:]), dim=1).to(compute)
        z = torch.cat((gate[previous][..., :dc] + ape[:, :dc], gate[own][..., dc:] + ape[:, dc:]),
                      dim=1).to(compute)
        # The first entry of a sequence has no previous group: value 0, gate −inf.
        none = (layout.entry_index == 0).view(-1, 1, 1) & (torch.arange(2 * r, device=kv.device) < r).view(1, -1, 1)
        k = torch.where(none, 0.0, k)
        z = torch.where(none, float("-inf"), z)
    else:
        rows = first.unsqueeze(1) + torch.arange(r, device=kv.device)  # [Tc, r]
        k = kv[rows].to(compute)
        z = gate[rows].to(compute) + ape.to(compute)
    weights = torch.softmax(z, dim=1)
    return (weights * k).sum(1).to(kv.dtype)


def compress(kv: Tensor, gate: Tensor, ape: Tensor, norm_weight: Tensor, eps: float, layout: CompressedLayout,
             inv_freq: Tensor, rotate: bool,
             pool: Callable[[Tensor, Tensor, Tensor, CompressedLayout], Tensor] = gated_pool,
             normalise_and_rotate: Callable[..., Tensor] = norm_rope) -> Tensor:
    """The compressor after its projections: gated pool → RMSNorm → RoPE at `j·r` → (Hadamard).

    kv, gate: `[T, coff·Dc]` token projections `x @ Wkv^T`, `x @ Wgate^T` (the layer computes them with
    its other projections of x). ape: `[r, coff·Dc]`. norm_weight: `[Dc]`. Returns `[capacity, Dc]`.
    `pool` is the gated pooling and `normalise_and_rotate` the weighted RMSNorm then RoPE
    `(x, positions, inv_freq, eps, weight)` (fused kernels may replace the reference `gated_pool` and
    `ops.rope.norm_rope`; the rest of the composition stays the same).
    """
    pooled = pool(kv, gate, ape, layout)
    out = normalise_and_rotate(pooled, layout.positions, inv_freq, eps, norm_weight)
    return hadamard_transform(out) if rotate else out
