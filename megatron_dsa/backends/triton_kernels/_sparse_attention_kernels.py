"""Triton kernels of sparse attention with a sink (see `sparse_attention.py` for the entry points; math:
docs/math.md §7).

The two kernels are deliberately left undecorated: `triton.jit` picks compiled or interpreted
execution at decoration time, so `sparse_attention.py` decorates them lazily, once per mode. Their
`@triton.jit` helpers are decorated when this module is imported, which happens only on first use (in
the interpreter's child process, after the switch is on).

Layout shared by both kernels (all contiguous): query / out / grad rows `[N, H, D]`, `kv [M, D]`,
`indices [N, K]` int32 or int64, `sink [H]` fp32, `lse [N, H]` fp32. One program handles one query row
and a block of `BLOCK_H` heads; the heads form the M dimension of every `tl.dot` (MQA: they all read the
same gathered kv rows). The head dim is covered by a power-of-two main chunk `[0, BLOCK_D)` plus an
optional power-of-two tail chunk `[BLOCK_D, BLOCK_D + BLOCK_DT)` (`BLOCK_DT = 0`: none), so that
D = 576 costs 512 + 64 columns instead of 1024. Exponentials run in base 2 with `log2(e)` folded in.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Floor of the running maximum, so that a sink of -inf (no sink) never yields inf - inf.
MAX_FLOOR = tl.constexpr(-1.0e30)


def sparse_attention_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    H: tl.constexpr, M, K, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[t, h] = sum_k p_k kv[k] and lse[t, h] (natural log, sink excluded) for one (row, head block).

    H and D are compile-time (they key the autotuning anyway): when the tiles cover them exactly (H = 64,
    D = 512 or 576), the query and kv loads carry no head or dim masks."""
    FULL_TILE: tl.constexpr = (H % BLOCK_H == 0) and (D == BLOCK_D + BLOCK_DT)
    pid = tl.program_id(0)
    head_blocks = (H + BLOCK_H - 1) // BLOCK_H
    row = (pid // head_blocks).to(tl.int64)
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    row_heads = (row * H + heads).to(tl.int64)[:, None] * D  # [BLOCK_H, 1] element offsets

    dm = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if BLOCK_DT > 0:
        dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        acc_t = tl.zeros([BLOCK_H, BLOCK_DT], dtype=tl.float32)

    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * LOG2E
    # The running maximum starts at the sink, which is always part of the denominator.
    m_i = tl.maximum(sink, MAX_FLOOR)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # sum over the keys only (the LSE excludes the sink)

    # The row's query stays in shared memory as the score dot's operand: the [64, 512] fp32 accumulator
    # needs the registers.
    q = row_tile(q_ptr + row_heads, dm, head_ok, D, not FULL_TILE, not FULL_TILE)
    if BLOCK_DT > 0:
        q_t = row_tile(q_ptr + row_heads, dt, head_ok, D, True, True)
    for start in range(0, K, BLOCK_K):
        valid, kv_offsets = index_block(idx_ptr, row, start, K, M, BLOCK_K, WIDE_OFFSETS)
        kv_rows = kv_offsets * D  # [BLOCK_K, 1]
        kv = row_tile(kv_ptr + kv_rows, dm, valid, D, True, not FULL_TILE)
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            kv_t = row_tile(kv_ptr + kv_rows, dt, valid, D, True, True)
            s = tl.dot(q_t, tl.trans(kv_t), s, input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))

        m_i, l_i, p, alpha = online_softmax_step(s, m_i, l_i)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            acc_t = tl.dot(p.to(kv.dtype), kv_t, acc_t * alpha[:, None], input_precision=DOT_PRECISION)

    inv_denominator = 1.0 / (l_i + tl.exp2(sink - m_i))
    tl.store(out_ptr + row_heads + dm[None, :], (acc * inv_denominator[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (dm < D)[None, :])
    if BLOCK_DT > 0:
        tl.store(out_ptr + row_heads + dt[None, :],
                 (acc_t * inv_denominator[:, None]).to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & (dt < D)[None, :])
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + row * H + heads, lse, mask=head_ok)


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key block of the online softmax, base 2: the block's scores `s [BLOCK_H, BLOCK_K]` (−inf where
    masked) against the running maximum `m_i` and sum `l_i` `[BLOCK_H]` → `(m_new, l_new, p, alpha)`: the
    new maximum and sum, the block's weights `p = 2^(s − m_new)` and `alpha = 2^(m_i − m_new)`, the factor
    that rescales the output accumulated so far (`acc·alpha + p @ v`). `m_i` starts at `MAX_FLOOR` or
    above, so a fully masked block leaves everything as it was (`p = 0`, `alpha = 1`), never `-inf + inf`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def index_block(idx_ptr, row, start, K, M, BLOCK_K: tl.constexpr, WIDE_OFFSETS: tl.constexpr):
    """`(valid [BLOCK_K], kv_rows [BLOCK_K, 1])` of the row's indices `[start, start + BLOCK_K)`: ids
    outside `[0, M)` are invalid and point at row 0. The rows stay in the ids' integer type unless
    `WIDE_OFFSETS` (`M * D >= 2^31`): int32 address arithmetic on the gathers is 4% faster (H200)."""
    cols = start + tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + row * K + cols, mask=cols < K, other=-1)
    valid = (idx >= 0) & (idx < M)
    kv_rows = tl.where(valid, idx, 0)
    if WIDE_OFFSETS:
        kv_rows = kv_rows.to(tl.int64)
    return valid, kv_rows[:, None]


@triton.jit
def row_tile(row_ptrs, cols, row_ok, D: tl.constexpr, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """`[R, C]` tile of the rows `row_ptrs [R, 1]` at the columns `cols [C]`, zero where masked: rows by
    `row_ok [R]`, columns past `D`. Loads without a mask where the tiles are known to cover H and D."""
    ptrs = row_ptrs + cols[None, :]
    if MASK_ROWS and MASK_COLS:
        tile = tl.load(ptrs, mask=row_ok[:, None] & (cols < D)[None, :], other=0.0)
    elif MASK_ROWS:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif MASK_COLS:
        tile = tl.load(ptrs, mask=(cols < D)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def row_normaliser(lse_ptr, sink_ptr, dlse_ptr, row, heads, head_ok, H, HAS_DLSE: tl.constexpr):
    """Per head of the row, base 2: `(log_z, p_sink, g, lse)` with `Z = exp(lse) + exp(sink)` the full
    normaliser, `g` the LSE gradient (0 without `HAS_DLSE`) and `lse` made finite (0) on empty rows, which
    have no LSE gradient. Padding heads get `lse = -inf`, `sink = 0`."""
    lse = tl.load(lse_ptr + row * H + heads, mask=head_ok, other=float("-inf")) * LOG2E
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * LOG2E
    top = tl.maximum(tl.maximum(lse, sink), MAX_FLOOR)
    log_z = top + tl.log2(tl.exp2(lse - top) + tl.exp2(sink - top))
    if HAS_DLSE:
        g = tl.load(dlse_ptr + row * H + heads, mask=head_ok, other=0.0)
    else:
        g = tl.zeros_like(lse)
    return log_z, tl.exp2(sink - log_z), g, tl.where(lse > float("-inf"), lse, 0.0)


@triton.jit
def score_grads(q, do, q_t, do_t, kv_ptr, kv_offsets, valid, head_ok, log_z, delta, g, lse, qk_scale,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr, FULL_TILE: tl.constexpr,
                HAS_DLSE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`(p, ds, kv, kv_t)` of one index block: probabilities and score gradients `[BLOCK_H, BLOCK_K]`
    (fp32, 0 on invalid ids and padding heads) and the gathered kv rows `[BLOCK_K, BLOCK_D]` (+ tail),
    from the row's query and output gradient `[BLOCK_H, BLOCK_D]` (+ tails; unused without one)."""
    kv = row_tile(kv_ptr + kv_offsets * D, tl.arange(0, BLOCK_D), valid, D, True, not FULL_TILE)
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
    dp = tl.dot(do, tl.trans(kv), input_precision=DOT_PRECISION)  # <dO, kv[k]>
    kv_t = kv  # placeholder when there is no tail chunk
    if BLOCK_DT > 0:
        kv_t = row_tile(kv_ptr + kv_offsets * D, BLOCK_D + tl.arange(0, BLOCK_DT), valid, D, True, True)
        s = tl.dot(q_t, tl.trans(kv_t), s, input_precision=DOT_PRECISION)
        dp = tl.dot(do_t, tl.trans(kv_t), dp, input_precision=DOT_PRECISION)
    s = tl.where(head_ok[:, None] & valid[None, :], s * qk_scale, float("-inf"))
    p = tl.exp2(s - log_z[:, None])
    ds = p * (dp - delta[:, None])
    if HAS_DLSE:
        ds += g[:, None] * tl.exp2(s - lse[:, None])
    return p, ds, kv, kv_t


def sparse_attention_bwd_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, dout_ptr, dlse_ptr,
    dq_ptr, dkv_ptr, dsink_ptr,
    scale, qk_scale,  # softmax scale, and the same times log2(e)
    H: tl.constexpr, M, K, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_DC: tl.constexpr, HAS_DLSE: tl.constexpr, WIDE_OFFSETS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (row, head block): writes dq, adds the row's kv gradient into the fp32 `dkv [M, D]` scratch with
    atomics, and writes the row's sink terms `-p_sink * delta` into `dsink [N, H]`.

    Per index block: p and dS `[BLOCK_H, BLOCK_K]` from two dots over D, `dq += dS kv` into a
    `[BLOCK_H, D]` fp32 accumulator, and the block's kv gradient `p^T dO + scale dS^T q` (K = V: each row
    is a value and a key) as one stacked dot `BLOCK_DC` columns at a time, so that only a
    `[BLOCK_K, BLOCK_DC]` tile sits beside the dq accumulator. q and dO stay in shared memory throughout.
    With `BLOCK_K >= 64` every dot has an M side of 64 or more, which Hopper runs as warpgroup MMAs; with
    all heads in one program, each kv row is reduced once per query row."""
    FULL_TILE: tl.constexpr = (H % BLOCK_H == 0) and (D == BLOCK_D + BLOCK_DT)
    WHOLE_CHUNKS: tl.constexpr = FULL_TILE and (D % BLOCK_DC == 0)
    pid = tl.program_id(0)
    head_blocks = (H + BLOCK_H - 1) // BLOCK_H
    row = (pid // head_blocks).to(tl.int64)
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    row_heads = (row * H + heads).to(tl.int64)[:, None] * D

    dm = tl.arange(0, BLOCK_D)
    mask_m = head_ok[:, None] & (dm < D)[None, :]
    # The row's q and dO are loaded once, before the loop (they stay in shared memory as dot operands): the
    # atomics in the loop keep the compiler from hoisting loads itself. 7.0 -> 6.2 ms at N = 4096 (H200).
    q = row_tile(q_ptr + row_heads, dm, head_ok, D, not FULL_TILE, not FULL_TILE)
    do = row_tile(dout_ptr + row_heads, dm, head_ok, D, not FULL_TILE, not FULL_TILE)
    # delta = <dO, O> with the stored (rounded) O.
    o = row_tile(out_ptr + row_heads, dm, head_ok, D, not FULL_TILE, not FULL_TILE)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    q_t, do_t = q, do  # placeholders when there is no tail chunk
    if BLOCK_DT > 0:
        dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        mask_t = head_ok[:, None] & (dt < D)[None, :]
        q_t = row_tile(q_ptr + row_heads, dt, head_ok, D, True, True)
        do_t = row_tile(dout_ptr + row_heads, dt, head_ok, D, True, True)
        o_t = row_tile(out_ptr + row_heads, dt, head_ok, D, True, True)
        delta += tl.sum(do_t.to(tl.float32) * o_t.to(tl.float32), 1)
        dq_t = tl.zeros([BLOCK_H, BLOCK_DT], dtype=tl.float32)
    log_z, p_sink, g, lse = row_normaliser(lse_ptr, sink_ptr, dlse_ptr, row, heads, head_ok, H, HAS_DLSE)
    # The kv gradient p^T dO + scale dS^T q is one dot of stacked operands, [p^T | scale dS^T] [dO ; q] with
    # K = 2 BLOCK_H, instead of two dots of K = BLOCK_H: 5.5 -> 4.65 ms at N = 4096 (H200). These are the
    # row pointers of [dO ; q] (`[2 BLOCK_H, 1]`, read a column chunk at a time).
    stacked = tl.arange(0, 2 * BLOCK_H)
    stacked_heads = (pid % head_blocks) * BLOCK_H + stacked % BLOCK_H
    stacked_ok = stacked_heads < H
    stacked_offsets = (row * H + stacked_heads).to(tl.int64)[:, None] * D
    stacked_rows = tl.where((stacked < BLOCK_H)[:, None], dout_ptr + stacked_offsets, q_ptr + stacked_offsets)

    for start in range(0, K, BLOCK_K):
        valid, kv_offsets = index_block(idx_ptr, row, start, K, M, BLOCK_K, WIDE_OFFSETS)
        p, ds, kv, kv_t = score_grads(q, do, q_t, do_t, kv_ptr, kv_offsets, valid, head_ok, log_z, delta, g, lse,
                                      qk_scale, D, BLOCK_D, BLOCK_DT, FULL_TILE, HAS_DLSE, DOT_PRECISION)
        ds_op = ds.to(kv.dtype)
        dq = tl.dot(ds_op, kv, dq, input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            dq_t = tl.dot(ds_op, kv_t, dq_t, input_precision=DOT_PRECISION)
        pairs = tl.join(p.to(kv.dtype), (ds * scale).to(kv.dtype))  # [BLOCK_H, BLOCK_K, 2]
        weights_op = tl.reshape(tl.permute(pairs, (1, 2, 0)), (BLOCK_K, 2 * BLOCK_H))  # [p^T | scale dS^T]
        # A pipelined loop: the next chunks of [dO ; q] load as asynchronous copies while this one computes
        # (6.2 -> 5.5 ms on top of the hoisting; unrolled, every chunk load waited).
        for chunk in tl.range(0, D, BLOCK_DC, num_stages=3):
            d = chunk + tl.arange(0, BLOCK_DC)
            grads_and_queries = row_tile(stacked_rows, d, stacked_ok, D, not WHOLE_CHUNKS, not WHOLE_CHUNKS)
            dkv = tl.dot(weights_op, grads_and_queries, input_precision=DOT_PRECISION)
            # Triton issues these as 4-float vector atomics (`atom.add.v4.f32`); inline-PTX `red.v2.f32` was no faster.
            tl.atomic_add(dkv_ptr + kv_offsets * D + d[None, :], dkv, mask=valid[:, None] & (d < D)[None, :],
                          sem="relaxed")

    tl.store(dq_ptr + row_heads + dm[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=mask_m)
    if BLOCK_DT > 0:
        tl.store(dq_ptr + row_heads + dt[None, :], (dq_t * scale).to(dq_ptr.dtype.element_ty), mask=mask_t)
    tl.store(dsink_ptr + row * H + heads, -p_sink * delta, mask=head_ok)
