"""Dense causal attention for the `M` (dense MLA) kind, with natural-log LSE."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.precision import compute_dtype

CHUNK_ELEMENTS = 1 << 24


def _chunk_budget(q: Tensor) -> int:
    """Logit elements per chunk: larger on GPUs, where tiny chunks would be launch-bound, but never more
    than the query block holds. A chunk's temporaries (logits, probabilities and their gradients, a few
    of each alive at once) then grow with the rows attended: under context parallelism a rank's blocks
    are 1/cp of the sequence, and a fixed budget (1 GiB of float32 logits per temporary on a GPU) was
    most of an `M` layer's per-rank peak at 16k tokens, so CP-2 saved 4% of the memory, not half."""
    device_budget = CHUNK_ELEMENTS * (16 if q.device.type == "cuda" else 1)
    return max(1, min(device_budget, q.numel()))


@contextlib.contextmanager
def _tensor_core_matmuls(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """TF32 tensor-core matmuls for half-precision inputs on CUDA, exact float32 otherwise.

    A bf16/fp16 value upcast to float32 has at most 11 significant bits, so TF32 (10 stored mantissa
    bits + the implicit one) holds q, k, v and dO exactly and accumulates in float32; only the
    float32 probabilities lose their low bits (still 3 more than bf16, which fused kernels round
    them to). Without this the chunked attention runs on float32 SIMT GEMMs, about 10× slower.
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _query_chunks(rows: int, keys: int, heads: int, longest: int, causal: bool, budget: int):
    """`(start, stop, first_key, stop_key)` per chunk of query rows.

    Causal (segments): a chunk holds at most `longest` rows; a row's segment starts at most
    `longest − 1` rows earlier, so its keys lie in the host-known range `[start − longest + 1, stop)`.
    Not causal: every chunk sees all `keys` key rows.
    """
    span = 2 * longest if causal else keys
    step = max(1, budget // max(1, span * heads))
    if causal:
        step = min(step, longest)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        yield (start, stop, max(0, start - longest + 1), stop) if causal else (start, stop, 0, keys)


# GQA without copies: query head `h` reads KV group `h // (H/G)`, so the query rows `[n, H, ·]` are viewed as
# `[n, G, H/G, ·]` and each group's heads meet its K/V rows in one GEMM of `n·H/G` rows (with one group, M's
# latent attention, all `n·H` rows in one). Repeating K/V per head instead cost `[rows, H, D]` float32 copies
# of K and V (8.6 GB each at 64k tokens, 64 heads, head dims 512) and GEMMs of only the chunk's rows.
def per_group_product(rows: Tensor, keys: Tensor) -> Tensor:
    """`rows [n, H, D]` · `keys [m, G, D]` per group → `[n, H, m]` (row n, head h: `rows[n, h]·keys[:, h // (H/G)]`)."""
    n, heads, groups = rows.shape[0], rows.shape[1], keys.shape[1]
    grouped = rows.unflatten(1, (groups, heads // groups))
    return torch.einsum("ngjd,mgd->ngjm", grouped, keys).reshape(n, heads, keys.shape[0])


def per_group_mix(weights: Tensor, values: Tensor) -> Tensor:
    """`weights [n, H, m]` mixing `values [m, G, D]` per group → `[n, H, D]`."""
    n, heads, groups = weights.shape[0], weights.shape[1], values.shape[1]
    grouped = weights.unflatten(1, (groups, heads // groups))
    return torch.einsum("ngjm,mgd->ngjd", grouped, values).reshape(n, heads, values.shape[-1])


def per_group_gradient(weights: Tensor, rows: Tensor, groups: int) -> Tensor:
    """`Σ_{n, heads of g} weights[n, h, m]·rows[n, h]` → `[m, G, D]`: the gradient reaching a group's shared
    K/V rows from `weights [n, H, m]` and `rows [n, H, D]`."""
    heads = weights.shape[1]
    return torch.einsum("ngjm,ngjd->mgd", weights.unflatten(1, (groups, heads // groups)),
                        rows.unflatten(1, (groups, heads // groups)))


def _chunk_logits(q: Tensor, k: Tensor, segments: Optional[Tensor], bounds: tuple, scale: float
                  ) -> tuple[Tensor, Optional[Tensor]]:
    """Logits `[n, H, m]` of query rows `[start, stop)` over key rows `[first_key, stop_key)` (k `[·, G, D]`), masked
    to −inf outside the same segment and after the query when `segments` is given; and that
    visibility `[n, m]` (None: every key is visible)."""
    start, stop, first_key, stop_key = bounds
    logits = per_group_product(q[start:stop], k[first_key:stop_key]) * scale
    if segments is None:
        return logits, None
    query_rows = torch.arange(start, stop, device=q.device)
    key_rows = torch.arange(first_key, stop_key, device=q.device)
    allowed = (segments[start:stop].unsqueeze(1) == segments[first_key:stop_key].unsqueeze(0)) & (
        key_rows <= query_rows.unsqueeze(1))
    return logits.masked_fill(~allowed.unsqueeze(1), float("-inf")), allowed


# Non-finite values and the chunk's key window. A chunk multiplies its probabilities with every key
# row of its window, and a masked probability is 0 but 0·NaN = NaN: a NaN value at a later token or in
# another segment would reach rows that cannot see it. So the products run on finite stand-ins (0 in
# place of each non-finite element) and the rows whose visible set holds a non-finite q/k/v element
# are set to NaN afterwards: such a row's output and LSE are NaN, every other row is exactly what it
# would be without the bad value. A NaN row's output is a constant (it passes no gradient); a
# non-finite output gradient of a live row reaches exactly that row's visible keys.
def finite_stand_in(t: Tensor) -> Tensor:
    """`t` with 0 in place of every NaN and infinity (one elementwise pass; its gradient is 0 there too)."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def non_finite_heads(t: Tensor) -> Tensor:
    """`[rows, H]` bool: the head vector `t[row, h, :]` holds a NaN or an infinity. From the vector's minimum
    and maximum (one reading pass, both propagate NaN): at dsv4's M dims `isfinite(t).all(-1)` wrote and read
    a boolean copy of `t` as well."""
    if t.shape[-1] == 0:  # an empty vector holds nothing non-finite (aminmax refuses to reduce it)
        return torch.zeros(t.shape[:-1], dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t, dim=-1)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def _sees(allowed: Optional[Tensor], flagged: Tensor, rows: int, heads: int) -> Tensor:
    """`[n, H]` bool: some key visible to the query row (per `allowed [n, m]`, None = all) is
    `flagged [m, G]` in the head's group."""
    if allowed is None:
        seen = flagged.any(0).expand(rows, -1)
    else:
        seen = (allowed.to(torch.float32) @ flagged.to(torch.float32)) > 0
    return seen.repeat_interleave(heads // flagged.shape[1], dim=1)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, segments: Optional[Tensor], longest: int,
                      scale: float) -> tuple[Tensor, Tensor]:
    """Chunked attention without autograd: `out [n, H, Dv]`, natural-log `lse [n, H]`, both in the
    compute dtype (float32, float64 for float64 input).

    `segments` given: causal within segments (q and k share rows, segments at most `longest` rows).
    `segments=None`: every key is visible. A row without keys gets `out = 0`, `lse = −inf`; a row whose
    visible set (its query, its visible keys and values) holds a NaN or infinity gets NaN `out` and
    `lse`, and no other row is touched by it.
    """
    compute = compute_dtype(q.dtype)
    q_c, k_c, v_c = q.to(compute), k.to(compute), v.to(compute)
    bad_query, bad_key = non_finite_heads(q_c), non_finite_heads(k_c) | non_finite_heads(v_c)
    q_c, k_c, v_c = finite_stand_in(q_c), finite_stand_in(k_c), finite_stand_in(v_c)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=compute, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=compute, device=q.device)
    with _tensor_core_matmuls(q.dtype, q.device):
        for bounds in _query_chunks(q.shape[0], k.shape[0], q.shape[1], longest, segments is not None,
                                    _chunk_budget(q)):
            start, stop, first_key, stop_key = bounds
            logits, allowed = _chunk_logits(q_c, k_c, segments, bounds, scale)
            row_lse = torch.logsumexp(logits, dim=-1)
            probs = torch.exp(logits - torch.where(torch.isfinite(row_lse), row_lse, 0.0).unsqueeze(-1))
            row_out = per_group_mix(probs, v_c[first_key:stop_key])
            poisoned = bad_query[start:stop] | _sees(allowed, bad_key[first_key:stop_key], stop - start, q.shape[1])
            out[start:stop] = torch.where(poisoned.unsqueeze(-1), float("nan"), row_out)
            lse[start:stop] = torch.where(poisoned, float("nan"), row_lse)
    return out, lse


def attention_backward(q: Tensor, k: Tensor, v: Tensor, segments: Optional[Tensor], longest: int,
                       scale: float, lse: Tensor, grad_out: Tensor, delta: Optional[Tensor] = None,
                       grad_lse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients `(dq, dk, dv)` (compute dtype) of `attention_forward`, probabilities recomputed per
    chunk as `exp(logit − lse)`.

    `lse [n, H]` may be the normaliser of a larger key set than `k` holds (a block of keys normalised
    by the LSE `merge_attention` gives over all blocks); then `delta [n, H] = <dO, O>` of the merged output must be
    given. Without `delta` it is taken as `Σ p·dP` of the recomputed probabilities (equal in exact
    arithmetic), so a row with a single key gets an exactly zero logit gradient.
    """
    compute = compute_dtype(q.dtype)
    groups = k.shape[1]
    q_c, k_c, v_c = finite_stand_in(q.to(compute)), finite_stand_in(k.to(compute)), finite_stand_in(v.to(compute))
    grad_q = torch.empty_like(q_c)
    grad_k, grad_v = torch.zeros_like(k_c), torch.zeros_like(v_c)
    with _tensor_core_matmuls(q.dtype, q.device):
        for bounds in _query_chunks(q.shape[0], k.shape[0], q.shape[1], longest, segments is not None,
                                    _chunk_budget(q)):
            start, stop, first_key, stop_key = bounds
            logits, allowed = _chunk_logits(q_c, k_c, segments, bounds, scale)
            row_lse = lse[start:stop]
            dead = torch.isnan(row_lse)  # a NaN row (its output is a constant): no gradient from it
            probs = torch.exp(logits - torch.where(torch.isfinite(row_lse), row_lse, 0.0).unsqueeze(-1))
            probs = torch.where(dead.unsqueeze(-1), 0.0, probs)
            raw_d_out = grad_out[start:stop].to(compute)
            d_out = finite_stand_in(raw_d_out)
            d_probs = per_group_product(d_out, v_c[first_key:stop_key])
            row_delta = (probs * d_probs).sum(-1) if delta is None else delta[start:stop]
            shift = row_delta if grad_lse is None else row_delta - grad_lse[start:stop].to(compute)
            # A live row with a non-finite output gradient (or LSE gradient) gives NaN to its visible
            # keys only, not (through 0·NaN) to the rest of the window.
            live_bad = ~dead & (non_finite_heads(raw_d_out) | ~torch.isfinite(shift))
            shift = torch.where(torch.isfinite(shift), shift, 0.0)
            visible = live_bad.unsqueeze(-1) if allowed is None else live_bad.unsqueeze(-1) & allowed.unsqueeze(1)
            probs = torch.where(visible, float("nan"), probs)
            d_logits = probs * (d_probs - shift.unsqueeze(-1))
            grad_q[start:stop] = per_group_mix(d_logits, k_c[first_key:stop_key]) * scale
            grad_k[first_key:stop_key] += per_group_gradient(d_logits, q_c[start:stop], groups) * scale
            grad_v[first_key:stop_key] += per_group_gradient(probs, d_out, groups)
    return grad_q, grad_k, grad_v


class ChunkedAttentionFunction(torch.autograd.Function):
    """`attention_forward` with autograd: saves only its inputs and the LSE and recomputes the
    probabilities per chunk in backward, so memory is O(rows·H·D) beyond one chunk, never
    `[rows, keys]`. Returns `out [n, H, Dv]` and `lse [n, H]` in the compute dtype."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, segments: Optional[Tensor], longest: int, scale: float):
        out, lse = attention_forward(q, k, v, segments, longest, scale)
        ctx.save_for_backward(q, k, v, segments, lse)
        ctx.longest, ctx.scale = longest, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Tensor):
        q, k, v, segments, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = attention_backward(q, k, v, segments, ctx.longest, ctx.scale, lse, grad_out,
                                                    grad_lse=grad_lse)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.shape[1] % k.shape[1] or k.shape[:2] != v.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")


def causal_attention(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention within each segment.

    q `[T, H, Dqk]`, k `[T, G, Dqk]`, v `[T, G, Dv]` with `G | H` (GQA: query head `h` reads KV head
    `h // (H/G)`). Returns `out [T, H, Dv]` (q dtype) and `lse [T, H]` (float32/64).
    Softmax in float32 (float64 for float64 input); query-row chunks in forward and backward.
    """
    _check_shapes(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"causal_attention needs one key row per query row, got {q.shape[0]} and {k.shape[0]}")
    out, lse = ChunkedAttentionFunction.apply(q, k, v, layout.segment_ids, max(layout.max_seqlen, 1),
                                              float(scale))
    return out.to(q.dtype), lse


def block_mask(q: Tensor, k: Tensor, causal: bool) -> tuple[Optional[Tensor], int]:
    """`(segments, longest)` for `attention_forward/backward` of one key block: the diagonal block
    (`causal`, query `i` sees keys `≤ i`) is one causal segment; an earlier block has no mask."""
    if not causal:
        return None, 1
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"a causal (diagonal) block needs n == m, got {q.shape[0]} and {k.shape[0]}")
    return torch.zeros(q.shape[0], dtype=torch.long, device=q.device), max(q.shape[0], 1)


def attention_block(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Attention over one block of the keys: `q [n, H, Dqk]` against `k [m, G, Dqk]`, `v [m, G, Dv]`.

    `causal=True` is the diagonal block (query `i` sees keys `≤ i`, `n == m`); otherwise every key is
    visible. Returns `out [n, H, Dv]` and natural-log `lse [n, H]` in the compute dtype (float32, or
    float64 for float64 input), for `merge_attention`. Memory-bounded like `causal_attention`.
    """
    _check_shapes(q, k, v)
    segments, longest = block_mask(q, k, causal)
    return ChunkedAttentionFunction.apply(q, k, v, segments, longest, float(scale))


def block_attention_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """The `dense_attention_block_fwd` contract, without autograd: one block of the keys as `attention_block`
    (`q [n, H, Dqk]`, `k [m, G, Dqk]`, `v [m, G, Dv]`; `causal`: the diagonal block, `n == m`) →
    `out [n, H, Dv]`, natural-log `lse [n, H]`, both in the compute dtype, for `merge_attention`."""
    _check_shapes(q, k, v)
    segments, longest = block_mask(q, k, causal)
    return attention_forward(q, k, v, segments, longest, float(scale))


def block_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                             scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The `dense_attention_block_bwd` contract: `(dq, dk, dv)` (compute dtype) of one key block's share of
    attention whose result over all blocks is `out [n, H, Dv]` with `lse [n, H]` (`merge_attention`'s),
    given `grad_out` of that merged output. The probabilities are recomputed as `exp(logit − lse)`."""
    _check_shapes(q, k, v)
    segments, longest = block_mask(q, k, causal)
    compute = compute_dtype(q.dtype)
    delta = (grad_out.to(compute) * out.to(compute)).sum(-1)  # <dO, O> of the merged output
    return attention_backward(q, k, v, segments, longest, float(scale), lse, grad_out, delta=delta)


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
    weights = _block_weights(lses, _finite_or_zero(total))
    out = sum(w.unsqueeze(-1) * o for w, (o, _) in zip(weights, parts))
    return out, total


def _finite_or_zero(total: Tensor) -> Tensor:
    """The merged LSE with 0 where it is not finite (no visible key, or NaN): a safe offset for `_block_weights`."""
    return torch.where(torch.isfinite(total), total, 0.0)


def _block_weights(lse: Tensor, safe_total: Tensor) -> Tensor:
    """Each block's share of the merged output, `exp(lse − total)`; 0 for a block that saw no key (or a NaN one)."""
    return torch.where(torch.isfinite(lse), torch.exp(lse - safe_total), 0.0)


def accumulate_attention(out: Tensor, lse: Tensor, part: tuple[Tensor, Tensor]) -> None:
    """Merge one more block's `(out_b [n, H, Dv], lse_b [n, H])` into a running result `out`, `lse` in place:
    what `merge_attention([(out, lse), part])` returns (up to rounding), in one pass over `out` and one over
    `out_b` where the merge writes two weighted copies and their sum. For an accumulator autograd does not
    see (the context-parallel ring's forward)."""
    part_out, part_lse = part
    total = torch.logaddexp(lse, part_lse)  # −inf where both are −inf (no visible key yet); NaN where either is
    safe_total = _finite_or_zero(total)
    keep, add = _block_weights(lse, safe_total), _block_weights(part_lse, safe_total)
    out.mul_(keep.unsqueeze(-1)).addcmul_(part_out, add.unsqueeze(-1))
    lse.copy_(total)
