"""Sparse attention over index rows with a learnable sink (docs/math.md §7).

For query row `t`, head `h`, and the KV rows `K_t = {indices[t, i] ≥ 0}` of the tied key/value
latent (MQA: one KV head, K = V):

    s_k = scale · <q[t,h], kv[k]>
    p_k = exp(s_k) / (exp(sink_h) + Σ_{k∈K_t} exp(s_k))         (the sink carries no value)
    O[t,h] = Σ_{k∈K_t} p_k · kv[k]
    lse[t,h] = log Σ_{k∈K_t} exp(s_k)                            (natural log, sink EXCLUDED)

The returned LSE excludes the sink, as FlashMLA's does: the full normaliser is
`logaddexp(lse, sink)`. A row with no valid index gives `O = 0` and `lse = −inf`.

The reference forward and backward kernels are pure functions (`sparse_attention_forward`,
`sparse_attention_backward`; the contracts every sparse-attention backend implements). They work on
row chunks, and the autograd Function saves only inputs, output and LSE, so memory stays
O(rows · (H + D)) beyond one chunk of gathered keys.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import Tensor

from megatron_dsa.ops.precision import compute_dtype

CHUNK_ELEMENTS = 1 << 24  # gathered-key elements per chunk (64 MiB in float32)


def _rows_per_chunk(width: int, heads: int, dim: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, width * (dim + heads)))


def _chunk_scores(q: Tensor, kv: Tensor, idx: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gathered keys `[n, K, D]`, validity `[n, K]`, masked logits `[n, H, K]` (compute dtype)."""
    compute = compute_dtype(q.dtype)
    valid = (idx >= 0) & (idx < kv.shape[0])
    keys = kv[idx.clamp(0, kv.shape[0] - 1)].to(compute)
    logits = torch.einsum("nhd,nkd->nhk", q.to(compute), keys) * scale
    return keys, valid, logits.masked_fill(~valid.unsqueeze(1), float("-inf"))


def _forward_chunk(q: Tensor, kv: Tensor, idx: Tensor, sink: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    keys, _, logits = _chunk_scores(q, kv, idx, scale)
    sink = sink.to(logits.dtype)
    row_max = torch.maximum(logits.amax(-1), sink)  # finite: the sink is finite
    unnormalised = torch.exp(logits - row_max.unsqueeze(-1))
    key_mass = unnormalised.sum(-1)
    probs = unnormalised / (key_mass + torch.exp(sink - row_max)).unsqueeze(-1)
    out = torch.einsum("nhk,nkd->nhd", probs, keys)
    # The LSE over the keys alone, from their own maximum: shifted by a dominating sink, the keys'
    # mass would underflow to 0 (LSE −inf) although the row has keys.
    return out, torch.logsumexp(logits, dim=-1)


def sparse_attention_forward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                             scale: float) -> tuple[Tensor, Tensor]:
    """The reference forward kernel (no autograd), in row chunks.

    query `[N, H, D]`, kv `[M, D]`, indices `[N, K]` int32/int64 (outside `[0, M)` ignored), sink `[H]`.
    Returns `out [N, H, D]` (query dtype) and `lse [N, H]` (float32; float64 for float64 input):
    natural log over the valid keys, sink excluded, −inf for a row without keys (whose `out` is
    exactly 0: every forward backend keeps that contract, and the cuDNN backward relies on it).
    """
    rows, heads, dim = query.shape
    indices = indices.long()
    step = _rows_per_chunk(indices.shape[1], heads, dim)
    out = query.new_empty(rows, heads, dim)
    lse = query.new_empty(rows, heads, dtype=compute_dtype(query.dtype))
    for start in range(0, rows, step):
        chunk = slice(start, start + step)
        out_c, lse_c = _forward_chunk(query[chunk], kv, indices[chunk], sink, scale)
        out[chunk], lse[chunk] = out_c.to(out.dtype), lse_c
    return out, lse


def sparse_attention_backward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                              out: Tensor, lse: Tensor, grad_out: Tensor,
                              grad_lse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The reference backward kernel (no autograd), in row chunks.

    Takes the forward's inputs, its `out [N, H, D]` and `lse [N, H]`, and the gradients of both
    (`grad_lse=None`: nothing flows through lse). Returns `(grad_query [N, H, D], grad_kv [M, D],
    grad_sink [H])` in the dtypes of query, kv and sink.
    """
    compute = compute_dtype(query.dtype)
    indices = indices.long()
    grad_query = torch.empty_like(query)
    # One spare row absorbs the invalid slots: a masked index_add without a host sync.
    grad_kv = torch.zeros((kv.shape[0] + 1, kv.shape[1]), dtype=compute, device=kv.device)
    grad_sink = torch.zeros(sink.shape, dtype=compute, device=sink.device)
    step = _rows_per_chunk(indices.shape[1], query.shape[1], query.shape[2])
    for start in range(0, query.shape[0], step):
        chunk = slice(start, start + step)
        q = query[chunk].to(compute)
        keys, valid, logits = _chunk_scores(query[chunk], kv, indices[chunk], scale)
        lse_c = lse[chunk].to(compute)
        full_lse = torch.logaddexp(lse_c, sink.to(compute))  # normaliser incl. the sink
        probs = torch.exp(logits - full_lse.unsqueeze(-1))
        d_out = grad_out[chunk].to(compute)
        delta = (d_out * out[chunk].to(compute)).sum(-1)  # <dO, O>
        d_logits = probs * (torch.einsum("nhd,nkd->nhk", d_out, keys) - delta.unsqueeze(-1))
        if grad_lse is not None:
            # lse (sink excluded) has its own gradient: softmax over the keys only.
            safe_lse = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
            d_logits = d_logits + grad_lse[chunk].to(compute).unsqueeze(-1) * torch.exp(
                logits - safe_lse.unsqueeze(-1))
        grad_query[chunk] = (torch.einsum("nhk,nkd->nhd", d_logits, keys) * scale).to(query.dtype)
        d_keys = torch.einsum("nhk,nhd->nkd", probs, d_out) + scale * torch.einsum(
            "nhk,nhd->nkd", d_logits, q)
        spare = torch.where(valid, indices[chunk], kv.shape[0])
        grad_kv.index_add_(0, spare.flatten(), d_keys.flatten(0, 1))
        sink_prob = torch.exp(sink.to(compute) - full_lse)
        grad_sink -= (sink_prob * delta).sum(0)
    return grad_query, grad_kv[:-1].to(kv.dtype), grad_sink.to(sink.dtype)


class SparseAttentionKernels(Protocol):
    """Where `SparseAttentionFunction` gets its forward and backward kernels (the contracts of
    `sparse_attention_forward` / `sparse_attention_backward`). The dispatcher's implementation picks
    a backend per call; `REFERENCE_KERNELS` always runs the reference."""

    def forward(self, query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(self, query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                 out: Tensor, lse: Tensor, grad_out: Tensor,
                 grad_lse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]: ...


class _ReferenceKernels:
    forward = staticmethod(sparse_attention_forward)
    backward = staticmethod(sparse_attention_backward)


REFERENCE_KERNELS: SparseAttentionKernels = _ReferenceKernels()


class SparseAttentionFunction(torch.autograd.Function):
    """`(query [N,H,D], kv [M,D], indices [N,K], sink [H], scale, kernels) → (out [N,H,D], lse [N,H])`.

    Saves only its inputs, output and LSE. Gradients are not materialised: when nothing uses `lse`,
    its gradient reaches the backward kernel as None (some fused kernels have no lse-gradient input).
    """

    @staticmethod
    def forward(ctx, query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                kernels: SparseAttentionKernels):
        out, lse = kernels.forward(query, kv, indices, sink, scale)
        ctx.save_for_backward(query, kv, indices, sink, out, lse)
        ctx.scale, ctx.kernels = scale, kernels
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]):
        query, kv, indices, sink, out, lse = ctx.saved_tensors
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None
        if grad_out is None:  # only lse is used downstream
            grad_out = torch.zeros_like(out)
        grad_query, grad_kv, grad_sink = ctx.kernels.backward(
            query, kv, indices, sink, ctx.scale, out, lse, grad_out, grad_lse)
        return grad_query, grad_kv, None, grad_sink, None, None


def sparse_attention(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                     kernels: SparseAttentionKernels = REFERENCE_KERNELS) -> tuple[Tensor, Tensor]:
    """Attention of `query [N, H, D]` over rows `indices [N, K]` of `kv [M, D]` with sink `[H]`.

    Indices outside `[0, M)` (−1 by convention) are ignored. Returns `out [N, H, D]` in the query
    dtype and `lse [N, H]` (float32, float64 for float64 input), sink excluded. `kernels` picks the
    forward/backward implementation (the reference by default; see `backends.dispatched_sparse_attention`).
    """
    check_sparse_inputs(query, kv, indices, sink)
    return SparseAttentionFunction.apply(query, kv, indices, sink, float(scale), kernels)


def full_normaliser(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
    """`log(exp(sink) + Σ_{k∈K_t} exp(s_k))`, `[N, H]`, without autograd (the KL teacher's LSE)."""
    check_sparse_inputs(query, kv, indices, sink)
    with torch.no_grad():
        step = _rows_per_chunk(indices.shape[1], query.shape[1], query.shape[2])
        lse = torch.cat([_forward_chunk(query[c], kv, indices[c].long(), sink, scale)[1]
                         for c in (slice(s, s + step) for s in range(0, query.shape[0], step))])
        return torch.logaddexp(lse, sink.to(lse.dtype))


def check_sparse_inputs(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> None:
    if query.dim() != 3 or kv.dim() != 2 or query.shape[-1] != kv.shape[-1]:
        raise ValueError(f"sparse_attention expects query [N, H, D] and kv [M, D], got "
                         f"{tuple(query.shape)} and {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != query.shape[0]:
        raise ValueError(f"indices must be [N, K] with N = {query.shape[0]}, got {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if sink.shape != (query.shape[1],):
        raise ValueError(f"sink must be [H] = [{query.shape[1]}], got {tuple(sink.shape)}")
    if not query.is_floating_point() or kv.dtype != query.dtype:
        raise TypeError(f"query and kv must share one floating dtype, got {query.dtype} and {kv.dtype}")
