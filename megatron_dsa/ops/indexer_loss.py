"""Indexer KL loss (docs/math.md §8): the indexer (student) learns the main attention's mass (teacher).

For query row `t` with candidate set `C_t` (selected top-k for the sparse loss, all visible compressed
entries for the dense loss):

    LSE_h(t)  = log(exp(sink_h) + Σ_{k∈window(t)} exp(a_h(k)) + Σ_{j∈C_t} exp(a_h(j)))   (full denominator)
    target(j) = Σ_h exp(a_h(j) − LSE_h(t)), then L1-normalised over C_t
    pred      = softmax over C_t of the indexer scores
    KL_t      = Σ_{j∈C_t} target_j · (log target_j − log pred_j)        (0·log 0 = 0)

The teacher is built from detached tensors; only the student scores carry gradient.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_dsa.ops.indexer import indexer_scores_backward
from megatron_dsa.ops.sparse_attention import _chunk_scores, _rows_per_chunk
from megatron_dsa.parallel.mappings import all_reduce_no_grad

TINY = torch.finfo(torch.float32).tiny  # L1 normaliser floor: tiny positive masses still sum to 1


def attention_mass(query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor, scale: float) -> Tensor:
    """`Σ_h exp(scale·<q[t,h], kv[c]> − full_lse[t,h])` for each candidate `c` of row `t`, no autograd.

    query `[T, H, D]`, kv `[M, D]` (the attention's `kv_full`), candidates `[T, C]` rows of `kv`
    (−1 = none), full_lse `[T, H]` the full normaliser (window + sink + candidates).
    Returns `[T, C]` (compute dtype), 0 at invalid candidates; computed in row chunks.
    """
    with torch.no_grad():
        step = _rows_per_chunk(candidates.shape[1], query.shape[1], query.shape[2])
        parts = []
        for start in range(0, query.shape[0], step):
            chunk = slice(start, start + step)
            _, _, logits = _chunk_scores(query[chunk].detach(), kv.detach(), candidates[chunk], scale)
            parts.append(torch.exp(logits - full_lse[chunk].unsqueeze(-1)).sum(1))
        return torch.cat(parts) if parts else full_lse.new_zeros(candidates.shape)


def normalise_target(mass: Tensor, tp_group: Optional[ProcessGroup] = None) -> Tensor:
    """L1-normalised teacher `[T, C]` from this rank's head-summed mass. With heads split over
    `tp_group` the head sum is completed by an all-reduce first (bug class A7.2)."""
    mass = all_reduce_no_grad(mass, tp_group)
    return mass / mass.sum(-1, keepdim=True).clamp_min(TINY)


def teacher_target(query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor, scale: float,
                   tp_group: Optional[ProcessGroup] = None) -> Tensor:
    """Head-summed attention probabilities of the candidates, L1-normalised per row (`attention_mass`
    for the shapes). Returns `[T, C]`, 0 at invalid candidates, rows sum to 1 (or 0 if empty)."""
    return normalise_target(attention_mass(query, kv, candidates, full_lse, scale), tp_group)


def kl_per_row(student_scores: Tensor, target: Tensor, valid: Tensor) -> Tensor:
    """`[T]` KL(target ‖ softmax(student over valid)); rows without valid candidates give 0.

    Invalid positions never produce inf/NaN in the value or the gradient (bug class A3.1).
    """
    floor = torch.finfo(student_scores.dtype).min
    log_pred = torch.log_softmax(torch.where(valid, student_scores, floor), dim=-1)
    positive = valid & (target > 0)
    safe_target = torch.where(positive, target, torch.ones_like(target))
    terms = torch.where(positive, target * (torch.log(safe_target) - log_pred), 0.0)
    return terms.sum(-1)


def kl_gradient(student_scores: Tensor, target: Tensor, valid: Tensor, grad_rows: Tensor) -> Tensor:
    """`∂(Σ_t grad_rows[t]·KL_t)/∂student [T, C]` of `kl_per_row`, in closed form:
    `grad_rows[t]·(pred·Σ_P target − target·[P])` over the valid candidates (P: valid with target > 0),
    0 at invalid ones and in rows without valid candidates."""
    floor = torch.finfo(student_scores.dtype).min
    pred = torch.softmax(torch.where(valid, student_scores, floor), dim=-1)
    mass = torch.where(valid & (target > 0), target, 0.0)
    grad = pred * mass.sum(-1, keepdim=True) - mass
    return torch.where(valid, grad, 0.0) * grad_rows.unsqueeze(-1)


def reduce_indexer_loss(per_row: Tensor, coeff: float, per_token: bool,
                        num_rows: Union[int, Tensor]) -> Tensor:
    """`coeff · Σ KL_t` (per-token mode, finalised later by the global token count) or
    `coeff · Σ KL_t / num_rows` (mean over all real query rows, rows without candidates count as 0).
    `num_rows` may be a device tensor (a count of real rows) so no host sync is needed."""
    total = per_row.sum()
    if per_token:
        return coeff * total
    divisor = num_rows.clamp_min(1) if isinstance(num_rows, Tensor) else max(num_rows, 1)
    return coeff * total / divisor


MassFn = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]
KLFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def indexer_kl(student_scores: Tensor, query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor,
               scale: float, tp_group: Optional[ProcessGroup] = None, *, mass: MassFn = attention_mass,
               kl: KLFn = kl_per_row, return_target: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Per-row KL `[T]` between the attention's mass over `candidates [T, C]` (the teacher) and the
    softmax of `student_scores [T, C]` over the valid candidates: the `indexer_loss` op family.
    With `return_target`, `(KL [T], teacher target [T, C])` (what a fused backward needs).

    `mass` and `kl` are the two kernels; fused backends pass theirs, the composition stays here.
    """
    target = normalise_target(mass(query, kv, candidates, full_lse, scale), tp_group).to(student_scores.dtype)
    per_row = kl(student_scores, target, candidates >= 0)
    return (per_row, target) if return_target else per_row


def indexer_kl_backward(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, target: Tensor,
                        student_scores: Tensor, grad_rows: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The `indexer_kl_bwd` op family: `(grad_q, grad_k, grad_weights)` of `Σ_t grad_rows[t]·KL_t`, where
    `KL_t` compares `target [T, C]` with the softmax of the indexer scores `student_scores [T, C]` of
    `(q [T, HI, DI], k [Tc, DI], weights [T, HI], candidates [T, C], scale)` (see `indexer_scores`).

    The reference composition: the closed-form KL gradient of the scores, then the scores' backward.
    Fused backends (cuDNN, Triton) form that gradient inside their scores-backward kernel."""
    grad_scores = kl_gradient(student_scores, target.to(student_scores.dtype), candidates >= 0, grad_rows)
    return indexer_scores_backward(q, k, weights, candidates, grad_scores, scale)
