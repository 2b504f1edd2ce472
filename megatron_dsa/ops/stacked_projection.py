"""Several bias-free projections of the same token rows as one GEMM.

A W/C/H layer projects its input rows `x [T, d]` through up to seven weights (query and KV latents, two
compressors' kv and gate, the indexer's head weights). Stacking them makes one wide GEMM instead of
seven narrow ones, one autograd node instead of seven, and, in backward, one GEMM for the input
gradient instead of one per projection plus the sums that add them up.

Stacking costs a copy of the weights per call (`torch.cat`: at dsv4-flash dims a C layer's ~34 MB, about
20 µs on an H200, the largest copy of a decode step). Inference keeps the stack instead (`KeptStack`, held by
an inference cache), rebuilt only when a weight changes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from megatron_dsa.device_cache import KeptWhileUnchanged


class StackedProjection(torch.autograd.Function):
    """`(x [T, d], attached, *weights [n_i, d])` → the outputs `x @ W_i^T [T, n_i]`, column slices of one
    `[T, Σ n_i]` GEMM result (row stride `Σ n_i`).

    Only the first `attached` weights pass a gradient to x; the others read x as if detached. Weights
    are saved as they are (parameters: no copy) and stacked again in backward. Backward: the outputs'
    gradients side by side (zeros for an output without one), one GEMM for x's gradient over the
    attached columns and one for all the weight gradients, split back by rows.
    """

    @staticmethod
    def forward(ctx, x: Tensor, attached: int, *weights: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # unused outputs (no indexer loss) get no zero-filled gradient
        ctx.attached = attached
        ctx.save_for_backward(x, *weights)
        sizes = [w.shape[0] for w in weights]
        return (x @ torch.cat(weights).t()).split(sizes, dim=1)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        x, *weights = ctx.saved_tensors
        sizes = [w.shape[0] for w in weights]
        grad = torch.cat([x.new_zeros(x.shape[0], n) if g is None else g for g, n in zip(grads, sizes)], dim=1)
        grad_x = None
        if ctx.needs_input_grad[0] and any(g is not None for g in grads[:ctx.attached]):
            width = sum(sizes[:ctx.attached])
            grad_x = grad[:, :width] @ torch.cat(weights[:ctx.attached])
        grad_weights: list[Optional[Tensor]] = [None] * len(weights)
        wanted = [g is not None and need for g, need in zip(grads, ctx.needs_input_grad[2:])]
        if any(wanted):
            stacked = (grad.t() @ x).split(sizes)
            grad_weights = [w if want else None for w, want in zip(stacked, wanted)]
        return (grad_x, None, *grad_weights)


def stacked_projection(x: Tensor, weights: Sequence[Tensor], attached: int) -> tuple[Tensor, ...]:
    """`x @ W^T` for each `W [n_i, d]` of `weights` (x's dtype and device), computed as one GEMM.

    x: `[T, d]`. The outputs are `[T, n_i]` column slices of one `[T, Σ n_i]` tensor (row stride
    `Σ n_i`, unit column stride). The first `attached` weights' outputs pass their gradient to x, the
    rest's do not (as if they read `x.detach()`); every weight gets its gradient.
    """
    if x.dim() != 2:
        raise ValueError(f"stacked_projection expects x [T, d], got {tuple(x.shape)}")
    if not 0 <= attached <= len(weights):
        raise ValueError(f"stacked_projection attached must be in [0, {len(weights)}], got {attached}")
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise ValueError(f"stacked_projection weight {i} must be [n, {x.shape[1]}], got {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise TypeError(f"stacked_projection weight {i} is {w.dtype}, x is {x.dtype}: cast one of them")
        if w.device != x.device:
            raise ValueError(f"stacked_projection weight {i} is on {w.device}, x on {x.device}")
    return StackedProjection.apply(x, attached, *weights)


class KeptStack(KeptWhileUnchanged[Tensor]):
    """`torch.cat(weights)` kept between calls that need no gradient (inference), stacked again when a weight
    changes (`device_cache.KeptWhileUnchanged`). Holds one copy of the stacked weights' memory."""

    def of(self, weights: Sequence[Tensor]) -> Tensor:
        def stack() -> Tensor:
            with torch.no_grad():
                return torch.cat(list(weights))

        return self.get(weights, stack)


def stacked_weights(weights: Sequence[Tensor], kept: Optional[KeptStack]) -> Optional[Tensor]:
    """`kept`'s stack of `weights` where a product with it needs no gradient (grad mode off, or no weight
    requires one), else None (the caller stacks them in autograd)."""
    if kept is None or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
        return None
    return kept.of(weights)
