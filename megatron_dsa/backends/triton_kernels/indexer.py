"""Lightning-indexer scores as Triton kernels: a drop-in for `megatron_dsa.ops.indexer.indexer_scores`.

`I(t, c) = Σ_h weights[t,h] · scale · ReLU(<q[t,h], k[cand[t,c]]>)`, −inf where `cand[t,c] < 0`.
The forward and the backward recompute the per-head dots tile by tile in registers, so the
`[T, HI, C]` tensor the formula implies never exists. The autograd Function saves only its inputs.

Backward: one kernel per query row reduces dq and dweights in registers and adds each candidate
block's share of dk to a float32 buffer with atomics (order of additions varies run to run, so dk is
not bitwise deterministic; it agrees with the reference to float32 rounding).

Dtypes: q and k float32, bfloat16 or float16 (the same for both); dots accumulate in float32.
float32 dots follow `torch.backends.cuda.matmul.allow_tf32` as torch's own matmuls do (off by
default: exact float32). float64 is left to the unfused reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.tiles import MIN_DOT, cdiv, dot_precision, pow2
from megatron_dsa.ops.indices import VisibleStructure

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Candidate columns per tile: 64 for 16-bit inputs; float32 tiles take twice the registers, so half the
# columns. The row-by-row kernels (the backward's, and the forward's for scattered ids) run a
# [64 heads, 128 dims] x [128, 64] dot per row.
BLOCK_C = {torch.float32: 32, torch.bfloat16: 64, torch.float16: 64}
# The backward: one warpgroup per row's dots (H100 trials of its loop at S = 4096, top-512 rows: 8 warps
# 0.85 ms, 4 warps 0.51-0.59 ms, 2 warps 0.82 ms; docs/performance.md).
BACKWARD_WARPS = 4
# Slots per step of the KL backward's softmax statistics (one pass over the row before its blocks; each
# step waits for its loads): with steps of 64 slots the KL backward took 0.66 ms at S = 4096, top-512
# (H200), with one step per row 0.60 ms.
KL_STATISTICS_SLOTS = 1024
FORWARD_ROWS = 64  # query rows per forward program: the M side of its per-head dots
# One warpgroup per [64, BLOCK_C] dot. An sm_90 compile of the bf16 forward (HI=64, DI=128, integer
# arguments divisible by 16 as the launches specialise them) uses 234 registers with 4 warps, 176 with 8,
# no spills either way; 4 warps let two programs share a multiprocessor.
FORWARD_WARPS = 4
# Runs of `base + j` ids a forward tile scores with shared keys: two cover a tile that straddles the
# boundary between two sequences; more runs (scattered ids) go row by row.
FORWARD_RUNS = 2
MAX_ROW_BLOCKS = 65535  # the forward grid's second axis: larger calls launch once per slice of rows
MAX_KEY_ROWS = 2**31 - 1  # the forward compares candidate ids as int32


def _tiles(q: Tensor, width: int, num_warps: int) -> dict:
    return dict(BLOCK_H=pow2(q.shape[1], MIN_DOT), BLOCK_D=pow2(q.shape[2], MIN_DOT),
                BLOCK_C=pow2(width, MIN_DOT, BLOCK_C[q.dtype]),
                PRECISION=dot_precision(q.dtype), num_warps=num_warps)


def _forward(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float) -> Tensor:
    from megatron_dsa.backends.triton_kernels import _indexer_kernels as kernels

    rows, width = candidates.shape
    scores = torch.empty((rows, width), dtype=torch.float32, device=q.device)
    if rows == 0 or width == 0:
        return scores
    tiles = _tiles(q, width, FORWARD_WARPS)
    step = MAX_ROW_BLOCKS * FORWARD_ROWS
    for start in range(0, rows, step):
        part = slice(start, min(start + step, rows))
        count = part.stop - part.start
        grid = (cdiv(width, tiles["BLOCK_C"]), cdiv(count, FORWARD_ROWS))  # column blocks first: see the kernel
        launcher(kernels.indexer_forward_kernel)[grid](
            q[part], k, weights[part], candidates[part], scores[part], count, k.shape[0], width, q.shape[1],
            q.shape[2], scale, BLOCK_R=FORWARD_ROWS, MAX_RUNS=FORWARD_RUNS, **tiles)
    return scores


def _backward(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, grad: Tensor, scale: float,
              need_k: bool, kl: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The grads of (q, k, weights) for the scores' gradient `grad [T, C]`; with `kl = (target [T, C],
    row_weights [T])`, `grad` holds the student scores and the scores' gradient is that of
    `Σ_t row_weights[t]·KL_t`, formed in the kernel (all float32, contiguous)."""
    from megatron_dsa.backends.triton_kernels import _indexer_kernels as kernels

    rows, width = candidates.shape
    grad_q, grad_w = torch.empty_like(q), torch.empty_like(weights)
    grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    if rows == 0:
        return grad_q, grad_k.to(k.dtype), grad_w
    target, row_weights = kl if kl is not None else (grad, grad)  # unread without KL
    launcher(kernels.indexer_backward_kernel)[(rows,)](
        q, k, weights, candidates, grad, target, row_weights, grad_q, grad_w, grad_k, width, q.shape[1], q.shape[2],
        scale, BLOCK_S=pow2(width, MIN_DOT, KL_STATISTICS_SLOTS), KEY_GRAD=need_k, KL=kl is not None,
        **_tiles(q, width, BACKWARD_WARPS))
    return grad_q, grad_k.to(k.dtype), grad_w


class TritonIndexerScores(torch.autograd.Function):
    """`(q [T,HI,DI], k [Tc,DI], weights [T,HI], candidates [T,C], scale) → scores [T,C]` float32.

    Inputs arrive contiguous (see `indexer_scores`); only they are saved for backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(q, k, weights, candidates)
        ctx.scale = scale
        return _forward(q, k, weights, candidates, scale)

    @staticmethod
    def backward(ctx, grad_scores: Tensor):
        q, k, weights, candidates = ctx.saved_tensors
        grad_q, grad_k, grad_w = _backward(q, k, weights, candidates, grad_scores.contiguous(), ctx.scale,
                                           need_k=ctx.needs_input_grad[1])
        return grad_q, grad_k, grad_w, None, None


def indexer_scores(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float,
                   visible: Optional[VisibleStructure] = None) -> Tensor:
    """`I(t, c) = Σ_h weights[t,h] · scale · ReLU(<q[t,h], k[c]>)` for each candidate `c` of row `t`.

    q: `[T, HI, DI]`; k: `[Tc, DI]`; weights: `[T, HI]`; candidates: `[T, C]` integer rows of `k`,
    −1 = none; `scale` applied once. Returns `[T, C]` float32, −inf at invalid candidates; gradients
    flow to q, k and weights. Same contract as `megatron_dsa.ops.indexer.indexer_scores` (this kernel
    reads the candidates, so it does not need the `visible` hint).
    """
    _check_inputs(q, k, weights, candidates)
    return TritonIndexerScores.apply(q.contiguous(), k.contiguous(), weights.contiguous(),
                                     candidates.contiguous(), float(scale))


def indexer_kl_backward(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, target: Tensor,
                        student_scores: Tensor, grad_rows: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The `indexer_kl_bwd` op family in one kernel: `(grad_q, grad_k, grad_weights)` of `Σ_t grad_rows[t]·KL_t`
    (the contract of `megatron_dsa.ops.indexer_loss.indexer_kl_backward`). Each block of slots forms its
    share of the KL gradient in registers from `student_scores [T, C]` and `target [T, C]`, so the
    `[T, C]` gradient of the scores never reaches memory."""
    _check_inputs(q, k, weights, candidates)
    if target.shape != candidates.shape or student_scores.shape != candidates.shape:
        raise ValueError(f"indexer KL backward: target {tuple(target.shape)} and student scores "
                         f"{tuple(student_scores.shape)} must match candidates {tuple(candidates.shape)}")
    if grad_rows.shape != candidates.shape[:1]:
        raise ValueError(f"indexer KL backward: grad_rows {tuple(grad_rows.shape)} must be [T] for candidates "
                         f"{tuple(candidates.shape)}")
    devices = {t.device for t in (q, target, student_scores, grad_rows)}
    if len(devices) != 1:
        raise ValueError(f"indexer KL backward inputs must share one device, got {sorted(map(str, devices))}")
    as_float = [t.float().contiguous() for t in (student_scores, target, grad_rows)]
    return _backward(q.contiguous(), k.contiguous(), weights.contiguous(), candidates.contiguous(), as_float[0],
                     float(scale), need_k=True, kl=(as_float[1], as_float[2]))


def _check_inputs(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"indexer expects q [T, HI, DI] and k [Tc, DI], got {tuple(q.shape)}, {tuple(k.shape)}")
    if weights.shape != q.shape[:2] or candidates.dim() != 2 or candidates.shape[0] != q.shape[0]:
        raise ValueError(f"indexer weights {tuple(weights.shape)} / candidates {tuple(candidates.shape)} "
                         f"do not match q {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or not weights.dtype.is_floating_point:
        raise TypeError(f"triton indexer needs q and k of one dtype among {SUPPORTED_DTYPES} and floating "
                        f"weights, got q {q.dtype}, k {k.dtype}, weights {weights.dtype}")
    if candidates.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indexer candidates must be int32 or int64, got {candidates.dtype}")
    if k.shape[0] > MAX_KEY_ROWS:
        raise ValueError(f"triton indexer addresses at most {MAX_KEY_ROWS} key rows (int32 ids), got {k.shape[0]}")
    devices = {t.device for t in (q, k, weights, candidates)}
    if len(devices) != 1:
        raise ValueError(f"indexer inputs must share one device, got {sorted(map(str, devices))}")
    require_triton(q.device, "indexer", "q's device")
