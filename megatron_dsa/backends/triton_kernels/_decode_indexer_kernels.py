"""Triton kernel of the decode indexer scores (contract: `megatron_dsa.ops.indexer.decode_indexer_scores`; entry
point and launch rules: `decode_indexer.py`).

Left undecorated: `lazy_jit.launcher` decorates it on first use. q `[B, HI, DI]`, keys `[B, C, DI]` (row stride
`DI`, sequence stride `C·DI`), weights `[B, HI]` (rows `W_STRIDE` apart: a column slice of the layer's stacked
projection is read where it lies), counts `[B]`, scores `[B, C]` float32, the others contiguous; with
`KEY_SCALES` the keys are e4m3 and `key_scales [B, C]` float32 holds each key's scale, and the query rows are
rounded to e4m3 too (one scale per head: `FP8_MAX`, `INV_FP8_MAX`, `TINY` as `fp8_quantize`), so that the dot is
an e4m3 MMA reading the keys as they were loaded (converting them to bf16 for a bf16 MMA went through scalar
shared-memory loads: 97 µs against 74 for bf16 keys at B = 32, 32768 keys, H200).
"""

import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel

from megatron_dsa.backends.triton_kernels._fp8_quantize_kernels import e4m3_values, row_scale


def decode_indexer_scores_kernel(q_ptr, k_ptr, key_scales_ptr, w_ptr, counts_ptr, out_ptr, C, HI, DI, W_STRIDE,
                                 COLS_PER_PROGRAM, scale, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_C: tl.constexpr, PRECISION: tl.constexpr, KEYS_MAJOR: tl.constexpr,
                                 KEY_SCALES: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                                 TINY: tl.constexpr, CHAINED: tl.constexpr):
    """One (sequence b, column range): `scores[b, j] = scale · Σ_h w[b,h]·ReLU(<q[b,h], k[b,j]>)` for
    `j < counts[b]`, −inf for the rest of the range.

    The sequence's queries `[HI, DI]` stay in registers; each step reads `BLOCK_C` keys once (the step's only
    memory traffic: the key read sets the kernel's time) and runs one dot whose ReLU is weighted and summed
    over the heads: `[BLOCK_C, DI] @ [DI, HI]` with `KEYS_MAJOR` (the heads lie along each accumulator row, so
    the sum stays inside a warp), else `[HI, DI] @ [DI, BLOCK_C]` (the sum runs across the warps). Columns past
    the count are never read: a loop over the counted blocks (a `for` loop, which Triton software-pipelines: the
    next blocks' keys load during this block's dot), then one that only writes −inf. With e4m3 keys
    (`KEY_SCALES`) each query row is rounded to e4m3 with its own scale `max(amax, TINY) / FP8_MAX` (correctly
    rounded quotient, as `fp8_quantize`) and the dot multiplies the codes; the head's scale joins its weight and
    the key's, positive, multiplies its score after the ReLU and the sum over heads."""
    wait_for_previous_kernel(CHAINED)
    b = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * COLS_PER_PROGRAM
    last = tl.minimum(first + COLS_PER_PROGRAM, C)
    count = tl.minimum(tl.load(counts_ptr + b).to(tl.int32), last)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (b * HI + heads[:, None]) * DI + dims[None, :],
                mask=(heads[:, None] < HI) & (dims[None, :] < DI), other=0.0)
    w = tl.load(w_ptr + b * W_STRIDE + heads, mask=heads < HI, other=0.0).to(tl.float32) * scale
    if KEY_SCALES:  # the query rows as e4m3 codes (as `fp8_quantize`), their scales with the head weights
        rows = q.to(tl.float32)
        q_scale = row_scale(tl.max(tl.abs(rows), axis=1), INV_FP8_MAX, TINY)
        q = e4m3_values(rows, q_scale, FP8_MAX).to(k_ptr.dtype.element_ty)
        w = w * q_scale
    keys_of_b = k_ptr + b * C * DI
    scores_of_b = out_ptr + b * C
    for start in range(first, count, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        counted = cols < count
        keys = tl.load(keys_of_b + cols[:, None] * DI + dims[None, :],
                       mask=counted[:, None] & (dims[None, :] < DI), other=0.0).to(q.dtype)  # e4m3: as loaded
        if KEYS_MAJOR:
            dots = tl.dot(keys, tl.trans(q), input_precision=PRECISION)  # [BLOCK_C, BLOCK_H]
            scores = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
        else:
            dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_H, BLOCK_C]
            scores = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        if KEY_SCALES:
            scores *= tl.load(key_scales_ptr + b * C + cols, mask=counted, other=0.0)
        tl.store(scores_of_b + cols, tl.where(counted, scores, float("-inf")), mask=cols < last)
    uncounted = first + tl.cdiv(tl.maximum(count - first, 0), BLOCK_C) * BLOCK_C
    for start in range(uncounted, last, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        tl.store(scores_of_b + cols, tl.full([BLOCK_C], float("-inf"), tl.float32), mask=cols < last)
