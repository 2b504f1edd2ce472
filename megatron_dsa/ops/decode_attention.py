"""Decode attention: one new query row per cached sequence over what the inference cache holds
(docs/math.md §7 is the attention; `layers.decoding` the cache).

Sequence `b` has `seqlens[b]` tokens cached; its new token sits at position `p = seqlens[b]` and attends,
with the sink `[H]` in the denominator only (as `ops.sparse_attention`):

- its own K = V row `kv_new[b]`;
- the window: the last `min(p, window − 1)` cached rows, which are the valid slots `0 … min(p, window − 1) − 1`
  of the ring `window_rows[b]` (a ring of `W − 1` slots holds positions `p − W + 1 … p − 1` once full;
  softmax does not care in which slot a row sits);
- compressed entries `j < (p + 1) // ratio` of `entries[b]` (those the new token completes included):
  every one of them (`entry_ids` None, kind H), or the selected ones `entry_ids[b] ≥ 0` (kind C's top-k,
  entry numbers; −1 = none).

    s_k = scale · <q[b,h], kv_k>,    out[b,h] = Σ_k exp(s_k) kv_k / (exp(sink_h) + Σ_k exp(s_k))

This module holds the readable reference (`decode_attention`, the `decode_attention` op family's
contract: it gathers the rows and runs the training reference op), the same over an FP8 attention-row cache
(`paged_decode_attention`, the `paged_decode_attention` family's: the new row already in a ring of `W` slots),
and the argument checks every backend shares. Nothing here reads a device value on the host, so a step that calls
it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.ops.indices import INVALID
from megatron_dsa.ops.paged_rows import PagedRows, check_pages, read_rows
from megatron_dsa.ops.rope import rope
from megatron_dsa.ops.sparse_attention import sparse_attention_forward


def window_valid(seqlens: Tensor, window: int, ring_slots: int) -> Tensor:
    """`[B, R]` bool: ring slot `i` of sequence b holds a row of its new token's window (`i < min(p, W − 1)`)."""
    return torch.arange(ring_slots, device=seqlens.device) < seqlens.clamp(max=window - 1).unsqueeze(1)


def entry_counts(seqlens: Tensor, ratio: int) -> Tensor:
    """`[B]` compressed entries the new token at position `seqlens` sees: `(p + 1) // ratio`."""
    return torch.div(seqlens + 1, ratio, rounding_mode="floor")


def decode_attention(query: Tensor, kv_new: Tensor, window_rows: Tensor, seqlens: Tensor, window: int,
                     entries: Optional[Tensor], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                     scale: float, inverse_rope_freq: Optional[Tensor] = None) -> Tensor:
    """The reference decode attention (module docstring) → `out [B, H, D]` in the query dtype.

    query `[B, H, D]`; kv_new `[B, D]`; window_rows `[B, R, D]` (the cache's ring); seqlens `[B]` int64
    (tokens cached before this one); window `W`; entries `[B, C, D]` or None (kind W); entry_ids `[B, K]`
    integer entry numbers or None (every visible entry); ratio `r` (ignored without entries); sink `[H]`;
    inverse_rope_freq `[P/2]` or None: then the output's last P columns are turned back to position 0
    (`ops.rope.rope(out, seqlens, inverse_rope_freq, inverse=True)`, what the W/C/H layers do next: a kernel
    can do it as it writes the output)."""
    check_decode_inputs(query, kv_new, window_rows, seqlens, window, entries, entry_ids, ratio, sink,
                        inverse_rope_freq)
    batch = query.shape[0]
    parts, valid = [kv_new.unsqueeze(1), window_rows], [torch.ones_like(seqlens, dtype=torch.bool).unsqueeze(1),
                                                         window_valid(seqlens, window, window_rows.shape[1])]
    if entries is not None:
        counts = entry_counts(seqlens, ratio).unsqueeze(1)
        if entry_ids is None:
            parts.append(entries)
            valid.append(torch.arange(entries.shape[1], device=query.device) < counts)
        else:
            ids = entry_ids.long()
            picked = (ids >= 0) & (ids < counts)
            parts.append(entries.gather(1, ids.clamp(0, entries.shape[1] - 1).unsqueeze(-1).expand(
                -1, -1, entries.shape[-1])))
            valid.append(picked)
    return _attend_rows(query, parts, valid, seqlens, sink, scale, inverse_rope_freq)


def _attend_rows(query: Tensor, parts: list[Tensor], valid: list[Tensor], seqlens: Tensor, sink: Tensor,
                 scale: float, inverse_rope_freq: Optional[Tensor]) -> Tensor:
    """Each sequence's query `[B, H, D]` over its rows `parts` (each `[B, L_i, D]`) where `valid` (each `[B, L_i]`),
    through the training reference op; the output's RoPE columns turned back when `inverse_rope_freq` is given."""
    rows = torch.cat([part.to(query.dtype) for part in parts], dim=1)  # [B, L, D]
    batch, width = rows.shape[:2]
    ids = torch.arange(batch * width, device=query.device).view(batch, width)
    indices = torch.where(torch.cat(valid, dim=1), ids, INVALID)
    out, _ = sparse_attention_forward(query, rows.flatten(0, 1), indices, sink, scale)
    return out if inverse_rope_freq is None else rope(out, seqlens, inverse_rope_freq, inverse=True)


def paged_decode_attention(query: Tensor, window_rows: PagedRows, seqlens: Tensor, window: int,
                           entries: Optional[PagedRows], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                           scale: float, inverse_rope_freq: Optional[Tensor] = None) -> Tensor:
    """The reference of the `paged_decode_attention` family: `decode_attention` over an FP8 attention-row cache
    (`ops.paged_rows`) → `out [B, H, D]` in the query dtype.

    The new token's row is already in its window ring: `window_rows` has `W` slots, position `q` at slot `q % W`,
    so the slots `i < min(p + 1, W)` hold the window `max(0, p − W + 1) … p`. entries: the compressed entries
    (slot `j` = entry `j`), or None (kind W); entry_ids `[B, K]` as `decode_attention`'s. Rows read back as the
    values their codes stand for (`ops.paged_rows.read_rows`)."""
    check_paged_decode_inputs(query, window_rows, seqlens, window, entries, entry_ids, ratio, sink,
                              inverse_rope_freq)
    batch, device = query.shape[0], query.device
    sequences = torch.arange(batch, device=device).unsqueeze(1)
    slots = torch.arange(window, device=device)
    parts = [read_rows(window_rows, sequences, slots.unsqueeze(0))]
    valid = [slots < (seqlens + 1).clamp(max=window).unsqueeze(1)]
    if entries is not None:
        counts = entry_counts(seqlens, ratio).unsqueeze(1)
        ids = torch.arange(entries.slots, device=device).expand(batch, -1) if entry_ids is None else entry_ids.long()
        parts.append(read_rows(entries, sequences, ids.clamp(0, entries.slots - 1)))
        valid.append((ids >= 0) & (ids < counts))
    return _attend_rows(query, parts, valid, seqlens, sink, scale, inverse_rope_freq)


def check_decode_inputs(query: Tensor, kv_new: Tensor, window_rows: Tensor, seqlens: Tensor, window: int,
                        entries: Optional[Tensor], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                        inverse_rope_freq: Optional[Tensor] = None) -> None:
    """ValueError/TypeError naming the argument when the decode-attention arguments disagree (host checks of
    shapes and dtypes only: no device read)."""
    batch, _, dim = _check_query(query)
    cache_dtype = window_rows.dtype
    if kv_new.shape != (batch, dim):
        raise ValueError(f"decode attention: kv_new must be [B, D] = [{batch}, {dim}], got {tuple(kv_new.shape)}")
    if window_rows.dim() != 3 or window_rows.shape[0] != batch or window_rows.shape[2] != dim:
        raise ValueError(f"decode attention: window_rows must be [B, R, D] = [{batch}, R, {dim}], got "
                         f"{tuple(window_rows.shape)}")
    if kv_new.dtype != cache_dtype or not cache_dtype.is_floating_point:
        raise TypeError(f"decode attention: kv_new ({kv_new.dtype}) and window_rows ({cache_dtype}) must share "
                        f"one floating dtype (the cache's)")
    _check_step(query, seqlens, window, entries is not None, entry_ids, ratio, sink, inverse_rope_freq,
                (kv_new, window_rows, entries))
    if entries is not None and (entries.dim() != 3 or entries.shape[0] != batch or entries.shape[2] != dim):
        raise ValueError(f"decode attention: entries must be [B, C, D] = [{batch}, C, {dim}], got "
                         f"{tuple(entries.shape)}")
    if entries is not None and entries.dtype != cache_dtype:
        raise TypeError(f"decode attention: entries ({entries.dtype}) must share the cache dtype {cache_dtype}")


def check_paged_decode_inputs(query: Tensor, window_rows: PagedRows, seqlens: Tensor, window: int,
                              entries: Optional[PagedRows], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                              inverse_rope_freq: Optional[Tensor] = None) -> None:
    """`check_decode_inputs`' rules for `paged_decode_attention` (host checks only: no device read)."""
    batch, _, dim = _check_query(query)
    if not isinstance(window_rows, PagedRows) or (entries is not None and not isinstance(entries, PagedRows)):
        raise TypeError("paged decode attention: window_rows and entries must be ops.paged_rows.PagedRows")
    if not isinstance(window, int) or window != window_rows.slots:
        raise ValueError(f"paged decode attention: the window ring must have W = {window!r} slots (it holds the new "
                         f"row too), got {window_rows.slots}")
    check_pages(window_rows, "paged decode attention: window_rows")
    if (batch, dim) != (window_rows.batch, window_rows.dim):
        raise ValueError(f"paged decode attention: query must be [B, H, D] = [{window_rows.batch}, H, "
                         f"{window_rows.dim}] (the window's pages), got {tuple(query.shape)}")
    if entries is not None:
        check_pages(entries, "paged decode attention: entries")
        if (entries.batch, entries.dim, entries.rope) != (batch, dim, window_rows.rope):
            raise ValueError(f"paged decode attention: entries must hold B = {batch} pages of rows of D = {dim} and "
                             f"P = {window_rows.rope} (the window's), got B = {entries.batch}, D = {entries.dim}, "
                             f"P = {entries.rope}")
    _check_step(query, seqlens, window, entries is not None, entry_ids, ratio, sink, inverse_rope_freq,
                (window_rows.pages, None if entries is None else entries.pages))


def _check_query(query: Tensor) -> tuple[int, int, int]:
    if not isinstance(query, Tensor) or query.dim() != 3 or not query.is_floating_point():
        raise ValueError(f"decode attention: query must be a floating [B, H, D] tensor, got "
                         f"{tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__}")
    return tuple(query.shape)


def _check_step(query: Tensor, seqlens: Tensor, window: int, has_entries: bool, entry_ids: Optional[Tensor],
                ratio: int, sink: Tensor, inverse_rope_freq: Optional[Tensor], rows: tuple) -> None:
    """The checks both forms share: lengths, window, sink, inverse RoPE, the entries' ids and ratio, one device for
    the query and every tensor of `rows` (the cache's, None where absent)."""
    batch, heads, dim = query.shape
    if seqlens.shape != (batch,) or seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode attention: seqlens must be [B] = [{batch}] int32/int64, got "
                         f"{tuple(seqlens.shape)} {seqlens.dtype}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"decode attention: window must be an int >= 1, got {window!r}")
    if sink.shape != (heads,) or not sink.is_floating_point():
        raise ValueError(f"decode attention: sink must be a floating [H] = [{heads}] tensor, got {tuple(sink.shape)}")
    if inverse_rope_freq is not None and (inverse_rope_freq.dim() != 1 or not inverse_rope_freq.is_floating_point()
                                          or not 0 < 2 * inverse_rope_freq.shape[0] <= dim):
        raise ValueError(f"decode attention: inverse_rope_freq must be a floating [P/2] tensor with 0 < P <= D = "
                         f"{dim}, got {tuple(inverse_rope_freq.shape)} {inverse_rope_freq.dtype}")
    devices = {t.device for t in (query, seqlens, sink, entry_ids, *rows) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"decode attention inputs must share one device, got {sorted(map(str, devices))}")
    if not has_entries:
        if entry_ids is not None:
            raise ValueError("decode attention: entry_ids given without entries")
        return
    if not isinstance(ratio, int) or ratio < 2:
        raise ValueError(f"decode attention: ratio must be an int >= 2 with entries, got {ratio!r}")
    if entry_ids is not None and (entry_ids.dim() != 2 or entry_ids.shape[0] != batch
                                  or entry_ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"decode attention: entry_ids must be [B, K] int32/int64 with B = {batch}, got "
                         f"{tuple(entry_ids.shape)} {entry_ids.dtype}")
