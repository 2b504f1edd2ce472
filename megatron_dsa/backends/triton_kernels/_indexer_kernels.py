"""Triton kernels of the lightning-indexer scores (see `indexer.py` for the entry point and the math).

Plain functions: `lazy_jit.jitted` decorates them on first launch (the helpers are decorated when this
module is imported, which happens only then). All tensors are contiguous: q `[T, HI, DI]`, k `[Tc, DI]`,
weights `[T, HI]`, candidates / scores / grad `[T, C]`.

Forward tiles: a program owns `BLOCK_R` rows × `BLOCK_C` candidate columns. Where the tile's ids are
`base + j` (the layer's candidates: entry j of the row's sequence) every row reads the same keys, so
the scores are a loop over heads of `[BLOCK_R, DI] @ [DI, BLOCK_C]` dots accumulated in registers; other
tiles go row by row with gathered keys (`[BLOCK_H, BLOCK_C] = q[t] @ keys^T`, summed over heads). The
backward goes row by row like the latter, with dk added by atomics. The `[T, HI, C]` dots never reach
memory; rows or tiles whose candidates are all −1 (the causal future: about half of them) skip the dots.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._indexer_loss_kernels import (NO_MAX, kl_score_grads, softmax_lane_step,
                                                                      softmax_row_normaliser)


@triton.jit
def column_block(k_ptr, row_block, col_block, C, HI, DI, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """The tile (row block, column block): `(first_row, cols, heads, dims, in_width, q_mask, cached, keys)`,
    with no gathered key tile yet (`cached` ids −2, `keys` 0)."""
    first_row = row_block.to(tl.int64) * ROWS
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    q_mask = (heads[:, None] < HI) & (dims[None, :] < DI)
    cached = tl.full([BLOCK_C], -2, tl.int64)
    keys = tl.zeros([BLOCK_C, BLOCK_D], k_ptr.dtype.element_ty)
    return first_row, cols, heads, dims, cols < C, q_mask, cached, keys


@triton.jit
def row_ids(cand_ptr, t, cols, in_width, T, C):
    """`(ids, valid)`: row t's candidate ids in this column block (−1 outside the block or past T)."""
    ids = tl.load(cand_ptr + t * C + cols, mask=in_width & (t < T), other=-1).to(tl.int64)
    return ids, ids >= 0


@triton.jit
def row_query(q_ptr, w_ptr, t, heads, dims, q_mask, HI, DI, scale):
    """`(q [BLOCK_H, BLOCK_D], w [BLOCK_H] float32 · scale)` of row t (0 at padded heads and dims)."""
    q = tl.load(q_ptr + t * HI * DI + heads[:, None] * DI + dims[None, :], mask=q_mask, other=0.0)
    w = tl.load(w_ptr + t * HI + heads, mask=heads < HI, other=0.0).to(tl.float32) * scale
    return q, w


NO_BASE = tl.constexpr(2147483647)  # int32 max: the base of an invalid candidate (ids are < 2^31)


@triton.jit
def shared_key_scores(q_ptr, k_ptr, w_ptr, rows, cols, dims, base, T, Tc, HI, DI, scale, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    """`[BLOCK_R, BLOCK_C]` scores of `rows` against the key rows `base + cols` (one tile of keys for every
    row): a loop over heads, each a `[BLOCK_R, DI] @ [DI, BLOCK_C]` dot of that head's queries of all rows,
    whose ReLU is weighted and accumulated in registers (no reduction across threads). Rows and keys past
    the ends read 0; what an entry outside this run computes is never stored."""
    key_rows = base + cols
    keys = tl.load(k_ptr + key_rows[:, None] * DI + dims[None, :],
                   mask=(key_rows[:, None] >= 0) & (key_rows[:, None] < Tc) & (dims[None, :] < DI), other=0.0)
    q_mask = (rows[:, None] < T) & (dims[None, :] < DI)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for h in range(HI):
        q = tl.load(q_ptr + rows[:, None] * HI * DI + h * DI + dims[None, :], mask=q_mask, other=0.0)
        w = tl.load(w_ptr + rows * HI + h, mask=rows < T, other=0.0).to(tl.float32)
        dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
        acc += tl.maximum(dots, 0.0) * w[:, None]
    return acc * scale


@triton.jit
def gathered_rows(q_ptr, k_ptr, w_ptr, cand_ptr, out_ptr, row_block, col_block, T, C, HI, DI, scale,
                  BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                  PRECISION: tl.constexpr):
    """The tile (row block, column block) row by row, each row with its own gathered keys (any candidate
    ids): per row, one `[HI, DI] @ [DI, BLOCK_C]` dot summed over heads. Consecutive rows with the same ids
    reuse the gathered key tile. Writes the rows' scores itself."""
    first_row, cols, heads, dims, in_width, q_mask, cached, keys = column_block(
        k_ptr, row_block, col_block, C, HI, DI, BLOCK_R, BLOCK_H, BLOCK_D, BLOCK_C)  # `keys` holds ids `cached`
    for r in range(BLOCK_R):
        t = first_row + r
        ids, valid = row_ids(cand_ptr, t, cols, in_width, T, C)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            if tl.max((ids != cached).to(tl.int32), axis=0) > 0:
                keys = tl.load(k_ptr + ids[:, None] * DI + dims[None, :],
                               mask=valid[:, None] & (dims[None, :] < DI), other=0.0)
                cached = ids
            q, w = row_query(q_ptr, w_ptr, t, heads, dims, q_mask, HI, DI, scale)
            dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
            scores = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
            scores = tl.where(valid, scores, float("-inf"))
        else:
            scores = tl.full([BLOCK_C], float("-inf"), tl.float32)
        tl.store(out_ptr + t * C + cols, scores, mask=in_width & (t < T))


def indexer_forward_kernel(q_ptr, k_ptr, w_ptr, cand_ptr, out_ptr, T, Tc, C, HI, DI, scale,
                           BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_C: tl.constexpr, MAX_RUNS: tl.constexpr, PRECISION: tl.constexpr):
    """scores[t, c] = Σ_h w[t,h]·scale·ReLU(<q[t,h], k[cand[t,c]]>), −inf where cand < 0.

    Grid: (cdiv(C, BLOCK_C), cdiv(T, BLOCK_R)): programs launched together share a row block, so its
    queries (re-read once per column block) come from L2 rather than memory.

    The layer's candidates are `base + c` (column c is entry c of the row's sequence), so a tile's valid
    ids share one base `id − c` per sequence it touches. Each such run of ids (up to MAX_RUNS, smallest
    base first) is scored with one shared tile of keys (`shared_key_scores`); a tile with more runs
    (scattered ids, many short sequences) is scored row by row with gathered keys instead. Tiles
    without a valid id (the causal future) only write −inf."""
    row_block, col_block = tl.program_id(1), tl.program_id(0)
    rows = row_block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    dims = tl.arange(0, BLOCK_D)
    tile = (rows[:, None] < T) & (cols[None, :] < C)
    ids = tl.load(cand_ptr + rows[:, None] * C + cols[None, :], mask=tile, other=-1).to(tl.int32)
    base_of = tl.where(ids >= 0, ids - cols[None, :], NO_BASE)
    result = tl.full([BLOCK_R, BLOCK_C], float("-inf"), tl.float32)
    for _ in range(MAX_RUNS):
        base = tl.min(tl.min(base_of, axis=1), axis=0)
        if base != NO_BASE:
            now = base_of == base
            scores = shared_key_scores(q_ptr, k_ptr, w_ptr, rows, cols, dims, base, T, Tc, HI, DI, scale, BLOCK_R,
                                       BLOCK_C, PRECISION)
            result = tl.where(now, scores, result)
            base_of = tl.where(now, NO_BASE, base_of)
    if tl.min(tl.min(base_of, axis=1), axis=0) != NO_BASE:
        gathered_rows(q_ptr, k_ptr, w_ptr, cand_ptr, out_ptr, row_block, col_block, T, C, HI, DI, scale, BLOCK_R,
                      BLOCK_H, BLOCK_D, BLOCK_C, PRECISION)
    else:
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], result, mask=tile)


@triton.jit
def kl_row_statistics(student_ptr, target_ptr, cand_ptr, t, C, BLOCK_S: tl.constexpr):
    """`(row_max, log_norm, mass)` of row t: its student softmax over the valid candidates and the target's
    positive mass, for `kl_score_grads`. BLOCK_S slots per step: a whole row of a top-512 selection at
    once, since each step waits for its loads."""
    lane_max = tl.full([BLOCK_S], NO_MAX, tl.float32)
    lane_sum = tl.zeros([BLOCK_S], tl.float32)
    lane_mass = tl.zeros([BLOCK_S], tl.float32)
    start = 0
    while start < C:
        cols = start + tl.arange(0, BLOCK_S)
        valid = tl.load(cand_ptr + t * C + cols, mask=cols < C, other=-1) >= 0
        s = tl.load(student_ptr + t * C + cols, mask=valid, other=float("-inf")).to(tl.float32)
        target = tl.load(target_ptr + t * C + cols, mask=valid, other=0.0).to(tl.float32)
        lane_max, lane_sum = softmax_lane_step(lane_max, lane_sum, s)
        lane_mass += tl.where(target > 0.0, target, 0.0)
        start += BLOCK_S
    row_max, log_norm = softmax_row_normaliser(lane_max, lane_sum)
    return row_max, log_norm, tl.sum(lane_mass, axis=0)


@triton.jit
def slot_grads(grad_ptr, target_ptr, t, cols, valid, C, row_weight, row_max, log_norm, mass, KL: tl.constexpr):
    """`[BLOCK_C]` float32 gradient of row t's scores at `cols`, 0 at invalid slots: read from `grad_ptr`, or
    with KL formed from the student scores (`grad_ptr`) and the target (`kl_score_grads`, the KL loss's
    own backward, weighted by `row_weight`)."""
    if KL:
        s = tl.load(grad_ptr + t * C + cols, mask=valid, other=0.0).to(tl.float32)
        target = tl.load(target_ptr + t * C + cols, mask=valid, other=0.0).to(tl.float32)
        return kl_score_grads(s, target, valid, row_max, log_norm, mass, row_weight)
    else:
        return tl.load(grad_ptr + t * C + cols, mask=valid, other=0.0).to(tl.float32)


def indexer_backward_kernel(q_ptr, k_ptr, w_ptr, cand_ptr, grad_ptr, target_ptr, row_weight_ptr, dq_ptr, dw_ptr,
                            dk_ptr, C, HI, DI, scale, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, KEY_GRAD: tl.constexpr, KL: tl.constexpr,
                            PRECISION: tl.constexpr):
    """One query row (grid: (T,)): dq[t] and dw[t] reduced in registers over the row's candidate blocks;
    each block's share of dk added to the float32 `dk_ptr` with atomics (with KEY_GRAD).

    With g = the scores' gradient at [t, c] (0 at invalid c; see `slot_grads` for the KL form), the dots
    recomputed and gd[h,c] = g·w[t,h]·scale·[dots[h,c] > 0]:
        dw[t,h] = scale·Σ_c g·ReLU(dots[h,c]),  dq[t,h] = Σ_c gd[h,c]·k[cand],  dk[cand] += Σ_h gd[h,c]·q[t,h].
    dk comes from the same gathered keys and gd as dq: a separate dk pass would gather and recompute
    them again, and its rows select different keys anyway (a top-k selection), so it could not sum
    rows in registers either."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    q_mask = (heads[:, None] < HI) & (dims[None, :] < DI)
    q, w = row_query(q_ptr, w_ptr, t, heads, dims, q_mask, HI, DI, scale)
    if KL:
        row_max, log_norm, mass = kl_row_statistics(grad_ptr, target_ptr, cand_ptr, t, C, BLOCK_S)
        row_weight = tl.load(row_weight_ptr + t).to(tl.float32)
    else:
        row_max, log_norm, mass, row_weight = 0.0, 0.0, 0.0, 1.0
    acc_q = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc_w = tl.zeros([BLOCK_H], tl.float32)
    start = 0
    while start < C:  # not `for ... in range(0, C, ...)`: triton 3.6's interpreter cannot index with a runtime C
        cols = start + tl.arange(0, BLOCK_C)
        ids = tl.load(cand_ptr + t * C + cols, mask=cols < C, other=-1).to(tl.int64)
        valid = ids >= 0
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            key_mask = valid[:, None] & (dims[None, :] < DI)
            keys = tl.load(k_ptr + ids[:, None] * DI + dims[None, :], mask=key_mask, other=0.0)
            g = slot_grads(grad_ptr, target_ptr, t, cols, valid, C, row_weight, row_max, log_norm, mass, KL)
            dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
            acc_w += tl.sum(tl.maximum(dots, 0.0) * g[None, :], axis=1)
            grad_dots = tl.where(dots > 0.0, g[None, :] * w[:, None], 0.0).to(keys.dtype)
            acc_q += tl.dot(grad_dots, keys, input_precision=PRECISION)
            if KEY_GRAD:
                tl.atomic_add(dk_ptr + ids[:, None] * DI + dims[None, :],
                              tl.dot(tl.trans(grad_dots), q, input_precision=PRECISION), mask=key_mask, sem="relaxed")
        start += BLOCK_C
    tl.store(dq_ptr + t * HI * DI + heads[:, None] * DI + dims[None, :],
             acc_q.to(dq_ptr.dtype.element_ty), mask=q_mask)
    tl.store(dw_ptr + t * HI + heads, (acc_w * scale).to(dw_ptr.dtype.element_ty), mask=heads < HI)
