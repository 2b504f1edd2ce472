"""Triton kernel building a top-k selection's rows (see `selection.py` for the entry point).

Plain function: `lazy_jit.jitted` decorates it on first launch.
"""

import triton.language as tl


def selection_rows_kernel(columns_ptr, scores_ptr, table_ptr, group_ptr, window_ptr,
                          entry_scores_ptr, entry_rows_ptr, compressed_ptr, combined_ptr,
                          K, C, TABLE_STRIDE, W, KV_OFFSET, BLOCK: tl.constexpr):
    """One query row (grid: (n,)). columns `[n, K]` int64 (−1 = none), scores `[n, C]`, table
    `[G, TABLE_STRIDE]` int64, group `[n]` int64, window `[n, W]` int64; writes entry_scores `[n, K]` in
    scores' dtype, entry_rows and compressed `[n, K]` and combined `[n, W + K]`, all int64."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    width = W + K
    for start in range(0, W, BLOCK):
        slot = start + lanes
        inside = slot < W
        tl.store(combined_ptr + row * width + slot, tl.load(window_ptr + row * W + slot, mask=inside), mask=inside)
    table_row = table_ptr + tl.load(group_ptr + row) * TABLE_STRIDE
    for start in range(0, K, BLOCK):
        slot = start + lanes
        inside = slot < K
        column = tl.load(columns_ptr + row * K + slot, mask=inside, other=-1)
        picked = inside & (column >= 0)
        score = tl.load(scores_ptr + row * C + column, mask=picked, other=float("-inf"))
        entry = tl.load(table_row + column, mask=picked, other=-1)
        compressed = tl.where(entry >= 0, entry + KV_OFFSET, -1)
        tl.store(entry_scores_ptr + row * K + slot, score, mask=inside)
        tl.store(entry_rows_ptr + row * K + slot, entry, mask=inside)
        tl.store(compressed_ptr + row * K + slot, compressed, mask=inside)
        tl.store(combined_ptr + row * width + W + slot, compressed, mask=inside)
