"""Gated-pooling compressor (docs/math.md §4): `r` token rows → one compressed entry.

ratio 4 ("CSA", overlapping): entry `j` pools 8 slots, the previous group's tokens through the
first `Dc` channels and its own group's tokens through the last `Dc` channels (`coff = 2`);
ratio ≥ 8 ("HCA"): entry `j` pools the `r` tokens of its own group through all `Dc` channels.
The pooling weights are an independent softmax per channel over the slots.
"""

from __future__ import annotations

from typing import Callable, Optional

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
    first = layout.group_first_rows
    own = first.unsqueeze(1) + torch.arange(r, device=kv.device)  # [Tc, r] token rows of each entry's group
    if coff == 1:
        return pool_slots(kv[own], gate[own], ape)
    # Both groups come straight from token rows, so an entry never depends on another compressed row (a rank
    # can pool any entry whose tokens it holds).
    previous = (own - r).clamp_min(0)
    return pool_slots(kv[own], gate[own], ape, kv[previous], gate[previous], layout.entry_index == 0)


def pool_slots(kv_own: Tensor, gate_own: Tensor, ape: Tensor, kv_previous: Optional[Tensor] = None,
               gate_previous: Optional[Tensor] = None, no_previous: Optional[Tensor] = None) -> Tensor:
    """Entries `[E, Dc]` (in kv's dtype) from their slot rows: `kv_own`, `gate_own` `[E, r, coff·Dc]` the tokens of
    each entry's own group; for ratio 4 (coff 2) also `kv_previous`, `gate_previous` those of the group before it,
    through the first Dc channels while the own group's pass through the last Dc, and `no_previous [E]` True
    where there is none (a sequence's first entry: value 0, gate −inf). Softmax per channel over the slots."""
    compute = compute_dtype(kv_own.dtype)
    if kv_previous is None:
        k = kv_own.to(compute)
        z = gate_own.to(compute) + ape.to(compute)
    else:
        r, dc = kv_own.shape[1], kv_own.shape[-1] // 2
        k = torch.cat((kv_previous[..., :dc], kv_own[..., dc:]), dim=1).to(compute)
        z = torch.cat((gate_previous[..., :dc] + ape[:, :dc], gate_own[..., dc:] + ape[:, dc:]), dim=1).to(compute)
        none = no_previous.view(-1, 1, 1) & (torch.arange(2 * r, device=k.device) < r).view(1, -1, 1)
        k = torch.where(none, 0.0, k)
        z = torch.where(none, float("-inf"), z)
    weights = torch.softmax(z, dim=1)
    return (weights * k).sum(1).to(kv_own.dtype)


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
    return finish_entries(pool(kv, gate, ape, layout), layout.positions, norm_weight, eps, inv_freq, rotate,
                          normalise_and_rotate)


def finish_entries(pooled: Tensor, positions: Tensor, norm_weight: Tensor, eps: float, inv_freq: Tensor,
                   rotate: bool, normalise_and_rotate: Callable[..., Tensor] = norm_rope) -> Tensor:
    """Pooled entries `[E, Dc]` → RMSNorm (`norm_weight [Dc]`) → RoPE at `positions [E]` (entry j's is `j·r`) →
    Hadamard if `rotate` (the indexer's keys)."""
    out = normalise_and_rotate(pooled, positions, inv_freq, eps, norm_weight)
    return hadamard_transform(out) if rotate else out
