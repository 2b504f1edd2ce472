"""Dense causal attention for the `M` (dense MLA) kind, with natural-log LSE."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.ops.layout import TokenLayout

CHUNK_ELEMENTS = 1 << 24


def causal_attention(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention within each segment.

    q `[T, H, Dqk]`, k `[T, G, Dqk]`, v `[T, G, Dv]` with `G | H` (GQA: query head `h` reads KV head
    `h // (H/G)`). Returns `out [T, H, Dv]` (q dtype) and `lse [T, H]` (float32/64).
    Softmax in float32 (float64 for float64 input); computed in query-row chunks.
    """
    rows, heads, _ = q.shape
    groups = k.shape[1]
    if heads % groups or k.shape[:2] != v.shape[:2] or k.shape[0] != rows or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"causal_attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k.to(compute).repeat_interleave(heads // groups, dim=1)
    v = v.to(compute).repeat_interleave(heads // groups, dim=1)
    seg = layout.segment_ids
    # Chunks of at most max_seqlen rows see at most 2·max_seqlen keys.
    longest = max(layout.max_seqlen, 1)
    step = max(1, min(longest, CHUNK_ELEMENTS // (2 * longest * heads)))
    outs, lses = [], []
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        # A row's segment starts at most max_seqlen - 1 rows earlier: a host-known key range.
        first_key = max(0, start - longest + 1)
        query_rows = torch.arange(start, stop, device=q.device)
        key_rows = torch.arange(first_key, stop, device=q.device)
        allowed = (seg[start:stop].unsqueeze(1) == seg[first_key:stop].unsqueeze(0)) & (
            key_rows <= query_rows.unsqueeze(1))
        logits = torch.einsum("nhd,mhd->nhm", q[start:stop].to(compute), k[first_key:stop]) * scale
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.einsum("nhm,mhd->nhd", torch.exp(logits - lse.unsqueeze(-1)), v[first_key:stop]))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def attention_block(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """One block of a context-parallel ring: `q [n, H, Dqk]` against `k [m, G, Dqk]`, `v [m, G, Dv]`.

    `causal=True` is the diagonal block (query `i` sees keys `≤ i`, `n == m`); otherwise every key is
    visible. Returns `out [n, H, Dv]` and natural-log `lse [n, H]` in the compute dtype (float32, or
    float64 for float64 input), for `merge_attention`.
    """
    heads, groups = q.shape[1], k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k.to(compute).repeat_interleave(heads // groups, dim=1)
    v = v.to(compute).repeat_interleave(heads // groups, dim=1)
    logits = torch.einsum("nhd,mhd->nhm", q.to(compute), k) * scale
    if causal:
        future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(future.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.einsum("nhm,mhd->nhd", torch.exp(logits - safe.unsqueeze(-1)), v), lse


def merge_attention(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Combine partial results over disjoint key sets: `lse = logsumexp_i lse_i`,
    `out = Σ_i exp(lse_i − lse)·out_i`. Blocks with `lse = −inf` (no visible key) contribute 0, and a
    row with no key at all gives `out = 0`, `lse = −inf` (never NaN)."""
    lses = torch.stack([lse for _, lse in parts])
    # logsumexp's backward is exp(x − result): NaN where every block is −inf, so such rows take a
    # finite stand-in and are set back to −inf outside the graph of the others.
    empty = torch.isneginf(lses).all(0)
    total = torch.where(empty, float("-inf"),
                        torch.logsumexp(torch.where(empty.unsqueeze(0), 0.0, lses), dim=0))
    safe_total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weights = torch.where(torch.isfinite(lses), torch.exp(lses - safe_total), torch.zeros_like(lses))
    out = sum(w.unsqueeze(-1) * o for w, (o, _) in zip(weights, parts))
    return out, total
