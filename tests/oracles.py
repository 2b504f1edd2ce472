"""Slow scalar-loop oracles for the hybrid-attention ops (each docstring names the docs/math.md section).

Every oracle is written from the spec's formulas with plain Python loops over tokens, heads, keys and
channels; none of them imports `megatron_dsa`. Differentiable oracles build their results from 0-d
tensor operations, so `torch.autograd` through an oracle is an independent gradient reference.
Non-differentiable parts (index tables, the detached KL teacher) use Python ints/floats.

Conventions shared with the package: −1 marks "no entry" in every index table; a packed layout is a
list of segment lengths, segment `b` owning token rows `sum(lengths[:b]) …`; compressed rows are
numbered segment after segment.
"""

from __future__ import annotations

import cmath
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

INVALID = -1
NEG_INF = float("-inf")
FP32_TINY = 2.0 ** -126  # smallest normal float32: the teacher's L1 clamp (docs/math.md §8.2)


# ----------------------------------------------------------------------------- scalar helpers

def dot(u: Sequence[Tensor], v: Sequence[Tensor]) -> Tensor:
    """Σ_i u_i·v_i over 0-d tensors (or the rows of 1-d tensors), one channel at a time."""
    total = None
    for a, b in zip(u, v):
        total = a * b if total is None else total + a * b
    return total


def scalars(t: Tensor) -> list:
    """Nested lists of 0-d tensors (differentiable views of `t`)."""
    return [scalars(row) for row in t.unbind(0)] if t.dim() > 1 else list(t.unbind(0))


def value(v) -> float:
    """The Python float of a 0-d tensor or number (no autograd involvement)."""
    return float(v.detach()) if isinstance(v, Tensor) else float(v)


def _stable_shift(values: Sequence) -> float:
    """A finite shift for exp(): the largest finite value (0 if none)."""
    finite = [value(v) for v in values if math.isfinite(value(v))]
    return max(finite) if finite else 0.0


def softmax_list(logits: Sequence[Tensor]) -> list:
    """Softmax over a list of 0-d tensors (−inf entries get weight 0)."""
    shift = _stable_shift(logits)
    exps = [torch.exp(z - shift) for z in logits]
    total = sum(exps[1:], exps[0])
    return [e / total for e in exps]


def segment_starts(lengths: Sequence[int]) -> list[int]:
    starts, acc = [], 0
    for length in lengths:
        starts.append(acc)
        acc += length
    return starts


# ---------------------------------------------------------------------------- RoPE (docs/math.md §2)

def plain_inv_freq_oracle(rotary_dim: int, base: float, rotary_percent: float = 1.0) -> list[float]:
    """`f_i = base^(−2i/P')` for the first `P' = int(P·rotary_percent)` rotary dims, 0 (no rotation)
    for the remaining pairs (they pass through, as Megatron's `t_pass`)."""
    rotated = int(rotary_dim * rotary_percent)
    return [base ** (-2.0 * i / rotated) if 2 * i < rotated else 0.0 for i in range(rotary_dim // 2)]


def yarn_correction_range_oracle(rotary_dim: int, base: float, original_max_position: int,
                                 beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[int, int]:
    def c(n: float) -> float:
        return rotary_dim * math.log(original_max_position / (2 * math.pi * n)) / (2 * math.log(base))

    return max(math.floor(c(beta_fast)), 0), min(math.ceil(c(beta_slow)), rotary_dim - 1)


def yarn_inv_freq_oracle(rotary_dim: int, base: float, scaling_factor: float, original_max_position: int,
                         beta_fast: float = 32.0, beta_slow: float = 1.0) -> list[float]:
    low, high = yarn_correction_range_oracle(rotary_dim, base, original_max_position, beta_fast, beta_slow)
    if low == high:
        high += 0.001
    freqs = []
    for i in range(rotary_dim // 2):
        extra = base ** (-2.0 * i / rotary_dim)
        inter = extra / scaling_factor
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        freqs.append(inter * ramp + extra * (1.0 - ramp))
    return freqs


def rope_vector_oracle(vec: Tensor, position: float, inv_freq: Sequence[float], inverse: bool = False) -> Tensor:
    """Rotate the last `P = 2·len(inv_freq)` entries of a 1-d `vec` as complex numbers
    `z_i = vec[2i] + i·vec[2i+1]` multiplied by `e^{±iθ_i}`, `θ_i = position·f_i`."""
    inv_freq = [float(f) for f in inv_freq]
    elems = list(vec.unbind(0))
    first = len(elems) - 2 * len(inv_freq)
    out = elems[:first]
    for i, freq in enumerate(inv_freq):
        w = cmath.exp(1j * float(position) * freq)
        if inverse:
            w = w.conjugate()
        a, b = elems[first + 2 * i], elems[first + 2 * i + 1]
        out.append(a * w.real - b * w.imag)  # Re((a + ib)·w)
        out.append(a * w.imag + b * w.real)  # Im((a + ib)·w)
    return torch.stack(out)


def rope_oracle(x: Tensor, positions: Sequence, inv_freq: Sequence[float], inverse: bool = False) -> Tensor:
    """`x [T, Dh]` or `[T, H, Dh]`, one position per row."""
    rows = []
    for t, row in enumerate(x.unbind(0)):
        pos = float(positions[t])
        if x.dim() == 2:
            rows.append(rope_vector_oracle(row, pos, inv_freq, inverse))
        else:
            rows.append(torch.stack([rope_vector_oracle(h, pos, inv_freq, inverse) for h in row.unbind(0)]))
    return torch.stack(rows)


# ----------------------------------------------------------------------------- Hadamard, RMSNorm

def sylvester_hadamard(n: int) -> list[list[int]]:
    """Unnormalised `H_n` by the Sylvester recursion `H_2m = [[H_m, H_m], [H_m, −H_m]]`."""
    h = [[1]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return h


def hadamard_vector_oracle(vec: Tensor) -> Tensor:
    n = vec.shape[0]
    h = sylvester_hadamard(n)
    elems = list(vec.unbind(0))
    norm = 1.0 / math.sqrt(n)
    return torch.stack([dot([float(s) * norm for s in h[i]], elems) for i in range(n)])


def rms_norm_vector_oracle(vec: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    elems = list(vec.unbind(0))
    mean_square = dot(elems, elems) / len(elems)
    inv_rms = 1.0 / torch.sqrt(mean_square + eps)
    gains = list(weight.unbind(0)) if weight is not None else [1.0] * len(elems)
    return torch.stack([e * inv_rms * g for e, g in zip(elems, gains)])


# -------------------------------------------------------------------- index tables (docs/math.md §5)

def window_rows_oracle(lengths: Sequence[int], window: int) -> list[list[int]]:
    """Row `t` at position `p` of its segment: token rows `max(0, p−W+1) … p` of that segment, then −1."""
    table = []
    for start, length in zip(segment_starts(lengths), lengths):
        for p in range(length):
            rows = [start + q for q in range(max(0, p - window + 1), p + 1)]
            table.append(rows + [INVALID] * (window - len(rows)))
    return table


def compressed_counts_oracle(lengths: Sequence[int], ratio: int) -> list[int]:
    return [length // ratio for length in lengths]


def visible_compressed_oracle(lengths: Sequence[int], ratio: int) -> list[list[int]]:
    """Brute force: entry `j` of the own segment is visible to position `p` iff `(j+1)·r ≤ p+1`.
    Returns, per token, the visible compressed row ids (compressed rows numbered segment by segment)."""
    table = []
    first_row = 0
    for length in lengths:
        count = length // ratio
        for p in range(length):
            table.append([first_row + j for j in range(count) if (j + 1) * ratio <= p + 1])
        first_row += count
    return table


def topk_oracle(scores: Sequence[Sequence[float]], valid: Sequence[Sequence[bool]], k: int) -> list[list[int]]:
    """Per row: valid columns by descending score, ties to the lower column, width `min(k, C)`, −1 padded."""
    table = []
    for row_scores, row_valid in zip(scores, valid):
        width = min(k, len(row_scores))
        ranked = sorted((c for c in range(len(row_scores)) if row_valid[c]), key=lambda c: (-row_scores[c], c))
        chosen = ranked[:width]
        table.append(chosen + [INVALID] * (width - len(chosen)))
    return table


# ---------------------------------------------------------------------- compressor (docs/math.md §4)

def project_oracle(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight^T` one output channel at a time: `[T, out]`."""
    ws = scalars(weight)
    return torch.stack([torch.stack([dot(xt, wc) for wc in ws]) for xt in scalars(x)])


def gated_pool_oracle(kv: Tensor, gate: Tensor, ape: Tensor, lengths: Sequence[int], ratio: int) -> Tensor:
    """Gated pooling (docs/math.md §4.1–4.4) of token projections `kv, gate [T, coff·Dc]`, one entry per
    full group of each segment, `[Σ_b floor(L_b/r), Dc]`.

    r = 4 (coff 2): entry `j` pools 8 slots per channel `ch`: slots 0..3 = tokens of group `j−1` through
    projection channel `ch` (value 0 / gate −inf for `j = 0`), slots 4..7 = tokens of group `j` through
    channel `Dc + ch`. Other r: the `r` tokens of group `j` through channel `ch`. `ape[i]` is added to
    the gate of in-group slot `i`; the weights are an independent softmax per channel over the slots.
    """
    coff = 2 if ratio == 4 else 1
    dc = kv.shape[1] // coff
    ks, zs, ape_s = scalars(kv), scalars(gate), scalars(ape)
    zero, minus_inf = kv.new_zeros(()), kv.new_full((), NEG_INF)

    def slot(t: int, i: int, channel: int) -> tuple:
        return ks[t][channel], zs[t][channel] + ape_s[i][channel]

    entries = []
    for start, length in zip(segment_starts(lengths), lengths):
        for j in range(length // ratio):
            pooled = []
            for ch in range(dc):
                if coff == 2:
                    prev = ([slot(start + (j - 1) * ratio + i, i, ch) for i in range(ratio)] if j > 0
                            else [(zero, minus_inf)] * ratio)
                    slots = prev + [slot(start + j * ratio + i, i, dc + ch) for i in range(ratio)]
                else:
                    slots = [slot(start + j * ratio + i, i, ch) for i in range(ratio)]
                weights = softmax_list([z for _, z in slots])
                pooled.append(dot(weights, [k for k, _ in slots]))
            entries.append(torch.stack(pooled))
    return torch.stack(entries) if entries else kv.new_zeros(0, dc)


def compressor_oracle(x: Tensor, wkv: Tensor, wgate: Tensor, ape: Tensor, norm_weight: Tensor, eps: float,
                      lengths: Sequence[int], ratio: int, inv_freq: Sequence[float], rotate: bool) -> Tensor:
    """The whole compressor (docs/math.md §4): projections of the raw input `x [T, d]` → gated
    pool → RMSNorm(weight) → RoPE at position `j·r` → Hadamard if `rotate`. `[Σ_b floor(L_b/r), Dc]`."""
    pooled = gated_pool_oracle(project_oracle(x, wkv), project_oracle(x, wgate), ape, lengths, ratio)
    entries = []
    for start, length in zip(segment_starts(lengths), lengths):
        for j in range(length // ratio):
            vec = rms_norm_vector_oracle(pooled[len(entries)], norm_weight, eps)
            vec = rope_vector_oracle(vec, j * ratio, inv_freq)
            entries.append(hadamard_vector_oracle(vec) if rotate else vec)
    return torch.stack(entries) if entries else pooled


# ------------------------------------------------------------------------- indexer (docs/math.md §6)

def indexer_scores_oracle(q: Tensor, k: Tensor, weights: Tensor, candidates: Sequence[Sequence[int]],
                          scale: float) -> Tensor:
    """`I(t, c) = Σ_h w[t,h]·scale·ReLU(q[t,h]·k[cand])`, −inf where the candidate is −1."""
    qs, ks, ws = scalars(q), scalars(k), scalars(weights)
    rows = []
    for t, row in enumerate(candidates):
        out = []
        for cand in row:
            if cand < 0:
                out.append(q.new_full((), NEG_INF))
                continue
            terms = [ws[t][h] * scale * torch.relu(dot(qs[t][h], ks[cand])) for h in range(len(qs[t]))]
            out.append(sum(terms[1:], terms[0]))
        rows.append(torch.stack(out) if out else q.new_zeros(0))
    return torch.stack(rows)


# ----------------------------------------------------------------------- attention (docs/math.md §7)

def sparse_attention_oracle(query: Tensor, kv: Tensor, indices: Sequence[Sequence[int]], sink: Tensor,
                            scale: float) -> tuple[Tensor, Tensor]:
    """Dense masked attention with a sink (docs/math.md §7.1): every KV row `k` is scanned and kept iff it is in
    row `t`'s index set (entries outside `[0, M)` are ignored). K = V = `kv`.

    `out[t,h] = Σ_k exp(s_k)/(exp(sink_h) + Σ exp(s)) · kv[k]`, `lse[t,h] = log Σ_k exp(s_k)` (sink
    excluded, −inf for an empty set; then `out = 0`).
    """
    num_kv, dim = kv.shape
    qs, kvs, sinks = scalars(query), scalars(kv), list(sink.unbind(0))
    outs, lses = [], []
    for t, row in enumerate(indices):
        allowed = {int(i) for i in row if 0 <= int(i) < num_kv}
        keys = [k for k in range(num_kv) if k in allowed]  # dense scan, masked
        out_t, lse_t = [], []
        for h, q in enumerate(qs[t]):
            logits = [scale * dot(q, kvs[k]) for k in keys]
            shift = max([value(sinks[h])] + [value(s) for s in logits])
            exps = [torch.exp(s - shift) for s in logits]
            denom = torch.exp(sinks[h] - shift) + (sum(exps[1:], exps[0]) if exps else 0.0)
            if keys:
                vec = [dot([e / denom for e in exps], [kvs[k][d] for k in keys]) for d in range(dim)]
                out_t.append(torch.stack(vec))
                # The keys' own maximum: shifted by a dominating sink their mass would underflow.
                key_shift = max(value(s) for s in logits)
                key_exps = [torch.exp(s - key_shift) for s in logits]
                lse_t.append(key_shift + torch.log(sum(key_exps[1:], key_exps[0])))
            else:
                out_t.append(query.new_zeros(dim))
                lse_t.append(query.new_full((), NEG_INF))
        outs.append(torch.stack(out_t))
        lses.append(torch.stack(lse_t))
    return torch.stack(outs), torch.stack(lses)


def causal_attention_oracle(q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int],
                            scale: float) -> tuple[Tensor, Tensor]:
    """Causal softmax attention inside each segment; query head `h` reads KV head `h // (H/G)`."""
    heads, groups = q.shape[1], k.shape[1]
    qs, ks, vs = scalars(q), scalars(k), scalars(v)
    outs, lses = [], []
    for start, length in zip(segment_starts(lengths), lengths):
        for p in range(length):
            t = start + p
            out_t, lse_t = [], []
            for h in range(heads):
                g = h // (heads // groups)
                keys = range(start, t + 1)
                logits = [scale * dot(qs[t][h], ks[m][g]) for m in keys]
                weights = softmax_list(logits)
                shift = _stable_shift(logits)
                lse_t.append(shift + torch.log(sum(torch.exp(s - shift) for s in logits)))
                out_t.append(torch.stack([dot(weights, [vs[m][g][d] for m in keys]) for d in range(v.shape[2])]))
            outs.append(torch.stack(out_t))
            lses.append(torch.stack(lse_t))
    return torch.stack(outs), torch.stack(lses)


def grouped_projection_oracle(o: Tensor, weight: Tensor, groups: int) -> Tensor:
    """`o [N, H·D]`, weight `[G·Ro, H·D/G]`:
    `z[n, g·Ro + r] = Σ_i weight[g·Ro + r, i] · o[n, g·(H·D/G) + i]`."""
    width = o.shape[1] // groups
    ranks = weight.shape[0] // groups
    os_, ws = scalars(o), scalars(weight)
    rows = []
    for n in range(o.shape[0]):
        rows.append(torch.stack([dot(ws[g * ranks + r], os_[n][g * width:(g + 1) * width])
                                 for g in range(groups) for r in range(ranks)]))
    return torch.stack(rows)


# ----------------------------------------------------------------- indexer KL loss (docs/math.md §8)

def teacher_target_oracle(query: Tensor, kv: Tensor, window: Sequence[Sequence[int]],
                          candidates: Sequence[Sequence[int]], sink: Sequence[float], scale: float,
                          include_window: bool = True, include_sink: bool = True) -> list[list[float]]:
    """Detached teacher (floats): `target(j) ∝ Σ_h exp(a_h(j) − LSE_h)` over the valid candidates,
    `LSE_h = log(exp(sink_h) + Σ_window exp(a_h) + Σ_candidates exp(a_h))`, L1-normalised with the
    float32-tiny clamp. `include_window` / `include_sink` = False build the *wrong* denominators of
    the regression negative control (docs/math.md §8.2: window and sink count)."""
    q, kvl = query.detach().tolist(), kv.detach().tolist()

    def logit(t: int, h: int, row: int) -> float:
        return scale * sum(a * b for a, b in zip(q[t][h], kvl[row]))

    targets = []
    for t, cand_row in enumerate(candidates):
        cands = [c for c in cand_row if c >= 0]
        keys = cands + ([w for w in window[t] if w >= 0] if include_window else [])
        mass = [0.0] * len(cand_row)
        for h in range(len(q[t])):
            terms = [logit(t, h, k) for k in keys] + ([float(sink[h])] if include_sink else [])
            shift = max(terms)
            lse = shift + math.log(sum(math.exp(x - shift) for x in terms))
            for col, c in enumerate(cand_row):
                if c >= 0:
                    mass[col] += math.exp(logit(t, h, c) - lse)
        total = max(sum(mass), FP32_TINY)
        targets.append([m / total for m in mass])
    return targets


def kl_rows_oracle(student: Tensor, target: Sequence[Sequence[float]],
                   valid: Sequence[Sequence[bool]]) -> list:
    """`KL_t = Σ_{valid j, target_j > 0} target_j·(log target_j − log pred_j)`, `pred` = softmax of the
    student over the valid columns only; 0 for a row without valid columns (0-d tensors, differentiable)."""
    rows = []
    for t, scores in enumerate(student.unbind(0)):
        cols = [j for j in range(len(valid[t])) if valid[t][j]]
        if not cols:
            rows.append(student.new_zeros(()))
            continue
        logits = [scores[j] for j in cols]
        shift = _stable_shift(logits)
        log_norm = shift + torch.log(sum(torch.exp(s - shift) for s in logits))
        terms = [target[t][j] * (math.log(target[t][j]) - (scores[j] - log_norm))
                 for j in cols if target[t][j] > 0]
        rows.append(sum(terms[1:], terms[0]) if terms else student.new_zeros(()))
    return rows


def indexer_loss_oracle(query: Tensor, kv: Tensor, window: Sequence[Sequence[int]],
                        candidates: Sequence[Sequence[int]], sink: Sequence[float], scale: float,
                        student: Tensor, coeff: float, per_token: bool, **denominator) -> Tensor:
    """`coeff·Σ_t KL_t` (per-token) or `coeff·Σ_t KL_t / T` (mean over all rows); candidate `j` of row
    `t` is valid iff `candidates[t][j] ≥ 0`."""
    target = teacher_target_oracle(query, kv, window, candidates, sink, scale, **denominator)
    valid = [[c >= 0 for c in row] for row in candidates]
    rows = kl_rows_oracle(student, target, valid)
    total = sum(rows[1:], rows[0])
    return coeff * (total if per_token else total / len(rows))


def pick_columns(table: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`table[t, columns[t, i]]`, −1 where the column is −1."""
    return torch.where(columns >= 0, torch.gather(table, 1, columns.clamp_min(0)), -1)
