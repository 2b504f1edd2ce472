"""Triton kernels of the top-k (see `topk_order.py` for the entry points): ranking a row's columns by score in
registers (the top-k of narrow rows, and the ordering of another kernel's picks), and the radix select of wide
rows, each row split over several programs.

Plain functions: `lazy_jit.jitted` decorates them on first launch. picked `[T, K]` (int32/int64 column ids,
any order, possibly invalid; unread when every column is ranked), ranked `[T, RC]` scores (float32, or
16-bit upcast exactly; −inf at invalid columns), valid `[T, C]` bool, out `[T, OUT]` int64.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel
from megatron_dsa.backends.triton_kernels._tickets import last_to_arrive, load_partial, put_ticket_back
from megatron_dsa.backends.triton_kernels.topk_order import SELECT_RADIX_BITS

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


RADIX_BITS = tl.constexpr(SELECT_RADIX_BITS)
RADIX = tl.constexpr(1 << SELECT_RADIX_BITS)  # bins per pass
SIGN = tl.constexpr(2147483648)  # 2^31: shifts the signed float order into [0, 2^32)


@triton.jit
def chunk_keys(scores_ptr, valid_ptr, row, cols, C, end, HAS_VALID: tl.constexpr):
    """`(key, ok)` of the columns `cols` of `row`: the score's order-preserving image in `[0, 2^32)` (int64; −0.0
    and +0.0 one key, as the sort ties them), and whether the column lies before `end` and, with `HAS_VALID`, is
    valid in `valid [T, C]` (else the row's valid columns are a prefix, which `end` stops at)."""
    inside = cols < end
    ok = inside
    if HAS_VALID:
        ok = inside & (tl.load(valid_ptr + row * C + cols, mask=inside, other=0) != 0)
    score = tl.load(scores_ptr + row * C + cols, mask=ok, other=0.0).to(tl.float32) + 0.0
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ COLUMN_FLIP, bits)  # signed order of the bits = float order
    return ordered.to(tl.int64) + SIGN, ok


@triton.jit
def chunk_bounds(counts_ptr, row, C, CHUNK, HAS_VALID: tl.constexpr):
    """`(start, end)` of this program's columns: chunk `program_id(1)` of CHUNK columns, ended at the row's count of
    valid columns when they are a prefix (no `valid` mask)."""
    start = tl.program_id(1) * CHUNK
    end = tl.minimum(start + CHUNK, C)
    if not HAS_VALID:
        end = tl.minimum(end, tl.load(counts_ptr + row).to(tl.int32))
    return start, end


def select_digit_kernel(scores_ptr, valid_ptr, counts_ptr, hist_ptr, tickets_ptr, state_ptr, C, K, CHUNK, PROGRAMS,
                        LEVEL: tl.constexpr, BLOCK: tl.constexpr, HAS_VALID: tl.constexpr, CHAINED: tl.constexpr):
    """One (row, chunk) of the radix select's pass LEVEL (grid: (T, PROGRAMS)): the row's K-th best key, digit by
    digit, most significant 8 bits first. Each program counts its valid columns whose key starts with the digits
    found so far (`state[row, 0]`), per next digit, and adds the counts into the row's histogram
    (`hist [T, RADIX]`); the last program of the row to arrive (a ticket) keeps the digit where the count of larger
    keys first reaches the `remaining` wanted (`state[row, 1]`), writes both back and zeroes the histogram and the
    ticket for the next pass or call. A row with at most K valid columns takes them all: prefix −1 from pass 0 on,
    and the later passes skip it."""
    wait_for_previous_kernel(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, RADIX)
    shift = 32 - (LEVEL + 1) * RADIX_BITS
    prefix = tl.full([], 0, tl.int64)
    if LEVEL > 0:
        prefix = tl.load(state_ptr + row * 2)
    if prefix >= 0:
        start, end = chunk_bounds(counts_ptr, row, C, CHUNK, HAS_VALID)
        counts = tl.zeros([RADIX], tl.int32)
        for block in range(start, end, BLOCK):
            cols = block + tl.arange(0, BLOCK)
            key, ok = chunk_keys(scores_ptr, valid_ptr, row, cols, C, end, HAS_VALID)
            match = ok
            if LEVEL > 0:
                match = ok & ((key >> (shift + RADIX_BITS)) == prefix)
            counts += tl.histogram(((key >> shift) & (RADIX - 1)).to(tl.int32), RADIX, mask=match)
        tl.atomic_add(hist_ptr + row * RADIX + bins, counts, mask=counts > 0, sem="relaxed")
        if last_to_arrive(tickets_ptr + row, PROGRAMS):
            counts = load_partial(hist_ptr + row * RADIX + bins, bins < RADIX)
            remaining = tl.full([], K, tl.int64)
            if LEVEL > 0:
                remaining = tl.load(state_ptr + row * 2 + 1)
            total = tl.sum(counts, axis=0)
            larger = total - tl.cumsum(counts, axis=0)  # keys of a greater digit, per digit
            here = (larger < remaining) & (larger + counts >= remaining)
            found = prefix * RADIX + tl.max(tl.where(here, bins, 0), axis=0).to(tl.int64)
            if LEVEL == 0:
                found = tl.where(total <= K, -1, found)
            tl.store(state_ptr + row * 2, found)
            tl.store(state_ptr + row * 2 + 1, remaining - tl.sum(tl.where(here, larger, 0), axis=0).to(tl.int64))
            tl.store(hist_ptr + row * RADIX + bins, tl.zeros([RADIX], tl.int32))
            put_ticket_back(tickets_ptr + row)


def select_count_kernel(scores_ptr, valid_ptr, counts_ptr, state_ptr, part_ptr, C, CHUNK, PROGRAMS,
                        BLOCK: tl.constexpr, HAS_VALID: tl.constexpr, CHAINED: tl.constexpr):
    """One (row, chunk) after the four passes (grid: (T, PROGRAMS)): how many of its valid columns score above the
    threshold (`state[row, 0]`, the K-th best key; −1 when the row takes every valid column) and how many tie with
    it, into `part [T, PROGRAMS, 2]`, for the write's places."""
    wait_for_previous_kernel(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    threshold = tl.load(state_ptr + row * 2)
    start, end = chunk_bounds(counts_ptr, row, C, CHUNK, HAS_VALID)
    above = tl.full([], 0, tl.int32)
    ties = tl.full([], 0, tl.int32)
    for block in range(start, end, BLOCK):
        cols = block + tl.arange(0, BLOCK)
        key, ok = chunk_keys(scores_ptr, valid_ptr, row, cols, C, end, HAS_VALID)
        above += tl.sum((ok & (key > threshold)).to(tl.int32), axis=0)
        ties += tl.sum((ok & (key == threshold)).to(tl.int32), axis=0)
    place = (row * PROGRAMS + tl.program_id(1)) * 2
    tl.store(part_ptr + place, above)
    tl.store(part_ptr + place + 1, ties)


def select_write_kernel(scores_ptr, valid_ptr, counts_ptr, state_ptr, part_ptr, picked_ptr, C, K, CHUNK, PROGRAMS,
                        BLOCK_P: tl.constexpr, BLOCK: tl.constexpr, HAS_VALID: tl.constexpr, CHAINED: tl.constexpr):
    """One (row, chunk) (grid: (T, PROGRAMS)): its columns above the threshold and its ties whose rank among the
    row's ties is below `remaining` (`state[row, 1]`: the lowest tied columns win, the stable sort's rule), written
    in column order after the earlier chunks' (their counts in `part`); the row's last chunk fills the slots no
    column took with −1. `picked [T, K]` int64."""
    wait_for_previous_kernel(CHAINED)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    threshold = tl.load(state_ptr + row * 2)
    remaining = tl.load(state_ptr + row * 2 + 1)
    others = tl.arange(0, BLOCK_P)
    earlier = others < chunk
    places = (row * PROGRAMS + others) * 2
    above_before = tl.sum(tl.load(part_ptr + places, mask=earlier, other=0), axis=0).to(tl.int64)
    ties_seen = tl.sum(tl.load(part_ptr + places + 1, mask=earlier, other=0), axis=0).to(tl.int64)
    taken = above_before + tl.minimum(ties_seen, remaining)
    start, end = chunk_bounds(counts_ptr, row, C, CHUNK, HAS_VALID)
    for block in range(start, end, BLOCK):
        cols = block + tl.arange(0, BLOCK)
        key, ok = chunk_keys(scores_ptr, valid_ptr, row, cols, C, end, HAS_VALID)
        tie = (ok & (key == threshold)).to(tl.int64)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        take = ((ok & (key > threshold)) | ((tie != 0) & (tie_rank < remaining))).to(tl.int64)
        slot = taken + tl.cumsum(take, axis=0) - take
        tl.store(picked_ptr + row * K + slot, cols.to(tl.int64), mask=take != 0)
        taken += tl.sum(take, axis=0)
        ties_seen += tl.sum(tie, axis=0)
    if chunk == PROGRAMS - 1:
        for block in range(0, K, BLOCK):
            slots = block + tl.arange(0, BLOCK)
            tl.store(picked_ptr + row * K + slots, tl.full([BLOCK], -1, tl.int64), mask=(slots >= taken) & (slots < K))
