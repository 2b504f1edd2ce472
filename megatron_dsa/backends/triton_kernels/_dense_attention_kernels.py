"""Triton kernels of dense attention for head dims past the vendors' (the `M` kind's qk 576 / v 512; see
`dense_attention.py` for the entry points, docs/math.md for the attention itself).

Left undecorated, as in `_sparse_attention_kernels` (which says why); their helpers are shared with it.

Layout: query rows `q [N, H, DQK]`, keys `k [M, G, DQK]`, values `v [M, G, DV]` (row and head strides
given; unit column stride), `out`/`dout [N, H, DV]`, `lse`/`delta [N, H]` float32; query head `h` reads
KV group `h // (H / G)`. `CAUSAL`: rows and keys are the same tokens (`N == M`) and key `j` is visible to
row `i` when `starts[i] <= j <= i` (`starts [N]`: the first row of `i`'s segment); otherwise every key is
visible (an earlier block of the context-parallel ring). Each head dim is a power-of-two main chunk plus an
optional power-of-two tail (`_sparse_attention_kernels`' rule: 576 = 512 + 64). Exponentials in base 2.

The `[BLOCK, 512]` float32 accumulators take half of a program's registers at 8 warps, so every kernel
keeps one: the backward runs as three kernels — the query gradient (which also writes `delta = <dO, O>`),
then the key gradient and the value gradient, each per key block over the query blocks that see it. That
recomputes the scores three times in backward, 1.6× the FLOPs of a fused backward, in exchange for no
atomics and no register spills.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._sparse_attention_kernels import (LN2, LOG2E, MAX_FLOOR,
                                                                           online_softmax_step, row_tile)


@triton.jit
def _rows_of(ptr, rows, head, row_stride, head_stride):
    """`[R, 1]` pointers to the head vectors `ptr[rows, head]`."""
    return ptr + (rows.to(tl.int64) * row_stride + head * head_stride)[:, None]


@triton.jit
def _query_block(N, H: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """`(row_block, head, group, rows [BLOCK_M], row_ok)` of a program of the grid `(row blocks, H)`, whose row
    blocks run last to first: the longest causal blocks start first, and the blocks of one head run together,
    meeting its keys in L2."""
    row_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    return row_block, head, head // (H // G), rows, rows < N


@triton.jit
def _row_starts(starts_ptr, rows, row_ok, CAUSAL: tl.constexpr):
    """The first row of each row's segment (causal); the rows themselves where nothing reads them."""
    if CAUSAL:
        return tl.load(starts_ptr + rows, mask=row_ok, other=0)
    return rows


@triton.jit
def _store_columns(row_ptrs, cols, values, row_ok, D: tl.constexpr):
    """Store `values [R, C]` at the columns `cols [C]` (those below `D`) of the rows `row_ptrs [R, 1]` that are ok,
    in the pointers' dtype."""
    tl.store(row_ptrs + cols[None, :], values.to(row_ptrs.dtype.element_ty), mask=row_ok[:, None] & (cols < D)[None, :])


@triton.jit
def _visible(rows, keys, starts, row_ok, key_ok, CAUSAL: tl.constexpr):
    """`[R, K]` bool: key `keys[k]` is visible to query row `rows[r]`."""
    if CAUSAL:
        return (keys[None, :] <= rows[:, None]) & (keys[None, :] >= starts[:, None]) & row_ok[:, None]
    return row_ok[:, None] & key_ok[None, :]


@triton.jit
def _base2_lse(lse_ptr, rows, head, row_ok, H):
    """Per row, the saved natural-log LSE in base 2; +inf where it is not finite (a row without keys, or one
    isolated as NaN), so that its probabilities come out 0."""
    lse = tl.load(lse_ptr + rows.to(tl.int64) * H + head, mask=row_ok, other=float("inf")) * LOG2E
    return tl.where((lse == lse) & (lse > float("-inf")), lse, float("inf"))


@triton.jit
def _key_range(starts_ptr, row_block, N, M, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`[lo, hi)` of the key blocks the rows of `row_block` may see, `lo` a multiple of `BLOCK_N`."""
    if CAUSAL:
        lo = tl.load(starts_ptr + row_block * BLOCK_M)  # segment starts never decrease along the rows
        hi = tl.minimum(row_block * BLOCK_M + BLOCK_M, N)
    else:
        lo = 0
        hi = M
    return (lo // BLOCK_N) * BLOCK_N, hi


def dense_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, out_ptr, lse_ptr,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
    qk_scale,  # softmax scale * log2(e)
    N, M, H: tl.constexpr, G: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_VT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """`out [N, H, DV]` and natural-log `lse [N, H]` (-inf and a zero output on rows without keys) for one
    (query block, head) of the grid `(row blocks, H)` (`_query_block`)."""
    row_block, head, group, rows, row_ok = _query_block(N, H, G, BLOCK_M)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    q_rows = _rows_of(q_ptr, rows, head, q_row_stride, q_head_stride)
    q = row_tile(q_rows, dk, row_ok, DQK, True, DQK < BLOCK_D)
    if BLOCK_DT > 0:
        q_t = row_tile(q_rows, BLOCK_D + tl.arange(0, BLOCK_DT), row_ok, DQK, True, True)
    starts = _row_starts(starts_ptr, rows, row_ok, CAUSAL)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    if BLOCK_VT > 0:
        acc_t = tl.zeros([BLOCK_M, BLOCK_VT], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], MAX_FLOOR, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    lo, hi = _key_range(starts_ptr, row_block, N, M, CAUSAL, BLOCK_M, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < M
        k_rows = _rows_of(k_ptr, keys, group, k_row_stride, k_head_stride)
        k = row_tile(k_rows, dk, key_ok, DQK, True, DQK < BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            k_t = row_tile(k_rows, BLOCK_D + tl.arange(0, BLOCK_DT), key_ok, DQK, True, True)
            s = tl.dot(q_t, tl.trans(k_t), s, input_precision=DOT_PRECISION)
        s = tl.where(_visible(rows, keys, starts, row_ok, key_ok, CAUSAL), s * qk_scale, float("-inf"))
        m_i, l_i, p, alpha = online_softmax_step(s, m_i, l_i)
        v_rows = _rows_of(v_ptr, keys, group, v_row_stride, v_head_stride)
        v = row_tile(v_rows, dv, key_ok, DV, True, DV < BLOCK_V)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        if BLOCK_VT > 0:
            v_t = row_tile(v_rows, BLOCK_V + tl.arange(0, BLOCK_VT), key_ok, DV, True, True)
            acc_t = tl.dot(p.to(v.dtype), v_t, acc_t * alpha[:, None], input_precision=DOT_PRECISION)

    inverse = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    out_rows = out_ptr + (rows.to(tl.int64) * H + head)[:, None] * DV
    _store_columns(out_rows, dv, acc * inverse[:, None], row_ok, DV)
    if BLOCK_VT > 0:
        _store_columns(out_rows, BLOCK_V + tl.arange(0, BLOCK_VT), acc_t * inverse[:, None], row_ok, DV)
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + rows.to(tl.int64) * H + head, lse, mask=row_ok)


def dense_attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, out_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
    o_row_stride, o_head_stride, do_row_stride, do_head_stride,
    scale, qk_scale,  # softmax scale, and the same times log2(e)
    N, M, H: tl.constexpr, G: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_VT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """`dq [N, H, DQK]` for one (query block, head), and `delta [N, H] = <dO, O>` (float32) for the key and
    value kernels. Probabilities `exp(s - lse)` from the given LSE (the merged one, for a ring block). Grid as
    the forward's."""
    row_block, head, group, rows, row_ok = _query_block(N, H, G, BLOCK_M)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    q_rows = _rows_of(q_ptr, rows, head, q_row_stride, q_head_stride)
    do_rows = _rows_of(dout_ptr, rows, head, do_row_stride, do_head_stride)
    o_rows = _rows_of(out_ptr, rows, head, o_row_stride, o_head_stride)
    q = row_tile(q_rows, dk, row_ok, DQK, True, DQK < BLOCK_D)
    do = row_tile(do_rows, dv, row_ok, DV, True, DV < BLOCK_V)
    delta = tl.sum(do.to(tl.float32) * row_tile(o_rows, dv, row_ok, DV, True, DV < BLOCK_V).to(tl.float32), 1)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    q_t, do_t = q, do  # placeholders without tails
    if BLOCK_DT > 0:
        q_t = row_tile(q_rows, BLOCK_D + tl.arange(0, BLOCK_DT), row_ok, DQK, True, True)
        dq_t = tl.zeros([BLOCK_M, BLOCK_DT], dtype=tl.float32)
    if BLOCK_VT > 0:
        dv_t = BLOCK_V + tl.arange(0, BLOCK_VT)
        do_t = row_tile(do_rows, dv_t, row_ok, DV, True, True)
        delta += tl.sum(do_t.to(tl.float32) * row_tile(o_rows, dv_t, row_ok, DV, True, True).to(tl.float32), 1)
    do = do.to(q.dtype)
    do_t = do_t.to(q.dtype)
    tl.store(delta_ptr + rows.to(tl.int64) * H + head, delta, mask=row_ok)
    lse = _base2_lse(lse_ptr, rows, head, row_ok, H)
    starts = _row_starts(starts_ptr, rows, row_ok, CAUSAL)

    lo, hi = _key_range(starts_ptr, row_block, N, M, CAUSAL, BLOCK_M, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < M
        k_rows = _rows_of(k_ptr, keys, group, k_row_stride, k_head_stride)
        v_rows = _rows_of(v_ptr, keys, group, v_row_stride, v_head_stride)
        k = row_tile(k_rows, dk, key_ok, DQK, True, DQK < BLOCK_D)
        v = row_tile(v_rows, dv, key_ok, DV, True, DV < BLOCK_V)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            k_t = row_tile(k_rows, BLOCK_D + tl.arange(0, BLOCK_DT), key_ok, DQK, True, True)
            s = tl.dot(q_t, tl.trans(k_t), s, input_precision=DOT_PRECISION)
        if BLOCK_VT > 0:
            v_t = row_tile(v_rows, BLOCK_V + tl.arange(0, BLOCK_VT), key_ok, DV, True, True)
            dp = tl.dot(do_t, tl.trans(v_t), dp, input_precision=DOT_PRECISION)
        s = tl.where(_visible(rows, keys, starts, row_ok, key_ok, CAUSAL), s * qk_scale, float("-inf"))
        ds = (tl.exp2(s - lse[:, None]) * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            dq_t = tl.dot(ds, k_t, dq_t, input_precision=DOT_PRECISION)

    dq_rows = dq_ptr + (rows.to(tl.int64) * H + head)[:, None] * DQK
    _store_columns(dq_rows, dk, dq * scale, row_ok, DQK)
    if BLOCK_DT > 0:
        _store_columns(dq_rows, BLOCK_D + tl.arange(0, BLOCK_DT), dq_t * scale, row_ok, DQK)


def dense_attention_bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr, dout_ptr, lse_ptr, delta_ptr, grad_ptr,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
    do_row_stride, do_head_stride,
    scale, qk_scale,
    N, M, H: tl.constexpr, G: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr,
    KEY_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_VT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (key block, KV group): `KEY_GRAD` the key gradient `dk [M, G, DQK] = scale Σ dSᵀ q`, else the value
    gradient `dv [M, G, DV] = Σ Pᵀ dO`, summed over the group's heads and the query blocks that see the keys
    (causal: from the block's first key to the end of its last key's segment, `ends [M]`). Works transposed:
    the key rows are the M side of every dot. Grid `(key blocks, G)`, first to last: the first keys have the
    most causal rows."""
    key_block = tl.program_id(0)
    group = tl.program_id(1)
    keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < M
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_V)
    k_rows = _rows_of(k_ptr, keys, group, k_row_stride, k_head_stride)
    k = row_tile(k_rows, dk, key_ok, DQK, True, DQK < BLOCK_D)
    k_t = k  # placeholder without a tail
    if BLOCK_DT > 0:
        k_t = row_tile(k_rows, BLOCK_D + tl.arange(0, BLOCK_DT), key_ok, DQK, True, True)
    if KEY_GRAD:
        v_rows = _rows_of(v_ptr, keys, group, v_row_stride, v_head_stride)
        v = row_tile(v_rows, dv, key_ok, DV, True, DV < BLOCK_V)
        v_t = v
        if BLOCK_VT > 0:
            v_t = row_tile(v_rows, BLOCK_V + tl.arange(0, BLOCK_VT), key_ok, DV, True, True)
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        if BLOCK_DT > 0:
            acc_t = tl.zeros([BLOCK_N, BLOCK_DT], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        if BLOCK_VT > 0:
            acc_t = tl.zeros([BLOCK_N, BLOCK_VT], dtype=tl.float32)

    if CAUSAL:
        lo = ((key_block * BLOCK_N) // BLOCK_M) * BLOCK_M
        hi = tl.load(ends_ptr + tl.minimum(key_block * BLOCK_N + BLOCK_N, M) - 1)
    else:
        lo = 0
        hi = N
    for head in range(group * (H // G), (group + 1) * (H // G)):
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < N
            q_rows = _rows_of(q_ptr, rows, head, q_row_stride, q_head_stride)
            do_rows = _rows_of(dout_ptr, rows, head, do_row_stride, do_head_stride)
            q = row_tile(q_rows, dk, row_ok, DQK, True, DQK < BLOCK_D)
            s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [keys, rows]
            if BLOCK_DT > 0:
                q_t = row_tile(q_rows, BLOCK_D + tl.arange(0, BLOCK_DT), row_ok, DQK, True, True)
                s = tl.dot(k_t, tl.trans(q_t), s, input_precision=DOT_PRECISION)
            visible = tl.trans(_visible(rows, keys, _row_starts(starts_ptr, rows, row_ok, CAUSAL), row_ok, key_ok,
                                        CAUSAL))
            lse = _base2_lse(lse_ptr, rows, head, row_ok, H)
            p = tl.exp2(tl.where(visible, s * qk_scale, float("-inf")) - lse[None, :])
            do = row_tile(do_rows, dv, row_ok, DV, True, DV < BLOCK_V).to(k.dtype)
            if KEY_GRAD:
                dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
                if BLOCK_VT > 0:
                    do_t = row_tile(do_rows, BLOCK_V + tl.arange(0, BLOCK_VT), row_ok, DV, True, True).to(k.dtype)
                    dp = tl.dot(v_t, tl.trans(do_t), dp, input_precision=DOT_PRECISION)
                delta = tl.load(delta_ptr + rows.to(tl.int64) * H + head, mask=row_ok, other=0.0)
                ds = (p * (dp - delta[None, :])).to(k.dtype)
                acc = tl.dot(ds, q, acc, input_precision=DOT_PRECISION)
                if BLOCK_DT > 0:
                    acc_t = tl.dot(ds, q_t, acc_t, input_precision=DOT_PRECISION)
            else:
                p = p.to(k.dtype)
                acc = tl.dot(p, do, acc, input_precision=DOT_PRECISION)
                if BLOCK_VT > 0:
                    do_t = row_tile(do_rows, BLOCK_V + tl.arange(0, BLOCK_VT), row_ok, DV, True, True).to(k.dtype)
                    acc_t = tl.dot(p, do_t, acc_t, input_precision=DOT_PRECISION)

    if KEY_GRAD:
        grad_rows = grad_ptr + (keys.to(tl.int64) * G + group)[:, None] * DQK
        _store_columns(grad_rows, dk, acc * scale, key_ok, DQK)
        if BLOCK_DT > 0:
            _store_columns(grad_rows, BLOCK_D + tl.arange(0, BLOCK_DT), acc_t * scale, key_ok, DQK)
    else:
        grad_rows = grad_ptr + (keys.to(tl.int64) * G + group)[:, None] * DV
        _store_columns(grad_rows, dv, acc, key_ok, DV)
        if BLOCK_VT > 0:
            _store_columns(grad_rows, BLOCK_V + tl.arange(0, BLOCK_VT), acc_t, key_ok, DV)
