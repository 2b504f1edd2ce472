"""A decode step's compressor write (docs/math.md §4): one new token per sequence joins its compressor's pending
slots, and the entry of the token's group is pooled, normalised, rotated and stored, whether the group is
complete or not (an unfinished entry is not visible yet, `j >= (p + 1) // r`, and a later token rewrites it).

The pending slots of a sequence are `state[b] [K, 2·coff·Dc]`, the `kv` then the `gate` projections of its last
`K` positions at slot `position % K` (`K = 2r` for the overlapping ratio 4, which keeps the previous group too,
else `K = r`). The stores are `[B, C, Dc]` entries, or e4m3 codes with one float32 scale per entry (an FP8 cache).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.ops.compressor import OVERLAP_RATIO, channel_factor, finish_entries, pool_slots
from megatron_dsa.ops.decode_attention import entry_counts
from megatron_dsa.ops.fp8_linear import quantize_rows
from megatron_dsa.ops.indexer import FP8_KEYS, check_key_scales


def pending_slots(ratio: int) -> int:
    """`K`, the positions a compressor keeps between calls: its unfinished group, and for the overlapping ratio 4
    the finished group before it (the first half of the next entry's slots)."""
    return 2 * ratio if ratio == OVERLAP_RATIO else ratio


def decode_compress(state: Tensor, new_rows: Tensor, positions: Tensor, ape: Tensor, norm_weight: Tensor, eps: float,
                    inv_freq: Tensor, rotate: bool, store: Tensor, scales: Optional[Tensor] = None,
                    counts: Optional[Tensor] = None) -> None:
    """Write each sequence's new token and the entry of its group, in place, and with `counts` the entries each
    new token sees.

    state: `[B, K, 2·coff·Dc]` pending slots; new_rows: `[B, 2·coff·Dc]` the new tokens' `kv | gate` projections
    (state's dtype), written at slot `positions[b] % K`; positions: `[B]` int, the new tokens' positions; ape:
    `[r, coff·Dc]`; norm_weight: `[Dc]`; inv_freq: `[P/2]`; rotate: Hadamard after RoPE (the indexer's keys).
    store: `[B, C, Dc]`, row `j = positions[b] // r` of sequence b rewritten at slot `j % C` (`scales [B, C]`
    float32 with an e4m3 store: the row's scale). A cache's store has a slot per entry (its capacity check keeps
    `j < C`); a one-slot store `[B, 1, Dc]` receives each step's entry (an FP8 attention-row cache's scratch row).
    counts: `[B]` int32/int64, written `(positions[b] + 1) // r`, the complete entries (the indexer's valid columns
    of this step: its kernel writes them with the entry, where they took two or three elementwise launches).
    """
    check_decode_compress_inputs(state, new_rows, positions, ape, norm_weight, inv_freq, store, scales, counts)
    batch, slots, row_width = state.shape
    ratio = ape.shape[0]
    sequences = torch.arange(batch, device=state.device)
    state[sequences, positions % slots] = new_rows
    entry = torch.div(positions, ratio, rounding_mode="floor")
    own = (entry * ratio).unsqueeze(1) + torch.arange(ratio, device=state.device)  # [B, r] the group's positions
    kv_width = row_width // 2
    rows = state[sequences.unsqueeze(1), own % slots]  # [B, r, 2·coff·Dc]
    if channel_factor(ratio) == 1:
        pooled = pool_slots(rows[..., :kv_width], rows[..., kv_width:], ape)
    else:
        previous = state[sequences.unsqueeze(1), (own - ratio) % slots]
        pooled = pool_slots(rows[..., :kv_width], rows[..., kv_width:], ape, previous[..., :kv_width],
                            previous[..., kv_width:], entry == 0)
    values, row_scales = encode_rows(finish_entries(pooled, entry * ratio, norm_weight, eps, inv_freq, rotate),
                                     store, scales)
    slot = entry % store.shape[1]
    byte_view(store)[sequences, slot] = byte_view(values)
    if scales is not None:
        scales[sequences, slot] = row_scales
    if counts is not None:
        counts.copy_(entry_counts(positions, ratio))


def encode_rows(rows: Tensor, store: Tensor, scales: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """`rows [n, Dc]` as `store` keeps them: in its dtype, or for an FP8 store (`scales` given) rounded to e4m3
    with one float32 scale per row (`ops.fp8_linear.quantize_rows`) → `(values, row scales [n] or None)`."""
    if scales is None:
        return rows.to(store.dtype), None
    values, row_scales = quantize_rows(rows)
    return values, row_scales.squeeze(1).to(scales.dtype)


def byte_view(t: Tensor) -> Tensor:
    """An e4m3 tensor as its bytes (torch's index writes take no float8), any other as itself."""
    return t.view(torch.uint8) if t.dtype == FP8_KEYS else t


def check_decode_compress_inputs(state: Tensor, new_rows: Tensor, positions: Tensor, ape: Tensor,
                                 norm_weight: Tensor, inv_freq: Tensor, store: Tensor,
                                 scales: Optional[Tensor], counts: Optional[Tensor] = None) -> None:
    """ValueError/TypeError naming the argument when `decode_compress`'s arguments disagree (shapes and dtypes
    only: no device read)."""
    if state.dim() != 3 or not state.is_floating_point():
        raise ValueError(f"decode compressor: state must be a floating [B, K, 2·coff·Dc] tensor, got "
                         f"{tuple(state.shape)} {state.dtype}")
    batch, slots, row_width = state.shape
    ratio = ape.shape[0] if ape.dim() == 2 else 0
    if ratio < 1 or slots != pending_slots(ratio):
        raise ValueError(f"decode compressor: ape must be [r, coff·Dc] with the state's K = {slots} slots holding "
                         f"{'2r for r = 4, else r' if ratio else 'its pending groups'}, got ape {tuple(ape.shape)}")
    coff = channel_factor(ratio)
    if row_width % (2 * coff) or ape.shape[1] != row_width // 2:
        raise ValueError(f"decode compressor: state rows ({row_width} wide) must hold kv and gate of "
                         f"coff·Dc = ape's {ape.shape[1]} columns each (coff = {coff} for ratio {ratio})")
    dc = row_width // (2 * coff)
    if new_rows.shape != (batch, row_width) or new_rows.dtype != state.dtype:
        raise ValueError(f"decode compressor: new_rows must be [B, 2·coff·Dc] = [{batch}, {row_width}] in the "
                         f"state's {state.dtype}, got {tuple(new_rows.shape)} {new_rows.dtype}")
    if positions.shape != (batch,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode compressor: positions must be int32/int64 [B] = [{batch}], got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if norm_weight.shape != (dc,):
        raise ValueError(f"decode compressor: norm_weight must be [Dc] = [{dc}], got {tuple(norm_weight.shape)}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > dc:
        raise ValueError(f"decode compressor: inv_freq must be [P/2] with P <= Dc = {dc}, got "
                         f"{tuple(inv_freq.shape)}")
    if store.dim() != 3 or store.shape[0] != batch or store.shape[2] != dc:
        raise ValueError(f"decode compressor: store must be [B, C, Dc] = [{batch}, C, {dc}], got "
                         f"{tuple(store.shape)}")
    check_key_scales("decode compressor", store, scales, "store", "scales")
    if counts is not None and (counts.shape != (batch,) or counts.dtype not in (torch.int32, torch.int64)
                               or not counts.is_contiguous()):
        raise ValueError(f"decode compressor: counts must be a contiguous int32/int64 [B] = [{batch}] tensor, got "
                         f"{tuple(counts.shape)} {counts.dtype}")
    tensors = (state, new_rows, positions, ape, norm_weight, inv_freq, store) + tuple(
        t for t in (scales, counts) if t is not None)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"decode compressor inputs must share one device, got {sorted(map(str, devices))}")
