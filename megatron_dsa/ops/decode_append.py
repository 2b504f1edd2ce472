"""A decode step's last write: each sequence's new row into the cache buffer it joins, then its length + 1.

W/C/H layers keep the last `W − 1` K = V rows of each sequence in a ring (`window [B, W − 1, D]`, position `p` at
slot `p % (W − 1)`); the slot of the new token's position still holds a row its attention reads, so the row goes in
after the attention. M layers keep every position's latent row (`latent [B, capacity, R + P]`, position `p` at
slot `p`, the same rule since `p < capacity`). The lengths `seqlens [B]` are the new tokens' positions during the
step; counting the token in is the step's last act.
"""

from __future__ import annotations

import torch
from torch import Tensor


def append_rows(buffer: Tensor, rows: Tensor, seqlens: Tensor) -> None:
    """In place: `buffer[b, seqlens[b] % R] = rows[b]`, then `seqlens += 1`.

    buffer: `[B, R, D]`; rows: `[B, D]` in buffer's dtype and device; seqlens: `[B]` int64 on the same device."""
    check_append_inputs(buffer, rows, seqlens)
    sequences = torch.arange(buffer.shape[0], device=buffer.device)
    buffer[sequences, seqlens % buffer.shape[1]] = rows
    seqlens += 1


def check_append_inputs(buffer: Tensor, rows: Tensor, seqlens: Tensor) -> None:
    """The `decode_append` contract's shapes, dtypes and devices (every backend checks the same)."""
    if buffer.dim() != 3 or rows.dim() != 2 or seqlens.dim() != 1:
        raise ValueError(f"decode_append: buffer must be [B, R, D], rows [B, D] and seqlens [B], got "
                         f"{tuple(buffer.shape)}, {tuple(rows.shape)} and {tuple(seqlens.shape)}")
    batch, slots, width = buffer.shape
    if rows.shape != (batch, width) or seqlens.shape[0] != batch or slots == 0:
        raise ValueError(f"decode_append: rows {tuple(rows.shape)} and seqlens {tuple(seqlens.shape)} do not match "
                         f"buffer {tuple(buffer.shape)} (rows [B, D], seqlens [B], at least one slot)")
    if rows.dtype != buffer.dtype:
        raise TypeError(f"decode_append: rows dtype {rows.dtype} differs from buffer dtype {buffer.dtype}")
    if seqlens.dtype != torch.int64:
        raise TypeError(f"decode_append: seqlens must be int64, got {seqlens.dtype}")
    if rows.device != buffer.device or seqlens.device != buffer.device:
        raise ValueError(f"decode_append: buffer, rows and seqlens must share a device, got {buffer.device}, "
                         f"{rows.device} and {seqlens.device}")
