"""Lightning-indexer scores (docs/math.md §6.2), memory-bounded.

`I(t, c) = Σ_h w[t,h] · scale · ReLU(<q[t,h], k[c]>)` needs the per-head dots `[T, HI, C]` — 64×
larger than the scores for the DSv4 dims. The autograd Function below computes them one row chunk
at a time in forward and recomputes them in backward, saving only its inputs.

`decode_indexer_scores` is the same score for a decode step: one query row per cached sequence against
that sequence's compressed keys where the inference cache keeps them (`[B, C, DI]`), no candidate ids; the
cache may keep them in FP8 (e4m3 rows, one float32 scale per key).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.ops.fp8_linear import quantize_rows
from megatron_dsa.ops.indices import VisibleStructure
from megatron_dsa.ops.precision import compute_dtype

CHUNK_ELEMENTS = 1 << 24  # per-head dot elements per chunk (64 MiB in float32)
FP8_KEYS = torch.float8_e4m3fn  # an inference cache's FP8 indexer keys (with one float32 scale per key)


def _chunks(rows: int, width: int, heads: int, dim: int):
    step = max(1, CHUNK_ELEMENTS // max(1, width * max(heads, dim)))
    return (slice(start, start + step) for start in range(0, rows, step))


def _gathered_keys(k: Tensor, candidates: Tensor, compute: torch.dtype) -> Tensor:
    """`[n, C, DI]` keys of the candidates; invalid candidates read an appended zero row."""
    padded = torch.cat((k, k.new_zeros(1, k.shape[-1])))
    rows = torch.where(candidates >= 0, candidates, k.shape[0])
    return padded.index_select(0, rows.flatten()).view(*rows.shape, k.shape[-1]).to(compute)


class IndexerScoresFunction(torch.autograd.Function):
    """`(q [T,HI,DI], k [Tc,DI], weights [T,HI], candidates [T,C], scale) → scores [T,C]`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float) -> Tensor:
        compute = compute_dtype(q.dtype)
        scores = torch.empty(candidates.shape, dtype=compute, device=q.device)
        for chunk in _chunks(q.shape[0], candidates.shape[1], q.shape[1], q.shape[2]):
            keys = _gathered_keys(k, candidates[chunk], compute)
            dots = torch.relu(torch.einsum("thd,tcd->thc", q[chunk].to(compute), keys))
            scores[chunk] = torch.einsum("th,thc->tc", weights[chunk].to(compute) * scale, dots)
        ctx.save_for_backward(q, k, weights, candidates)
        ctx.scale = scale
        return scores.masked_fill(candidates < 0, float("-inf"))

    @staticmethod
    def backward(ctx, grad_scores: Tensor):
        q, k, weights, candidates = ctx.saved_tensors
        return (*indexer_scores_backward(q, k, weights, candidates, grad_scores, ctx.scale), None, None)


def indexer_scores_backward(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, grad_scores: Tensor,
                            scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """`(grad_q, grad_k, grad_weights)` of `indexer_scores` given `grad_scores [T, C]` (ignored at
    invalid candidates), in the dtypes of q, k and weights. The per-head dots are recomputed in
    row chunks."""
    compute = compute_dtype(q.dtype)
    grad_q = torch.empty_like(q)
    grad_w = torch.empty_like(weights)
    grad_k = torch.zeros((k.shape[0] + 1, k.shape[1]), dtype=compute, device=k.device)
    grad_scores = torch.where(candidates >= 0, grad_scores.to(compute), 0.0)
    for chunk in _chunks(q.shape[0], candidates.shape[1], q.shape[1], q.shape[2]):
        keys = _gathered_keys(k, candidates[chunk], compute)
        q_c, w_c, g = q[chunk].to(compute), weights[chunk].to(compute) * scale, grad_scores[chunk]
        dots = torch.einsum("thd,tcd->thc", q_c, keys)
        grad_w[chunk] = (torch.einsum("tc,thc->th", g, torch.relu(dots)) * scale).to(weights.dtype)
        grad_dots = g.unsqueeze(1) * w_c.unsqueeze(-1) * (dots > 0)
        grad_q[chunk] = torch.einsum("thc,tcd->thd", grad_dots, keys).to(q.dtype)
        rows = torch.where(candidates[chunk] >= 0, candidates[chunk], k.shape[0])
        grad_k.index_add_(0, rows.flatten(), torch.einsum("thc,thd->tcd", grad_dots, q_c).flatten(0, 1))
    return grad_q, grad_k[:-1].to(k.dtype), grad_w


def indexer_scores(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float,
                   visible: Optional[VisibleStructure] = None) -> Tensor:
    """`I(t, c) = Σ_h weights[t,h] · scale · ReLU(<q[t,h], k[c]>)` for each candidate `c` of row `t`.

    q: `[T, HI, DI]`; k: `[Tc, DI]` compressed indexer keys; weights: `[T, HI]` head weights (already
    multiplied by `HI^−1/2`); candidates: `[T, C]` rows of `k`, −1 = none. `scale` (= `DI^−1/2`) is
    applied exactly once, on the weights side (`c·ReLU(x) = ReLU(c·x)` for `c > 0`).
    Returns `[T, C]` in float32 (float64 for float64 input), −inf at invalid candidates.
    `visible` (the `indexer_scores` op family's optional hint): the candidates are the visible entries
    of these uniform-batch rows or row segments (`ops.indices.VisibleStructure`), which a dense kernel can
    score without reading them; the candidates say the same, so this reference ignores it.
    """
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"indexer expects q [T, HI, DI] and k [Tc, DI], got {tuple(q.shape)}, {tuple(k.shape)}")
    if weights.shape != q.shape[:2] or candidates.shape[0] != q.shape[0]:
        raise ValueError(f"indexer weights {tuple(weights.shape)} / candidates {tuple(candidates.shape)} "
                         f"do not match q {tuple(q.shape)}")
    return IndexerScoresFunction.apply(q, k, weights, candidates.long(), float(scale))


def decode_indexer_scores(q: Tensor, keys: Tensor, weights: Tensor, counts: Tensor, scale: float,
                          key_scales: Optional[Tensor] = None) -> Tensor:
    """The `decode_indexer_scores` op family's reference: `I(b, j) = Σ_h weights[b,h] · scale · ReLU(<q[b,h],
    keys[b,j]>)` for the first `counts[b]` keys of sequence b, −inf after them.

    q: `[B, HI, DI]` the new token's indexer queries; keys: `[B, C, DI]` each sequence's cached compressed
    indexer keys (any floating dtype, read as `keys.to(q.dtype)`); weights: `[B, HI]` head weights (the layer's
    `HI^−1/2` factor in them or in `scale`); counts: `[B]` integer keys each sequence's new token sees (values
    above C count as C). key_scales: `[B, C]` float32, with e4m3 `keys` (`torch.float8_e4m3fn`, an FP8 cache)
    and only then: key `j` stands for `keys[b, j] · key_scales[b, j]`, and each query row `q[b, h]` is rounded to
    e4m3 too, with its own scale (`ops.fp8_linear.quantize_rows`), so that a kernel can multiply the codes on an
    e4m3 MMA, as DeepSeek's FP8 indexer does; the scales are positive, so they leave the ReLU: the head's joins
    its weight, the key's multiplies its score. Returns `[B, C]` in float32 (float64 for float64 q). Scored in
    chunks of sequences, so the per-head dots `[B, HI, C]` never exist at once. No host read of `counts`: a CUDA
    graph can capture it.
    """
    check_decode_indexer_inputs(q, keys, weights, counts, key_scales)
    compute = compute_dtype(q.dtype)
    batch, width = keys.shape[:2]
    if key_scales is not None:  # the query rows as e4m3 codes (exact in q's dtype), their scales with the weights
        codes, head_scales = quantize_rows(q.flatten(0, 1))
        q, weights = codes.view(q.shape).to(q.dtype), weights.to(compute) * head_scales.view(weights.shape)
    scores = torch.empty((batch, width), dtype=compute, device=q.device)
    for chunk in _chunks(batch, width, q.shape[1], q.shape[2]):
        dots = torch.einsum("bhd,bjd->bhj", q[chunk].to(compute), keys[chunk].to(q.dtype).to(compute))
        scores[chunk] = torch.einsum("bh,bhj->bj", weights[chunk].to(compute) * scale, torch.relu(dots))
        if key_scales is not None:
            scores[chunk] *= key_scales[chunk].to(compute)
    seen = torch.arange(width, device=q.device) < counts.unsqueeze(1)
    return scores.masked_fill(~seen, float("-inf"))


def check_key_scales(op: str, keys: Tensor, key_scales: Optional[Tensor], keys_name: str = "keys",
                     scales_name: str = "key_scales") -> None:
    """TypeError/ValueError (naming `op` and the arguments) unless cached keys `[B, C, D]` and their scales come
    together exactly when the keys are e4m3 (an FP8 cache), the scales float32 `[B, C]`."""
    if (keys.dtype == FP8_KEYS) != (key_scales is not None):
        raise TypeError(f"{op}: {scales_name} come with {keys_name} of dtype {FP8_KEYS} and only with them, got "
                        f"{keys_name} {keys.dtype} and {scales_name} "
                        f"{'None' if key_scales is None else key_scales.dtype}")
    if key_scales is not None and (key_scales.shape != keys.shape[:2] or key_scales.dtype != torch.float32):
        raise ValueError(f"{op}: {scales_name} must be float32 [B, C] = {list(keys.shape[:2])}, got "
                         f"{tuple(key_scales.shape)} {key_scales.dtype}")


def check_decode_indexer_inputs(q: Tensor, keys: Tensor, weights: Tensor, counts: Tensor,
                                key_scales: Optional[Tensor] = None) -> None:
    """ValueError/TypeError naming the argument when the decode indexer's arguments disagree (shapes and dtypes
    only: no device read)."""
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"decode indexer: q must be a floating [B, HI, DI] tensor, got {tuple(q.shape)} {q.dtype}")
    batch, heads, dim = q.shape
    if keys.dim() != 3 or keys.shape[0] != batch or keys.shape[2] != dim or not keys.is_floating_point():
        raise ValueError(f"decode indexer: keys must be a floating [B, C, DI] = [{batch}, C, {dim}] tensor, got "
                         f"{tuple(keys.shape)} {keys.dtype}")
    if weights.shape != (batch, heads) or not weights.is_floating_point():
        raise ValueError(f"decode indexer: weights must be a floating [B, HI] = [{batch}, {heads}] tensor, got "
                         f"{tuple(weights.shape)} {weights.dtype}")
    if counts.shape != (batch,):
        raise ValueError(f"decode indexer: counts must be [B] = [{batch}], got {tuple(counts.shape)}")
    if counts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"decode indexer: counts must be int32/int64, got {counts.dtype}")
    check_key_scales("decode indexer", keys, key_scales)
    devices = {t.device for t in (q, keys, weights, counts) + (() if key_scales is None else (key_scales,))}
    if len(devices) != 1:
        raise ValueError(f"decode indexer inputs must share one device, got {sorted(map(str, devices))}")
