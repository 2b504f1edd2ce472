"""Sparse attention backward for Hopper in Gluon, Triton's explicit-layout dialect (math: docs/math.md §7).

Same contract as `_sparse_attention_kernels.sparse_attention_bwd_kernel` (which runs everywhere else), for
blocks of 64 heads, D = 512 and bf16. Gluon states what the Triton kernel can only hope the compiler
finds: which tiles live in shared memory, when each warpgroup MMA is waited for, and where an
asynchronous copy overlaps compute. Per program (one query row, 64 heads):

* `[dO ; q]` is copied once into one shared tile `[128, D]`: its halves are the A operands of the score
  dots, and its column slices the B operands of the kv-gradient dots (the Triton kernel re-reads those
  chunks from global memory);
* per block of 64 indices: the gathered kv rows `[64, D]` arrive by asynchronous copies; `S = q kv^T`
  and `dP = dO kv^T` run as two MMAs in flight together; `dq += dS kv` accumulates in registers;
  `[p ; scale dS]` goes to shared memory, so that the block's kv gradient
  `[p^T | scale dS^T] [dO ; q]` is one MMA per column chunk of 64;
* the next block's gather is issued as soon as the dq MMA has read the current block, so it overlaps
  the kv-gradient chunks; chunk c + 1's MMA runs while chunk c's fp32 atomics issue (vector atomics of
  four, from a blocked layout).

Importing this module imports triton's Gluon; `sparse_attention.py` does so only when it launches the
kernel (never under the CPU interpreter, which cannot run Gluon).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# Gluon names that triton 3.9 changed (same operations): the CTA-wide barrier (`thread_barrier()` until
# 3.6, `barrier()` from 3.9 on) and the asynchronous global-to-shared copy (`async_copy_global_to_shared`,
# now `async_load`, same arguments).
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
async_copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
LOG2E = gl.constexpr(1.4426950408889634)
# Floor of the running maximum, so that a sink of -inf (no sink) never yields inf - inf.
MAX_FLOOR = gl.constexpr(-1.0e30)
BLOCK_H = gl.constexpr(64)  # heads per program: the M side of a warpgroup MMA
BLOCK_K = gl.constexpr(64)  # indices per block
BLOCK_DC = gl.constexpr(64)  # kv-gradient columns per MMA
DELTA_CHUNK = gl.constexpr(128)  # columns per step of delta = <dO, O>


@gluon.jit
def _gather_kv(smem, kv_ptr, idx_ptr, row, start, K, M, D: gl.constexpr, layout: gl.constexpr):
    """Issue the asynchronous copy of kv rows `indices[row, start:start + BLOCK_K]` into `smem [BLOCK_K, D]`;
    ids outside `[0, M)` (and columns past K) are zero-filled without a read (the scores mask them): padding
    redirected to one kv row would hit one L2 slice from every program."""
    valid, ids = _valid_ids(idx_ptr, row, start, K, M, gl.SliceLayout(1, layout))
    rows = gl.where(valid, ids, 0).to(gl.int64)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    async_copy_to_shared(smem, kv_ptr + rows[:, None] * D + cols[None, :], mask=valid[:, None])


@gluon.jit
def _opaque_zero(value):
    """0, computed at run time from the loop-varying `value`. Shared-memory views indexed with it inside a
    loop keep their MMA descriptors there: with constant views the compiler hoists every MMA's descriptor
    out of the loop (64 for a [64, 512] x [512, 64] product alone), and they spill."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [value], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _valid_ids(idx_ptr, row, start, K, M, layout: gl.constexpr):
    """`(valid, ids)` of the row's indices `[start, start + BLOCK_K)` in `layout` (a 1-D slice layout)."""
    ks = start + gl.arange(0, BLOCK_K, layout=layout)
    ids = gl.load(idx_ptr + row * K + ks, mask=ks < K, other=-1)
    return (ids >= 0) & (ids < M), ids


@gluon.jit
def sparse_attention_bwd_hopper_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, dout_ptr, dlse_ptr,
    dq_ptr, dkv_ptr, dsink_ptr,
    scale, qk_scale,  # softmax scale, and the same times log2(e)
    M, K, H: gl.constexpr, D: gl.constexpr, HAS_DLSE: gl.constexpr, num_warps: gl.constexpr,
):
    """One (row, block of 64 heads): writes dq `[N, H, D]`, adds the row's kv gradient into the fp32
    `dkv [M, D]` scratch with atomics, and writes the sink terms `-p_sink * delta` into `dsink [N, H]`.
    Layouts as in the Triton kernel: query / out / grads `[N, H, D]`, `kv [M, D]`, `indices [N, K]`,
    `sink [H]` fp32, `lse [N, H]` fp32 natural log without the sink."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    head_blocks: gl.constexpr = H // BLOCK_H
    pid = gl.program_id(0)
    row = (pid // head_blocks).to(gl.int64)
    first_head = (pid % head_blocks) * BLOCK_H

    warps_n: gl.constexpr = num_warps // 4  # warpgroups, side by side along N
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps_n],
                                                            instr_shape=[16, BLOCK_K // warps_n, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps_n],
                                                         instr_shape=[16, 256 // warps_n, 16])
    chunk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps_n],
                                                            instr_shape=[16, BLOCK_DC // warps_n, 16])
    ds_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    copy_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                                 warps_per_cta=[num_warps, 1], order=[1, 0])
    atomic_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8],
                                                   warps_per_cta=[num_warps, 1], order=[1, 0])
    rows_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D], dtype)
    weights_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, BLOCK_K], dtype)

    # One-deep leading dimensions, indexed inside the loop by a run-time zero (`_opaque_zero`).
    stacked_tiles = gl.allocate_shared_memory(dtype, [1, 2 * BLOCK_H, D], rows_smem)  # [dO ; q]
    kv_tiles = gl.allocate_shared_memory(dtype, [1, BLOCK_K, D], rows_smem)
    weights_tiles = gl.allocate_shared_memory(dtype, [1, 2 * BLOCK_H, BLOCK_K], weights_smem)  # [p ; scale dS]
    stacked = stacked_tiles.index(0)
    kv_block = kv_tiles.index(0)

    stacked_rows = gl.arange(0, 2 * BLOCK_H, layout=gl.SliceLayout(1, copy_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, copy_layout))
    offsets = (row * H + first_head + stacked_rows % BLOCK_H)[:, None] * D + cols[None, :]
    async_copy_to_shared(
        stacked, gl.where((stacked_rows < BLOCK_H)[:, None], dout_ptr + offsets, q_ptr + offsets))
    _gather_kv(kv_block, kv_ptr, idx_ptr, row, 0, K, M, D, copy_layout)
    async_copy.commit_group()

    # delta = <dO, O> with the stored (rounded) O, in column steps to bound the registers.
    heads_c = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, copy_layout))
    step = gl.arange(0, DELTA_CHUNK, layout=gl.SliceLayout(0, copy_layout))
    delta_c = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, copy_layout))
    for c in gl.static_range(0, D, DELTA_CHUNK):
        at = (row * H + first_head + heads_c)[:, None] * D + (c + step)[None, :]
        delta_c += gl.sum(gl.load(dout_ptr + at).to(gl.float32) * gl.load(out_ptr + at).to(gl.float32), 1)
    delta = gl.convert_layout(delta_c, gl.SliceLayout(1, score_layout))

    # The row normaliser Z = exp(lse) + exp(sink), base 2; empty rows (lse = -inf) have no LSE gradient.
    heads = first_head + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, score_layout))
    lse = gl.load(lse_ptr + row * H + heads) * LOG2E
    sink = gl.load(sink_ptr + heads) * LOG2E
    top = gl.maximum(gl.maximum(lse, sink), MAX_FLOOR)
    log_z = top + gl.log2(gl.exp2(lse - top) + gl.exp2(sink - top))
    if HAS_DLSE:
        lse_grad = gl.load(dlse_ptr + row * H + heads)
        finite_lse = gl.where(lse > float("-inf"), lse, 0.0)

    dq = gl.zeros([BLOCK_H, D], gl.float32, layout=dq_layout)
    no_scores = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=score_layout)
    no_chunk = gl.zeros([BLOCK_K, BLOCK_DC], gl.float32, layout=chunk_layout)
    chunk_cols = gl.arange(0, BLOCK_DC, layout=gl.SliceLayout(0, atomic_layout))
    for start in range(0, K, BLOCK_K):
        zero = _opaque_zero(start)
        stacked = stacked_tiles.index(zero)
        kv_block = kv_tiles.index(zero)
        weights = weights_tiles.index(zero)
        weights_op = weights.permute((1, 0))  # [BLOCK_K, 2 BLOCK_H] = [p^T | scale dS^T]
        async_copy.wait_group(0)
        cta_barrier()
        fence_async_shared()
        kv_t = kv_block.permute((1, 0))
        s = warpgroup_mma(stacked.slice(BLOCK_H, BLOCK_H, dim=0), kv_t, no_scores, use_acc=False, is_async=True)
        dp = warpgroup_mma(stacked.slice(0, BLOCK_H, dim=0), kv_t, no_scores, use_acc=False, is_async=True)
        valid, _ = _valid_ids(idx_ptr, row, start, K, M, gl.SliceLayout(0, score_layout))
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        p = gl.exp2(s - log_z[:, None])
        ds = p * (dp - delta[:, None])
        if HAS_DLSE:
            ds += lse_grad[:, None] * gl.exp2(s - finite_lse[:, None])
        weights.slice(0, BLOCK_H, dim=0).store(p.to(dtype))
        weights.slice(BLOCK_H, BLOCK_H, dim=0).store((ds * scale).to(dtype))
        fence_async_shared()
        cta_barrier()
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_operand), kv_block, dq, is_async=True)
        pending = warpgroup_mma(weights_op, stacked.slice(0, BLOCK_DC, dim=1), no_chunk, use_acc=False,
                                is_async=True)
        dq = warpgroup_mma_wait(1, deps=(dq,))
        cta_barrier()  # every warpgroup's dq MMA has read this kv block: the next gather may land
        _gather_kv(kv_block, kv_ptr, idx_ptr, row, start + BLOCK_K, K, M, D, copy_layout)
        async_copy.commit_group()

        kv_valid, kv_ids = _valid_ids(idx_ptr, row, start, K, M, gl.SliceLayout(1, atomic_layout))
        targets = dkv_ptr + gl.where(kv_valid, kv_ids, 0).to(gl.int64)[:, None] * D + chunk_cols[None, :]
        for c in gl.static_range(D // BLOCK_DC):
            if c + 1 < D // BLOCK_DC:
                following = warpgroup_mma(weights_op, stacked.slice((c + 1) * BLOCK_DC, BLOCK_DC, dim=1), no_chunk,
                                          use_acc=False, is_async=True)
                chunk = warpgroup_mma_wait(1, deps=(pending,))
                pending = following
            else:
                chunk = warpgroup_mma_wait(0, deps=(pending,))
            gl.atomic_add(targets + c * BLOCK_DC, gl.convert_layout(chunk, atomic_layout), mask=kv_valid[:, None],
                          sem="relaxed")
        cta_barrier()  # every warp is done with `weights` before the next block rewrites it
    async_copy.wait_group(0)

    dq_heads = first_head + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
    gl.store(dq_ptr + (row * H + dq_heads)[:, None] * D + dq_cols[None, :], (dq * scale).to(dq_ptr.dtype.element_ty))
    gl.store(dsink_ptr + row * H + heads, -gl.exp2(sink - log_z) * delta)
