"""Sparse attention forward for Hopper in Gluon, warp-specialised (math: docs/math.md §7).

Same contract as `_sparse_attention_kernels.sparse_attention_fwd_kernel` (which runs everywhere else), for
blocks of 64 heads, D = 512 and bf16. One program per (query row, block of 64 heads), three warpgroups:

* a producer gathers the row's kv rows by asynchronous copies into two kv buffers of 64 indices, each held
  as a left and a right column half `[64, 256]` with its own ready / free barrier, so that a half is
  refilled as soon as its last reader is done;
* consumer 0 scores the even index blocks (buffer 0), consumer 1 the odd ones (buffer 1): each a full
  `[64 heads, 64 keys]` warpgroup MMA over D (the Triton kernel splits every block's scores across its two
  warpgroups, which pays a cross-warpgroup reduction and a trip of P through shared memory per block);
* the output is split by columns: consumer 0 accumulates `O[:, :256]`, consumer 1 `O[:, 256:]`, so each
  block's P meets both halves of V: its own consumer multiplies it from registers, the other reads it
  from shared memory;
* consumer 0 issues the next pair's score MMAs while its last value MMA of a pair runs (its left kv half
  is freed first, so it is usually refilled by then).

The two consumers share one running maximum per head. Per pair of blocks, consumer 0 publishes
`m0 = max(m, rowmax S0)` and multiplies its own half with it; consumer 1 takes `m1 = max(m0, rowmax S1)`,
publishes it, and everything else is scaled to `m1`: consumer 0 rescales its accumulator and its P by
`exp2(m0 - m1)` before it shares P. The running sums stay per consumer (each at the common maximum) and
are added at the end. The maximum starts at the sink, as in the Triton kernel, so that exp2(sink - m)
cannot overflow. Exponentials run in base 2 with log2(e) folded into `qk_scale`.

Importing this module imports triton's Gluon; `sparse_attention.py` does so only when it launches the
kernel (never under the CPU interpreter, which cannot run Gluon).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from megatron_dsa.backends.triton_kernels._sparse_attention_hopper_backward_kernels import (
    BLOCK_H, BLOCK_K, LOG2E, MAX_FLOOR, _opaque_zero, _valid_ids, async_copy_to_shared, cta_barrier)

LN2 = gl.constexpr(0.6931471805599453)
HALF_D = gl.constexpr(256)  # columns per kv / output half
PRODUCER_THREADS = gl.constexpr(4 * 32)  # one warpgroup
PRODUCER_REGISTERS = gl.constexpr(40)
CONSUMER_REGISTERS = gl.constexpr(224)
# Barriers, one per slot of `bars`: kv halves ready / free at 2 * buffer + half, then the query and the
# consumers' hand-offs.
KV_READY = gl.constexpr(0)
KV_FREE = gl.constexpr(4)
Q_READY = gl.constexpr(8)
MAX0_READY = gl.constexpr(9)  # consumer 0 published m0
MAX1_READY = gl.constexpr(10)  # consumer 1 published m1
P0_READY = gl.constexpr(11)  # consumer 0's P is in shared memory
P1_READY = gl.constexpr(12)
SUM0_READY = gl.constexpr(13)  # running sums, at the end
SUM1_READY = gl.constexpr(14)
NUM_BARRIERS = gl.constexpr(15)


# ---------------------------------------------------------------- producer
@gluon.jit
def _kv_rows(idx_ptr, row, block, K, M, D: gl.constexpr, layout: gl.constexpr):
    """`(offsets, valid)` of the kv rows of index block `block`: element offsets `[BLOCK_K]` (0 where
    invalid) and which ids lie in `[0, M)`."""
    valid, ids = _valid_ids(idx_ptr, row, block * BLOCK_K, K, M, layout)
    return gl.where(valid, ids, 0).to(gl.int64) * D, valid


@gluon.jit
def _fill_half(kv_smem, bars, kv_ptr, rows, buffer: gl.constexpr, half: gl.constexpr, phase,
               cols, D: gl.constexpr):
    """Once its readers freed it, gather one column half of a kv buffer; its ready barrier counts the
    producer's threads, each arriving when its own copies have landed. Invalid ids are zero-filled without
    a read (the scores mask them): padding ids would otherwise all hit one kv row, one L2 slice."""
    offsets, valid = rows
    slot: gl.constexpr = 2 * buffer + half
    mbarrier.wait(bars.index(KV_FREE + slot), phase)
    pointers = kv_ptr + offsets[:, None] + (half * HALF_D + cols)[None, :]
    async_copy_to_shared(kv_smem.index(slot), pointers, mask=valid[:, None], eviction_policy="evict_last")
    async_copy.mbarrier_arrive(bars.index(KV_READY + slot), increment_count=False)


@gluon.jit
def _producer(q_smem, kv_smem, bars, q_ptr, kv_ptr, idx_ptr, row, first_head, M, K, H: gl.constexpr,
              D: gl.constexpr):
    # Each thread copies 16-byte pieces of 4 rows, 64 columns apart: 4 row addresses per tile, the column
    # steps are immediates (a thread per 16 rows of a column half would hold 16 addresses and spill).
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HALF_D, layout=gl.SliceLayout(0, layout))
    q_rows = (row * H + first_head + rows).to(gl.int64) * D
    for half in gl.static_range(2):
        pointers = q_ptr + q_rows[:, None] + (half * HALF_D + cols)[None, :]
        async_copy_to_shared(q_smem.index(half), pointers)
    async_copy.mbarrier_arrive(bars.index(Q_READY), increment_count=False)

    for pair in range(gl.cdiv(K, 2 * BLOCK_K)):
        phase = (pair & 1) ^ 1  # a fresh barrier counts as freed: the first waits pass
        even = _kv_rows(idx_ptr, row, 2 * pair, K, M, D, gl.SliceLayout(1, layout))
        odd = _kv_rows(idx_ptr, row, 2 * pair + 1, K, M, D, gl.SliceLayout(1, layout))
        # The order the halves are freed in: consumer 0 frees its left half first, consumer 1 its right.
        _fill_half(kv_smem, bars, kv_ptr, even, 0, 0, phase, cols, D)
        _fill_half(kv_smem, bars, kv_ptr, odd, 1, 1, phase, cols, D)
        _fill_half(kv_smem, bars, kv_ptr, even, 0, 1, phase, cols, D)
        _fill_half(kv_smem, bars, kv_ptr, odd, 1, 0, phase, cols, D)


# ---------------------------------------------------------------- consumers
@gluon.jit
def _signal(bars, which: gl.constexpr):
    """Arrive once for the whole warpgroup, after every thread's shared-memory work before it."""
    cta_barrier()
    mbarrier.arrive(bars.index(which))


@gluon.jit
def _score_half(q_smem, kv_smem, bars, buffer: gl.constexpr, half: gl.constexpr, phase, zero, s,
                use_acc: gl.constexpr):
    """Once its column half of the kv buffer has landed, issue `s (+)= q[:, half] kv[:, half]^T`
    (asynchronous; `zero`: the loop's run-time zero for the views)."""
    mbarrier.wait(bars.index(KV_READY + 2 * buffer + half), phase)
    return warpgroup_mma(q_smem.index(half + zero), kv_smem.index(2 * buffer + half + zero).permute((1, 0)), s,
                         use_acc=use_acc, is_async=True)


@gluon.jit
def _masked(s, idx_ptr, row, block, K, M, qk_scale, layout: gl.constexpr):
    """Scores `[BLOCK_H, BLOCK_K]` of index block `block` scaled to base 2, -inf on invalid ids."""
    valid, _ = _valid_ids(idx_ptr, row, block * BLOCK_K, K, M, gl.SliceLayout(0, layout))
    return gl.where(valid[None, :], s * qk_scale, float("-inf"))


@gluon.jit
def _consumer(which: gl.constexpr, args):
    """Consumer `which` (0 or 1): scores the index blocks of buffer `which` and accumulates output columns
    `[which * 256, which * 256 + 256)`. `args`: the kernel's shared memory, pointers and scalars."""
    q_smem, kv_smem, p_smem, max_smem, sum_smem, bars, idx_ptr, sink_ptr, out_ptr, lse_ptr, qk_scale, row, \
        first_head, M, K, H, D = args
    other: gl.constexpr = 1 - which
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_K, 16])
    out_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HALF_D, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=out_layout, k_width=2)
    heads_layout: gl.constexpr = gl.SliceLayout(1, score_layout)
    out_heads: gl.constexpr = gl.SliceLayout(1, out_layout)
    dtype: gl.constexpr = q_smem.dtype

    heads = first_head + gl.arange(0, BLOCK_H, layout=heads_layout)
    sink = gl.load(sink_ptr + heads) * LOG2E
    m = gl.maximum(sink, MAX_FLOOR)  # the common running maximum
    total = gl.zeros([BLOCK_H], gl.float32, heads_layout)  # this consumer's sum of p, at m
    acc = gl.zeros([BLOCK_H, HALF_D], gl.float32, out_layout)
    no_scores = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, score_layout)
    pairs = gl.cdiv(K, 2 * BLOCK_K)
    mbarrier.wait(bars.index(Q_READY), 0)
    if which == 0:  # later pairs' scores are issued at the end of the pair before (below)
        s = _score_half(q_smem, kv_smem, bars, 0, 0, 0, 0, no_scores, False)
        s = _score_half(q_smem, kv_smem, bars, 0, 1, 0, 0, s, True)
        s = warpgroup_mma_wait(0, deps=(s,))
    for pair in range(pairs):
        phase = pair & 1
        zero = _opaque_zero(pair)
        own_p = p_smem.index(which + zero)
        own_v = kv_smem.index(2 * which + which + zero)  # this buffer's half of this consumer's columns
        other_v = kv_smem.index(2 * other + which + zero)  # the other buffer's half of this consumer's columns
        if which == 1:  # the right half first: the producer fills it first for this consumer
            s = _score_half(q_smem, kv_smem, bars, 1, 1, phase, zero, no_scores, False)
            s = _score_half(q_smem, kv_smem, bars, 1, 0, phase, zero, s, True)
            s = warpgroup_mma_wait(0, deps=(s,))
        s = _masked(s, idx_ptr, row, 2 * pair + which, K, M, qk_scale, score_layout)
        block_max = gl.max(s, 1)
        if which == 0:
            m_new = gl.maximum(m, block_max)
        else:
            mbarrier.wait(bars.index(MAX0_READY), phase)
            m_new = gl.maximum(max_smem.load(heads_layout), block_max)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        total = total * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, out_heads)[:, None]
        max_smem.store(m_new)
        _signal(bars, MAX0_READY + which)

        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_operand), own_v, acc, is_async=True)
        if which == 0:
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _signal(bars, KV_FREE + 0)  # left half of buffer 0: its last reader is done
            # Consumer 1's maximum is the pair's: rescale to it before sharing P.
            mbarrier.wait(bars.index(MAX1_READY), phase)
            m_pair = max_smem.load(heads_layout)
            rescale = gl.exp2(m_new - m_pair)
            own_p.store((p * rescale[:, None]).to(dtype))
            total = total * rescale
            acc = acc * gl.convert_layout(rescale, out_heads)[:, None]
            m = m_pair
        else:
            own_p.store(p.to(dtype))
            m = m_new
        fence_async_shared()
        _signal(bars, P0_READY + which)

        mbarrier.wait(bars.index(P0_READY + other), phase)
        acc = warpgroup_mma(p_smem.index(other + zero), other_v, acc, is_async=True)
        if which == 0:
            if pair + 1 < pairs:
                # The next pair's scores overlap this product: its left half was freed (above) first.
                following = _score_half(q_smem, kv_smem, bars, 0, 0, phase ^ 1, zero, no_scores, False)
                done = warpgroup_mma_wait(1, deps=(acc,))
                _signal(bars, KV_FREE + 2)  # left half of buffer 1
                following = _score_half(q_smem, kv_smem, bars, 0, 1, phase ^ 1, zero, following, True)
                s = warpgroup_mma_wait(0, deps=(following,))
            else:
                done = warpgroup_mma_wait(0, deps=(acc,))
                _signal(bars, KV_FREE + 2)
            acc = done
        else:
            acc = warpgroup_mma_wait(1, deps=(acc,))  # the own-half product (issued first) is done
            _signal(bars, KV_FREE + 3)  # right half of buffer 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _signal(bars, KV_FREE + 1)  # right half of buffer 0

    # Add the two consumers' sums; every MMA is done, so the query's shared memory is free for the output.
    sum_smem.index(which).store(total)
    _signal(bars, SUM0_READY + which)
    mbarrier.wait(bars.index(SUM0_READY + other), 0)
    total += sum_smem.index(other).load(heads_layout)
    inverse = 1.0 / (total + gl.exp2(sink - m))
    out_tile = q_smem.index(which)
    out_tile.store((acc * gl.convert_layout(inverse, out_heads)[:, None]).to(dtype))
    if which == 1:
        lse = gl.where(total > 0, (m + gl.log2(gl.where(total > 0, total, 1.0))) * LN2, float("-inf"))
        gl.store(lse_ptr + row * H + heads, lse)
    cta_barrier()
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, store_layout))
    cols = which * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, store_layout))
    gl.store(out_ptr + (row * H + first_head + rows).to(gl.int64)[:, None] * D + cols[None, :],
             out_tile.load(store_layout))


# ---------------------------------------------------------------- kernel
@gluon.jit
def sparse_attention_fwd_hopper_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr,
                                       qk_scale,  # softmax scale * log2(e)
                                       M, K, H: gl.constexpr, D: gl.constexpr):
    """One (row, block of 64 heads), launched with 4 warps (consumer 0; consumer 1 and the producer are
    4 more each): `out [N, H, D]` and `lse [N, H]` (natural log, sink excluded; -inf and a zero output
    on rows without a valid index). Layouts as in the Triton kernel: `query [N, H, D]`, `kv [M, D]`,
    `indices [N, K]`, `sink [H]` fp32."""
    gl.static_assert(D == 2 * HALF_D, "the Hopper forward is built for D = 512")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    head_blocks: gl.constexpr = H // BLOCK_H
    pid = gl.program_id(0)
    row = (pid // head_blocks).to(gl.int64)
    first_head = (pid % head_blocks) * BLOCK_H

    tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF_D], dtype)
    p_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], dtype)
    vector: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, HALF_D], tile)  # column halves; the output at the end
    kv_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_K, HALF_D], tile)  # [buffer * 2 + half]
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_K], p_tile)
    max_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vector)
    sum_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vector)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
    # The copy barriers count the producer's threads (each arrives when its own copies land); the rest take
    # one arrival per warpgroup.
    for i in gl.static_range(KV_READY, KV_FREE):
        mbarrier.init(bars.index(i), count=PRODUCER_THREADS)
    mbarrier.init(bars.index(Q_READY), count=PRODUCER_THREADS)
    for i in gl.static_range(KV_FREE, Q_READY):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(MAX0_READY, NUM_BARRIERS):
        mbarrier.init(bars.index(i), count=1)

    consumer_args = (q_smem, kv_smem, p_smem, max_smem, sum_smem, bars, idx_ptr, sink_ptr, out_ptr, lse_ptr,
                     qk_scale, row, first_head, M, K, H, D)
    gl.warp_specialize([(_consumer, (0, consumer_args)), (_consumer, (1, consumer_args)),
                        (_producer, (q_smem, kv_smem, bars, q_ptr, kv_ptr, idx_ptr, row, first_head, M, K, H, D))],
                       [4, 4], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])
