"""Triton kernel ranking a row's columns by score in registers (see `topk_order.py` for the entry points:
the top-k itself, and the ordering of another kernel's top-k picks).

Plain function: `lazy_jit.jitted` decorates it on first launch. picked `[T, K]` (int32/int64 column ids,
any order, possibly invalid; unread when every column is ranked), ranked `[T, RC]` scores (float32, or
16-bit upcast exactly; −inf at invalid columns), valid `[T, C]` bool, out `[T, OUT]` int64.
"""

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
