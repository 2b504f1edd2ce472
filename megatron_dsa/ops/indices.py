"""Index rows: which KV rows each query token attends (−1 = no entry), spec §3.3 and §4.3.

KV rows live in the flat space `kv_full = [token rows (T) ; compressed rows (capacity)]`, so a
window entry is a token row id and compressed entry `c` is row `T + c`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.ops.layout import CompressedLayout, TokenLayout

INVALID = -1


def window_indices(layout: TokenLayout, window: int) -> Tensor:
    """`[T, W]` token rows `max(seg_start, t−W+1) … t`, then −1 padding (never a future row)."""
    t = torch.arange(layout.num_rows, device=layout.device)
    first = torch.maximum(layout.segment_starts, t - window + 1)
    rows = first.unsqueeze(1) + torch.arange(window, device=layout.device)
    return torch.where(rows <= t.unsqueeze(1), rows, INVALID)


def visible_compressed_indices(layout: CompressedLayout) -> Tensor:
    """`[T, max_entries]` compressed row ids visible to each token, −1 padded.

    Token `t` sees entries `j < floor((pos_t+1)/r)` of its own segment, i.e. those whose last token
    `(j+1)·r − 1 ≤ pos_t` (ratio-causal).
    """
    j = torch.arange(layout.max_entries, device=layout.tokens.device)
    visible = j < layout.visible_counts().unsqueeze(1)
    first = layout.cu_compressed[layout.tokens.segment_ids].unsqueeze(1)
    return torch.where(visible, first + j, INVALID)


def topk_columns(scores: Tensor, valid: Tensor, k: int) -> Tensor:
    """Columns of the top-`k` valid scores per row, −1 where fewer than `k` are valid.

    scores: `[T, C]`; valid: `[T, C]` bool. Returns `[T, min(k, C)]` int64, highest score first;
    ties go to the lower column (stable sort), so the selection is deterministic. Non-differentiable.
    """
    width = min(k, scores.shape[1])
    ranked = torch.where(valid, scores.detach(), float("-inf"))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :width]
    return torch.where(torch.gather(valid, 1, order), order, INVALID)


def gather_valid(table: Tensor, columns: Tensor) -> Tensor:
    """`table[t, columns[t, i]]`, −1 where the column is −1. table: `[T, C]` ids, columns `[T, K]`."""
    if table.shape[1] == 0:
        return torch.full_like(columns, INVALID)
    picked = torch.gather(table, 1, columns.clamp_min(0))
    return torch.where(columns >= 0, picked, INVALID)


def offset_valid(indices: Tensor, offset: int) -> Tensor:
    """Add `offset` to valid ids only: −1 stays −1 (bug class A4.4)."""
    return torch.where(indices >= 0, indices + offset, INVALID)
