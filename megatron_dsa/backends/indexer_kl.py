"""The indexer's KL loss as one autograd Function whose kernels come from the dispatcher.

Forward: the indexer (student) scores of the candidates (`indexer_scores`) and their per-row KL
against the attention's mass (`indexer_loss`, which also returns the teacher target). Backward: the
gradients of the weighted KL sum straight to the indexer's q, k and weights (`indexer_kl_bwd`), so a
backend can fuse the KL gradient into the scores backward (cuDNN's `indexer_backward_wrapper` does).
Only the inputs, the target and the student scores are saved.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from megatron_dsa.backends.registry import AUTO, OpFamily, Requested, dispatch

# (student scores [T, C]) -> (per-row KL [T], teacher target [T, C]): the `indexer_loss` op with its
# teacher inputs bound.
Teacher = Callable[[Tensor], tuple[Tensor, Tensor]]


def kl_call(q: Tensor, candidates: Tensor, dense: bool) -> dict[str, Any]:
    """The call description `indexer_kl_bwd` probes read (shapes only, no device reads)."""
    return dict(device=q.device, dtype=q.dtype, heads=q.shape[1], head_dim=q.shape[2],
                topk=candidates.shape[1], dense=dense)


class IndexerKLFunction(torch.autograd.Function):
    """`(q [T,HI,DI], k [Tc,DI], weights [T,HI], candidates [T,C]) → KL [T]`; gradients flow to q, k and
    weights only (the teacher is built from detached tensors)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, teacher: Teacher,
                scale: float, dense: bool, requested: Requested, student: Optional[Tensor]) -> Tensor:
        if student is None:
            scores = dispatch(OpFamily.INDEXER_SCORES, requested, device=q.device, dtype=q.dtype, heads=q.shape[1],
                              head_dim=q.shape[2], visible=False)
            student = scores(q, k, weights, candidates, scale)
        per_row, target = teacher(student)
        ctx.save_for_backward(q, k, weights, candidates, target, student)
        ctx.scale, ctx.dense, ctx.requested = scale, dense, requested
        return per_row

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        q, k, weights, candidates, target, student = ctx.saved_tensors
        kernel = dispatch(OpFamily.INDEXER_KL_BWD, ctx.requested, **kl_call(q, candidates, ctx.dense))
        grad_q, grad_k, grad_w = kernel(q, k, weights, candidates, target, student,
                                        grad_rows.to(student.dtype).contiguous(), ctx.scale)
        return grad_q, grad_k, grad_w, None, None, None, None, None, None


def indexer_kl_loss(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, teacher: Teacher, scale: float,
                    dense: bool, requested: Requested = AUTO, student: Optional[Tensor] = None) -> Tensor:
    """Per-row KL `[T]` of the indexer against `teacher`: `candidates [T, C]` are rows of the indexer keys
    `k` (−1 = none); `dense` says the candidates are every visible entry (the dense loss), not a
    top-k selection. `requested`: `auto`, a backend name, or the layer config (per-op choice).
    `student`: the candidates' indexer scores when already computed (the selection scored them),
    else they are computed here."""
    return IndexerKLFunction.apply(q, k, weights, candidates, teacher, float(scale), dense, requested,
                                   None if student is None else student.detach())
