"""A top-k selection over packed segments, shared by the selection-rows tests (torch op, Triton kernel)."""

import torch

from megatron_dsa.ops import indices
from megatron_dsa.ops.layout import TokenLayout


def selection_case(rows: slice, topk: int, window: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   seed: int = 0):
    """Segments of 9, 1 and 17 tokens at ratio 4: scores with ties and −inf at invalid columns, the
    reference top-k of the query rows `rows` (so rows with fewer visible entries than `topk` get −1).
    Returns `(columns, scores, entries, window rows, kv_offset)`."""
    cu = torch.tensor([0, 9, 10, 27], device=device)
    layout = TokenLayout.packed(cu, 27, torch.device(device))
    entries = indices.visible_compressed_entries(layout.compressed(4))
    candidates = entries.rows(rows)
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(-2, 3, candidates.shape, generator=gen, device=device).to(dtype)
    scores = torch.where(candidates >= 0, raw, float("-inf"))
    columns = indices.topk_columns(scores, candidates >= 0, topk)
    return columns, scores, entries, indices.window_indices(layout, window)[rows], layout.num_rows
