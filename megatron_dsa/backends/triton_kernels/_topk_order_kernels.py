"""Triton kernel ranking a row's columns by score in registers (see `topk_order.py` for the entry points:
the top-k itself, and the ordering of another kernel's top-k picks).

Plain function: `lazy_jit.jitted` decorates it on first launch. picked `[T, K]` (int32/int64 column ids,
any order, possibly invalid; unread when every column is ranked), ranked `[T, RC]` scores (float32, or
16-bit upcast exactly; −inf at invalid columns), valid `[T, C]` bool, out `[T, OUT]` int64.
"""

import triton
import triton.language as tl

INT64_MIN = tl.constexpr(-9223372036854775808)
LOW_BITS = tl.constexpr(4294967295)
COLUMN_FLIP = tl.constexpr(2147483647)  # 2^31 − 1 − column: higher key for the lower column


def rank_columns_kernel(picked_ptr, ranked_ptr, valid_ptr, out_ptr, K, C, RC, OUT, BLOCK_K: tl.constexpr,
                        EVERY_COLUMN: tl.constexpr):
    """One row (grid: (T,)): its first OUT candidates by (score descending, column ascending), then −1.

    The K candidates are the picks (`picked[t]`) or, with EVERY_COLUMN, the columns 0..C−1 (K = C: the
    top-k itself). Each becomes one int64 key, sorted descending in registers: the score's
    order-preserving int32 image in the high half, the flipped column in the low half; invalid
    candidates (and padding lanes) get the smallest key."""
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    in_row = slots < K
    if EVERY_COLUMN:
        picked = slots.to(tl.int64)
    else:
        picked = tl.load(picked_ptr + row * K + slots, mask=in_row, other=-1).to(tl.int64)
    column = tl.minimum(tl.maximum(picked, 0), C - 1)
    ok = in_row & (picked >= 0) & (picked < C)
    ok = ok & (tl.load(valid_ptr + row * C + column, mask=ok, other=0) != 0)
    score = tl.load(ranked_ptr + row * RC + column, mask=ok, other=0.0).to(tl.float32) + 0.0  # −0.0 → +0.0: ties
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits < 0, bits ^ COLUMN_FLIP, bits)  # signed order of the bits = float order
    key = tl.where(ok, ordered * (LOW_BITS + 1) + (COLUMN_FLIP - column), INT64_MIN)
    key = tl.sort(key, descending=True)
    chosen = COLUMN_FLIP - (key & LOW_BITS)
    tl.store(out_ptr + row * OUT + slots, tl.where(key != INT64_MIN, chosen, -1), mask=slots < OUT)


RADIX_BITS = tl.constexpr(8)
RADIX = tl.constexpr(256)  # bins per pass: 4 passes of 8 bits cover a 32-bit key
SIGN = tl.constexpr(2147483648)  # 2^31: shifts the signed float order into [0, 2^32)


@triton.jit
def score_keys(scores_ptr, valid_ptr, row, cols, C):
    """`(key, ok)` of the columns `cols` of `row`: the score's order-preserving image in `[0, 2^32)` (int64; −0.0
    and +0.0 one key, as the sort ties them) and whether the column is in the row and valid."""
    inside = cols < C
    ok = inside & (tl.load(valid_ptr + row * C + cols, mask=inside, other=0) != 0)
    score = tl.load(scores_ptr + row * C + cols, mask=ok, other=0.0).to(tl.float32) + 0.0
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ COLUMN_FLIP, bits)  # signed order of the bits = float order
    return ordered.to(tl.int64) + SIGN, ok


def select_top_columns_kernel(scores_ptr, valid_ptr, picked_ptr, C, K, BLOCK: tl.constexpr):
    """One row (grid: (T,)): the columns of its K best valid columns by (score descending, column ascending), in
    column order, then −1 where fewer than K are valid. No sort: the K-th best key is found digit by digit.

    Radix select on the 32-bit score key, most significant 8 bits first: each pass counts the valid columns whose
    key starts with the digits found so far, per next digit (one histogram over the row), and keeps the digit
    where the count of larger keys first reaches the `remaining` wanted, taking the larger ones. After four
    passes `threshold` is the K-th best score's key and `remaining` how many of the columns scoring exactly it
    belong to the top K: the lowest ones (the stable sort's tie rule). A last pass writes the columns above the
    threshold and those first `remaining` ties, compacted in column order. A row with at most K valid columns
    takes them all."""
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, RADIX)
    prefix = tl.full([], 0, tl.int64)
    remaining = K
    take_all = False
    for level in tl.static_range(4):
        shift = 24 - level * RADIX_BITS
        counts = tl.zeros([RADIX], tl.int32)
        for start in range(0, C, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            key, ok = score_keys(scores_ptr, valid_ptr, row, cols, C)
            counts += tl.histogram(((key >> shift) & (RADIX - 1)).to(tl.int32), RADIX,
                                   mask=ok & ((key >> (shift + RADIX_BITS)) == prefix))
        if level == 0:
            take_all = tl.sum(counts, axis=0) <= K
        larger = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0)  # keys of a greater digit, per digit
        here = (larger < remaining) & (larger + counts >= remaining)
        prefix = prefix * RADIX + tl.max(tl.where(here, bins, 0), axis=0).to(tl.int64)
        remaining -= tl.sum(tl.where(here, larger, 0), axis=0)
    threshold = tl.where(take_all, -1, prefix)  # below every key: every valid column is above it
    taken = 0
    ties_seen = 0
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        key, ok = score_keys(scores_ptr, valid_ptr, row, cols, C)
        tie = (ok & (key == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        take = (ok & (key > threshold)) | ((tie != 0) & (tie_rank < remaining))
        slot = taken + tl.cumsum(take.to(tl.int32), axis=0) - take.to(tl.int32)
        tl.store(picked_ptr + row * K + slot, cols.to(tl.int64), mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie, axis=0)
    for start in range(0, K, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        tl.store(picked_ptr + row * K + slots, tl.full([BLOCK], -1, tl.int64), mask=(slots >= taken) & (slots < K))
