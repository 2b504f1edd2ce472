"""Triton kernels of the few-rows FP8 GEMM (contract: `megatron_dsa.ops.fp8_linear.Fp8Gemm`; entry point, launch
shapes and why: `fp8_gemm.py`).

Plain functions: `lazy_jit.jitted` decorates them on first launch.

`few_rows_gemm_kernel` multiplies the codes: `out[m, n] = s_a[m]·s_b[n]·Σ_k qa[m, k]·qb[n, k]` (per group of a
grouped projection: all groups in one launch), b's rows on the MMA's M side (64 output features per program) and
a's few rows on its N side, so that a GEMM of 1–64 rows is an e4m3 MMA with no padded rows of a worth mentioning.
The K range may be split over programs (a GEMM with few output features still fills the GPU): each split leaves
its float32 partial in `partials [SPLITS, M, G·N]` and takes a ticket of its output tile; the split that draws
the last ticket adds the partials in split order (the same sum whichever split came last), scales, stores, and
puts the tile's ticket back to zero for the next call.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel
from megatron_dsa.backends.triton_kernels._tickets import last_to_arrive, load_partial, put_ticket_back

@triton.jit
def _scaled(acc, a_scale_ptr, b_scale_ptr, m, n, g, G, M, N):
    """`acc [BLOCK_N, BLOCK_M]` of group g times b's row scales (down) and a's (across)."""
    a_scale = tl.load(a_scale_ptr + m * G + g, mask=m < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + g * N + n, mask=n < N, other=0.0)
    return acc * b_scale[:, None] * a_scale[None, :]


def few_rows_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, partials_ptr, tickets_ptr, M, N, K, G,
                         K_PER_SPLIT, SPLITS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE_EVERY: tl.constexpr,
                         CHAINED: tl.constexpr):
    """One (group and block of its b rows, block of a's rows, K split) (module docstring). G groups: a `[M, G·K]`
    (group g's columns `[g·K, (g+1)·K)`) and b `[G, N, K]` e4m3 codes, contiguous; scales `[M·G]` (row m, group g
    at `m·G + g`: a's rows rounded per group) and `[G·N]` float32; out `[M, G·N]` contiguous; `partials [SPLITS,
    M, G·N]` float32 (int32 offsets: a split grid has at most `fp8_gemm.MAX_SPLIT_TILES` output tiles).
    `EVEN_K`: K and the split length are whole multiples of `BLOCK_K`, so the loads need no column mask (and
    vectorise). `PRECISE_EVERY`: products a Hopper e4m3 MMA chain may add in its own accumulator before the sum
    moves to a float32 one (that accumulator keeps about 14 bits: unpromoted over K = 4096, outputs were off by
    1% of their size)."""
    wait_for_previous_kernel(CHAINED)
    blocks_n = tl.cdiv(N, BLOCK_N)
    g = tl.program_id(0) // blocks_n
    n = (tl.program_id(0) % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    first = split * K_PER_SPLIT
    last = tl.minimum(first + K_PER_SPLIT, K)
    b_rows = b_ptr + (g * N + n).to(tl.int64)[:, None] * K
    a_rows = a_ptr + m.to(tl.int64)[:, None] * (G * K) + g * K
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for start in range(first, last, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(b_rows + k[None, :], mask=(n < N)[:, None], other=0.0)
            x = tl.load(a_rows + k[None, :], mask=(m < M)[:, None], other=0.0)
        else:
            w = tl.load(b_rows + k[None, :], mask=(n < N)[:, None] & (k < last)[None, :], other=0.0)
            x = tl.load(a_rows + k[None, :], mask=(m < M)[:, None] & (k < last)[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PRECISE_EVERY)

    out_mask = (n < N)[:, None] & (m < M)[None, :]
    out_offsets = m.to(tl.int64)[None, :] * (G * N) + (g * N + n)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + out_offsets, _scaled(acc, a_scale_ptr, b_scale_ptr, m, n, g, G, M, N)
                 .to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        slab = M * G * N
        tl.store(partials_ptr + split * slab + out_offsets, acc, mask=out_mask)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if last_to_arrive(tickets_ptr + tile, SPLITS):
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for other in range(SPLITS):
                total += load_partial(partials_ptr + other * slab + out_offsets, out_mask)
            tl.store(out_ptr + out_offsets, _scaled(total, a_scale_ptr, b_scale_ptr, m, n, g, G, M, N)
                     .to(out_ptr.dtype.element_ty), mask=out_mask)
            put_ticket_back(tickets_ptr + tile)
