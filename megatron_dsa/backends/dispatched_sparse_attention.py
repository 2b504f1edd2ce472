"""Differentiable sparse attention whose forward and backward kernels come from the dispatcher.

The forward backend is resolved when the forward runs; the backward backend when the backward runs,
with `lse_grad` in its call description saying whether a gradient flows through the returned LSE
(fused backward kernels without an lse-gradient input decline then). Both calls are counted, so the
pair may come from different backends (FlashMLA forward + cuDNN backward is the Hopper recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends import library
from megatron_dsa.backends.library import sparse_call
from megatron_dsa.backends.registry import AUTO, OpFamily, Requested, dispatch
from megatron_dsa.ops.sparse_attention import check_sparse_inputs
from megatron_dsa.ops.sparse_attention import sparse_attention as _sparse_attention

__all__ = ["DispatchedSparseKernels", "sparse_attention", "sparse_call"]


@dataclass(frozen=True)
class DispatchedSparseKernels:
    """`SparseAttentionKernels` that ask the dispatcher for a backend at every call."""

    requested: Requested = AUTO

    def forward(self, query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                scale: float) -> tuple[Tensor, Tensor]:
        kernel = dispatch(OpFamily.SPARSE_ATTENTION_FWD, self.requested, **sparse_call(query, kv, indices))
        return kernel(query, kv, indices, sink, scale)

    def backward(self, query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                 out: Tensor, lse: Tensor, grad_out: Tensor,
                 grad_lse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        kernel = dispatch(OpFamily.SPARSE_ATTENTION_BWD, self.requested, **sparse_call(query, kv, indices),
                          lse_grad=grad_lse is not None)
        return kernel(query, kv, indices, sink, scale, out, lse, grad_out, grad_lse)


def sparse_attention(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                     requested: Requested = AUTO) -> tuple[Tensor, Tensor]:
    """`ops.sparse_attention.sparse_attention` with dispatched kernels: `query [N, H, D]`, `kv [M, D]`,
    `indices [N, K]`, `sink [H]` → `out [N, H, D]`, `lse [N, H]` (float32, sink excluded).

    `requested` is `auto`, a backend name, or the layer config (per-op choice). Under `torch.compile` the
    custom op `megatron_dsa::sparse_attention_fwd` runs it (`backends.library`)."""
    if torch.compiler.is_compiling():
        check_sparse_inputs(query, kv, indices, sink)
        return library.sparse_attention(query, kv, indices, sink, scale, requested)
    return _sparse_attention(query, kv, indices, sink, scale, DispatchedSparseKernels(requested))
