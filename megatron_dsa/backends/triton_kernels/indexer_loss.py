"""Indexer KL loss (docs/math.md §8) as Triton kernels: the teacher's attention mass and the per-row KL.

`attention_mass` is the heavy part of `megatron_dsa.ops.indexer_loss.teacher_target`: the head-summed
probabilities `Σ_h exp(scale·<q[t,h], kv[c]> − full_lse[t,h])` of each candidate. The caller completes
the head sum over tensor-parallel ranks and L1-normalises in torch. The `[T, H, C]` logits are
reduced over heads in registers and never reach memory. No autograd: the teacher is detached.

`kl_per_row` is a drop-in for `megatron_dsa.ops.indexer_loss.kl_per_row` with autograd to the
student scores. With pred = softmax of the student over the valid columns and P = valid ∧ target > 0:

    KL_t                = Σ_P target·(log target − log pred)
    ∂KL_t/∂s_c (c valid) = Σ_P target_j·(pred_c − [c = j]) = pred_c·Σ_P target − target_c·[c ∈ P]

and 0 at invalid columns (they never enter the softmax). A row without valid columns gives 0 and a
zero gradient; targets of 0 contribute 0 (0·log 0 = 0), so neither value nor gradient is inf/NaN
(bug class A3.1). Forward saves, besides its inputs, three float32 numbers per row (the student's
max, log-normaliser and Σ_P target), so backward is one pass over the columns.

Dtypes: query and kv float32, bfloat16 or float16 (the same for both), dots accumulate in float32
(float32 dots follow `torch.backends.cuda.matmul.allow_tf32`, as in `indexer.py`); full_lse, the
student scores and the target float32. float64 is left to the unfused reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.tiles import MIN_DOT, cdiv, dot_precision, pow2

MASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Mass tiles per input dtype, (BLOCK_C candidate columns, BLOCK_D dims per step, warps, stages): the
# [BLOCK_H, BLOCK_C] float32 logits stay in registers while BLOCK_D dims of q and the gathered kv rows
# stream through. 16-bit: the best of a 54-point sweep on an H200 (H = 64, D = 512, 512 candidates,
# 4096 rows: 0.44 ms, against 0.61 ms for 64 columns on 8 warps). float32 takes twice the registers and
# shared memory per dim, so it keeps the smaller tile.
MASS_TILES = {torch.float32: (64, 32, 8, 3), torch.bfloat16: (128, 64, 4, 2), torch.float16: (128, 64, 4, 2)}
# Columns per KL step: a row of the dense loss (C = T / 4) takes a few steps, one of the sparse loss
# (C = top-k) usually one.
KL_BLOCK_C = 1024
KL_NUM_WARPS = 4


def attention_mass(query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor, scale: float) -> Tensor:
    """`mass[t, c] = Σ_h exp(scale·<query[t,h], kv[candidates[t,c]]> − full_lse[t,h])`.

    query `[T, H, D]`, kv `[M, D]`, candidates `[T, C]` int32/int64 rows of kv (−1 = none; any id
    outside `[0, M)` counts as none, as in the reference), full_lse `[T, H]` float32 (the full
    normaliser: window + sink + candidates). Returns `[T, C]` float32, 0 at invalid candidates, not
    normalised and without autograd history.
    """
    _check_mass_inputs(query, kv, candidates, full_lse)
    from megatron_dsa.backends.triton_kernels import _indexer_loss_kernels as kernels

    query, kv, candidates, full_lse = (t.detach().contiguous() for t in (query, kv, candidates, full_lse))
    rows, width = candidates.shape
    mass = torch.empty((rows, width), dtype=torch.float32, device=query.device)
    if mass.numel() == 0:
        return mass
    heads, dim = query.shape[1], query.shape[2]
    max_c, max_d, warps, stages = MASS_TILES[query.dtype]
    block_c = pow2(width, MIN_DOT, max_c)
    launcher(kernels.attention_mass_kernel)[(rows, cdiv(width, block_c))](
        query, kv, candidates, full_lse, mass, kv.shape[0], width, heads, float(scale),
        DIM=dim, BLOCK_H=pow2(heads, MIN_DOT), BLOCK_D=pow2(dim, MIN_DOT, max_d), BLOCK_C=block_c,
        PRECISION=dot_precision(query.dtype), num_warps=warps, num_stages=stages)
    return mass


def _kl_forward(student: Tensor, target: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(kl, row_max, log_norm, mass)`, each `[T]` float32 (see `kl_forward_kernel`)."""
    from megatron_dsa.backends.triton_kernels import _indexer_loss_kernels as kernels

    rows, width = student.shape
    kl, row_max, log_norm, mass = (torch.zeros(rows, dtype=torch.float32, device=student.device)
                                   for _ in range(4))
    if rows == 0 or width == 0:
        return kl, row_max, log_norm, mass
    launcher(kernels.kl_forward_kernel)[(rows,)](
        student, target, valid, kl, row_max, log_norm, mass, width,
        BLOCK_C=pow2(width, MIN_DOT, KL_BLOCK_C), num_warps=KL_NUM_WARPS)
    return kl, row_max, log_norm, mass


def _kl_backward(student: Tensor, target: Tensor, valid: Tensor, row_max: Tensor, log_norm: Tensor,
                 mass: Tensor, grad_kl: Tensor) -> Tensor:
    """`[T, C]` float32 gradient of `Σ_t grad_kl[t]·KL_t` to the student scores."""
    from megatron_dsa.backends.triton_kernels import _indexer_loss_kernels as kernels

    grad = torch.empty_like(student)
    rows, width = student.shape
    if rows == 0 or width == 0:
        return grad
    launcher(kernels.kl_backward_kernel)[(rows,)](
        student, target, valid, row_max, log_norm, mass, grad_kl, grad, width,
        BLOCK_C=pow2(width, MIN_DOT, KL_BLOCK_C), num_warps=KL_NUM_WARPS)
    return grad


class TritonKLPerRow(torch.autograd.Function):
    """`(student [T,C] f32, target [T,C] f32, valid [T,C] uint8) → KL [T]` f32, gradient to student.

    Inputs arrive contiguous (see `kl_per_row`); they and the per-row statistics are saved."""

    @staticmethod
    def forward(ctx, student: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        kl, row_max, log_norm, mass = _kl_forward(student, target, valid)
        ctx.save_for_backward(student, target, valid, row_max, log_norm, mass)
        return kl

    @staticmethod
    def backward(ctx, grad_kl: Tensor):
        student, target, valid, row_max, log_norm, mass = ctx.saved_tensors
        grad = _kl_backward(student, target, valid, row_max, log_norm, mass, grad_kl.contiguous())
        return grad, None, None


def kl_per_row(student_scores: Tensor, target: Tensor, valid: Tensor) -> Tensor:
    """`[T]` KL(target ‖ softmax(student over valid)); rows without valid candidates give 0.

    student_scores `[T, C]` float32 (gradient flows to it), target `[T, C]` float32 (no gradient),
    valid `[T, C]` bool. Same contract as `megatron_dsa.ops.indexer_loss.kl_per_row`; invalid
    positions never produce inf/NaN in the value or the gradient.
    """
    _check_kl_inputs(student_scores, target, valid)
    # bool -> uint8 is a reinterpreting view (one byte each): no copy, and the kernel loads plain bytes.
    return TritonKLPerRow.apply(student_scores.contiguous(), target.detach().contiguous(),
                                valid.contiguous().view(torch.uint8))


def _check_device(name: str, tensors: tuple[Tensor, ...]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name} inputs must share one device, got {sorted(map(str, devices))}")
    require_triton(tensors[0].device, name, "the inputs' device")


def _check_mass_inputs(query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor) -> None:
    if query.dim() != 3 or kv.dim() != 2 or query.shape[-1] != kv.shape[-1]:
        raise ValueError(f"attention_mass expects query [T, H, D] and kv [M, D], got {tuple(query.shape)}, "
                         f"{tuple(kv.shape)}")
    if candidates.dim() != 2 or candidates.shape[0] != query.shape[0] or full_lse.shape != query.shape[:2]:
        raise ValueError(f"attention_mass candidates {tuple(candidates.shape)} / full_lse {tuple(full_lse.shape)} "
                         f"do not match query {tuple(query.shape)} (expected [T, C] / [T, H])")
    if query.dtype not in MASS_DTYPES or kv.dtype != query.dtype:
        raise TypeError(f"attention_mass needs query and kv of one dtype among {MASS_DTYPES}, got query "
                        f"{query.dtype}, kv {kv.dtype}")
    if full_lse.dtype != torch.float32:
        raise TypeError(f"attention_mass full_lse must be float32, got {full_lse.dtype}")
    if candidates.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"attention_mass candidates must be int32 or int64, got {candidates.dtype}")
    _check_device("attention_mass", (query, kv, candidates, full_lse))


def _check_kl_inputs(student_scores: Tensor, target: Tensor, valid: Tensor) -> None:
    if student_scores.dim() != 2 or target.shape != student_scores.shape or valid.shape != student_scores.shape:
        raise ValueError(f"kl_per_row expects student_scores, target and valid of one shape [T, C], got "
                         f"{tuple(student_scores.shape)}, {tuple(target.shape)}, {tuple(valid.shape)}")
    if student_scores.dtype != torch.float32 or target.dtype != torch.float32:
        raise TypeError(f"kl_per_row needs float32 student_scores and target, got {student_scores.dtype}, "
                        f"{target.dtype}")
    if valid.dtype != torch.bool:
        raise TypeError(f"kl_per_row valid must be bool, got {valid.dtype}")
    _check_device("kl_per_row", (student_scores, target, valid))
