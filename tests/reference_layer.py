"""Independent float64 reference of one whole hybrid attention layer, per kind W / C / H / M.

Written from the math (docs/math.md §1–§13) and deliberately plain: one
sequence at a time, python loops for index sets and pooling slots, dense masked attention over an
explicit visible set. It never imports `megatron_dsa.ops` or `megatron_dsa.layers`; it only reads
parameters by their Megatron names (keys relative to the attention module, e.g. a layer's
`state_dict()`) and plain attributes of a config object.

Conventions taken from the spec:
* RoPE: the last P dims of a head are P/2 adjacent pairs `(x[2i], x[2i+1])`, rotated as complex numbers
  `x[2i] + i·x[2i+1]` times `e^{iθ}` (inverse: `e^{−iθ}`), `θ_i = pos · inv_freq_i`.
* W: plain table at `rotary_base`; C/H: YaRN table at `csa_compress_rotary_base`, mscale ignored.
* Compressed entry `j` rotates at position `j·r`; token `t` sees entries `j < floor((t+1)/r)`.
* Attention softmax includes the per-head sink as an extra logit that carries no value.
* Indexer loss: teacher from detached tensors normalised by window + sink + candidates, head-summed,
  L1-normalised; student = softmax of the indexer scores over the candidates; `coeff · Σ KL` in
  per-token mode, else divided by all `B·S` rows.
* M: DeepSeek-V3 MLA; its RoPE uses the same interleaved-pair convention, with YaRN amplitude
  `mscale(s, mscale) / mscale(s, mscale_all_dim)` and softmax scale `mscale(s, mscale_all_dim)² / √(qk+P)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor

F64 = torch.float64


@dataclass
class ReferenceResult:
    out: Tensor  # [S, B, d]
    indexer_loss: Optional[Tensor]  # coefficient-scaled scalar (C layers with an indexer), else None
    selections: Optional[list[list[list[int]]]]  # [b][t] → selected compressed entries j (indexer only)


# ------------------------------------------------------------------------------------------ tables
def compress_ratio(config, kind: str) -> int:
    return {"W": 0, "C": 4, "H": config.hca_compress_ratio, "M": 0}[kind]


def plain_inv_freq(rotary_dim: int, base: float) -> Tensor:
    return torch.tensor([base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)], dtype=F64)


def yarn_correction_range(rotary_dim: int, base: float, original_max_position: int,
                          beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """`(low, high)` of docs/math.md §2.4 (17, 28 for P=64, base 40000, L0 65536)."""

    def c(num_rotations: float) -> float:
        return rotary_dim * math.log(original_max_position / (2 * math.pi * num_rotations)) / (
            2 * math.log(base))

    return max(math.floor(c(beta_fast)), 0), min(math.ceil(c(beta_slow)), rotary_dim - 1)


def yarn_inv_freq(rotary_dim: int, base: float, factor: float, original_max_position: int,
                  beta_fast: float, beta_slow: float) -> Tensor:
    low, high = yarn_correction_range(rotary_dim, base, original_max_position, beta_fast, beta_slow)
    high = high + 0.001 if low == high else high
    values = []
    for i in range(rotary_dim // 2):
        extrapolated = base ** (-2.0 * i / rotary_dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        values.append(extrapolated / factor * ramp + extrapolated * (1.0 - ramp))
    return torch.tensor(values, dtype=F64)


def layer_inv_freq(config, kind: str) -> Tensor:
    """The rotary table a layer of `kind` must use (docs/math.md §2.3–2.5; `M` follows `rope_type`, docs/math.md §13)."""
    if config.rotary_percent != 1.0:
        raise NotImplementedError("the reference covers rotary_percent == 1 only")
    p = config.qk_pos_emb_head_dim
    if kind == "W" or (kind == "M" and config.rope_type == "rope"):
        return plain_inv_freq(p, config.rotary_base)
    base = config.rotary_base if kind == "M" else config.csa_compress_rotary_base
    return yarn_inv_freq(p, base, config.rotary_scaling_factor, config.original_max_position_embeddings,
                         config.beta_fast, config.beta_slow)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def sylvester_hadamard(n: int) -> Tensor:
    """Orthonormal Walsh–Hadamard matrix in Sylvester order, built explicitly."""
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    assert h.shape[0] == n, f"{n} is not a power of two"
    return h / math.sqrt(n)


# ------------------------------------------------------------------------------------------ pieces
def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
           amplitude: float = 1.0) -> Tensor:
    """Rotate the last `P = 2·len(inv_freq)` dims of `x [S, ..., Dh]` as complex pairs."""
    half = inv_freq.numel()
    angles = positions.to(F64).unsqueeze(-1) * inv_freq  # [S, P/2]
    if inverse:
        angles = -angles
    factor = torch.polar(torch.full_like(angles, amplitude), angles)
    factor = factor.view(angles.shape[0], *([1] * (x.dim() - 2)), half)
    nope, pe = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    pairs = torch.view_as_complex(pe.reshape(*pe.shape[:-1], half, 2).contiguous())
    return torch.cat((nope, torch.view_as_real(pairs * factor).flatten(-2)), -1)


def compress(x: Tensor, wkv: Tensor, wgate: Tensor, ape: Tensor, norm_weight: Tensor, ratio: int,
             eps: float, inv_freq: Tensor, hadamard: bool) -> Tensor:
    """Compressed entries `[floor(S/r), Dc]` of one sequence `x [S, d]` (docs/math.md §4)."""
    overlap = ratio == 4
    dc = wkv.shape[0] // (2 if overlap else 1)
    kv, gate = x @ wkv.T, x @ wgate.T
    entries = []
    for j in range(x.shape[0] // ratio):
        values, logits = [], []
        for i in range(ratio):  # previous group through the first Dc channels (none for j = 0)
            if overlap and j > 0:
                token = (j - 1) * ratio + i
                values.append(kv[token, :dc])
                logits.append(gate[token, :dc] + ape[i, :dc])
        for i in range(ratio):  # own group (the last Dc channels when overlapping)
            token = j * ratio + i
            channels = slice(dc, 2 * dc) if overlap else slice(0, dc)
            values.append(kv[token, channels])
            logits.append(gate[token, channels] + ape[i, channels])
        weights = torch.softmax(torch.stack(logits), dim=0)  # independent per channel
        entries.append((weights * torch.stack(values)).sum(0))
    if not entries:
        return x.new_zeros(0, dc)
    pooled = rms_norm(torch.stack(entries), norm_weight, eps)
    out = rotate(pooled, torch.arange(len(entries)) * ratio, inv_freq)
    return out @ sylvester_hadamard(dc) if hadamard else out


def stable_topk(scores: list[float], count: int, k: int) -> list[int]:
    """The `k` best of the first `count` columns, highest first, lower index winning ties."""
    return sorted(range(count), key=lambda j: (-scores[j], j))[:k]


# ------------------------------------------------------------------------------------------ W / C / H
def _hybrid_sequence(p: Mapping[str, Tensor], cfg, kind: str, x: Tensor, want_loss: bool):
    """One sequence `x [S, d]` → `(out [S, d], Σ_t KL_t or None, selection or None)`."""
    seqlen = x.shape[0]
    heads, dim, eps = cfg.num_attention_heads, cfg.v_head_dim, cfg.layernorm_epsilon
    window, ratio = cfg.csa_window_size, compress_ratio(cfg, kind)
    positions = torch.arange(seqlen)
    inv_freq = layer_inv_freq(cfg, kind)

    cq = x @ p["linear_q_down_proj.weight"].T
    if cfg.qk_layernorm:
        cq = rms_norm(cq, p["q_layernorm.weight"], eps)
    q = (cq @ p["linear_q_up_proj.weight"].T).view(seqlen, heads, dim)
    q = rotate(rms_norm(q, None, eps), positions, inv_freq)
    kv = x @ p["linear_kv_proj.weight"].T
    if cfg.qk_layernorm:
        kv = rms_norm(kv, p["kv_layernorm.weight"], eps)
    kv = rotate(kv, positions, inv_freq)

    if ratio:
        cp = "core_attention.compressor."
        compressed = compress(x, p[cp + "linear_wkv.weight"], p[cp + "linear_wgate.weight"], p[cp + "ape"],
                              p[cp + "norm.weight"], ratio, eps, inv_freq, hadamard=False)
    else:
        compressed = x.new_zeros(0, dim)
    n_entries = compressed.shape[0]

    def n_visible(t: int) -> int:
        return min((t + 1) // ratio, n_entries) if ratio else 0

    def window_keys(t: int) -> list[int]:
        return list(range(max(0, t - window + 1), t + 1))

    has_indexer = kind == "C" and not cfg.csa_dense_mode
    scores = selection = None
    if has_indexer:
        scores = _indexer_scores(p, cfg, x.detach(), cq.detach(), inv_freq, n_visible)
        rows = scores.tolist()
        selection = [stable_topk(rows[t], n_visible(t), cfg.dsa_indexer_topk) for t in range(seqlen)]
        chosen = selection
    else:
        chosen = [list(range(n_visible(t))) for t in range(seqlen)]

    kv_full = torch.cat((kv, compressed))  # K = V; compressed entry j is row S + j
    allowed = torch.zeros(seqlen, seqlen + n_entries, dtype=torch.bool)
    for t in range(seqlen):
        for key in window_keys(t) + [seqlen + j for j in chosen[t]]:
            allowed[t, key] = True
    logits = torch.einsum("thd,kd->htk", q, kv_full) * dim ** -0.5
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = p["core_attention.attn_sink"].view(heads, 1, 1).expand(heads, seqlen, 1)
    probs = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]  # sink: mass, no value
    o = torch.einsum("htk,kd->thd", probs, kv_full)
    o = rotate(o, positions, inv_freq, inverse=True)

    groups, rank = cfg.o_groups, cfg.o_lora_rank
    per_group = heads // groups
    wo_a = p["linear_o_group_proj"]
    z = torch.cat([o[:, g * per_group:(g + 1) * per_group].reshape(seqlen, -1)
                   @ wo_a[g * rank:(g + 1) * rank].T for g in range(groups)], -1)
    out = z @ p["linear_proj.weight"].T

    kl_sum = None
    if has_indexer and want_loss:
        kl_sum = _kl_sum(cfg, q.detach(), kv_full.detach(), p["core_attention.attn_sink"].detach(),
                         scores, selection, window_keys, n_visible)
    return out, kl_sum, selection


def _indexer_scores(p: Mapping[str, Tensor], cfg, x: Tensor, cq: Tensor, inv_freq: Tensor,
                    n_visible) -> Tensor:
    """`[S, C]` lightning-indexer scores (−inf where not visible), docs/math.md §6.1–6.2."""
    seqlen = x.shape[0]
    n_heads, head_dim = cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim
    ip = "core_attention.indexer."
    hadamard = sylvester_hadamard(head_dim)
    q = (cq @ p[ip + "linear_wq_b.weight"].T).view(seqlen, n_heads, head_dim)
    q = rotate(q, torch.arange(seqlen), inv_freq) @ hadamard
    k = compress(x, p[ip + "compressor.linear_wkv.weight"], p[ip + "compressor.linear_wgate.weight"],
                 p[ip + "compressor.ape"], p[ip + "compressor.norm.weight"], 4, cfg.layernorm_epsilon,
                 inv_freq, hadamard=True)
    weights = (x @ p[ip + "linear_weights_proj.weight"].T) * n_heads ** -0.5
    dots = torch.relu(torch.einsum("thd,jd->thj", q, k))
    scores = torch.einsum("th,thj->tj", weights, dots) * head_dim ** -0.5
    visible = torch.tensor([[j < n_visible(t) for j in range(k.shape[0])] for t in range(seqlen)],
                           dtype=torch.bool).view(seqlen, k.shape[0])
    return scores.masked_fill(~visible, float("-inf"))


def _kl_sum(cfg, q: Tensor, kv_full: Tensor, sink: Tensor, scores: Tensor, selection, window_keys,
            n_visible) -> Tensor:
    """`Σ_t KL(teacher_t ‖ softmax(scores_t))` over the candidate sets (docs/math.md §8)."""
    seqlen, dim = q.shape[0], q.shape[-1]
    total = scores.new_zeros(())
    for t in range(seqlen):
        candidates = selection[t] if cfg.dsa_indexer_use_sparse_loss else list(range(n_visible(t)))
        if not candidates:
            continue
        window = window_keys(t)
        keys = window + [seqlen + j for j in candidates]
        logits = (q[t] @ kv_full[keys].T) * dim ** -0.5  # [H, |window| + |candidates|]
        lse = torch.logsumexp(torch.cat((sink.unsqueeze(1), logits), 1), 1, keepdim=True)
        mass = torch.exp(logits[:, len(window):] - lse).sum(0)
        target = mass / mass.sum()
        log_pred = torch.log_softmax(scores[t, candidates], 0)
        positive = target > 0
        total = total + (target[positive] * (torch.log(target[positive]) - log_pred[positive])).sum()
    return total


# ------------------------------------------------------------------------------------------ M
def _mla_sequence(p: Mapping[str, Tensor], cfg, x: Tensor) -> Tensor:
    """DeepSeek-V3 dense causal MLA of one sequence `x [S, d]` → `[S, d]`."""
    seqlen = x.shape[0]
    heads, p_dim, v_dim, eps = cfg.num_attention_heads, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, \
        cfg.layernorm_epsilon
    nope = cfg.qk_head_dim if cfg.qk_head_dim is not None else v_dim - p_dim
    rank = cfg.kv_lora_rank if cfg.kv_lora_rank is not None else v_dim - p_dim
    groups = cfg.num_query_groups if cfg.num_query_groups is not None else heads
    positions, inv_freq = torch.arange(seqlen), layer_inv_freq(cfg, "M")
    yarn = cfg.rope_type == "yarn"
    s = cfg.rotary_scaling_factor
    amplitude = yarn_mscale(s, cfg.mscale) / yarn_mscale(s, cfg.mscale_all_dim) if yarn else 1.0
    scale = (nope + p_dim) ** -0.5 * (yarn_mscale(s, cfg.mscale_all_dim) ** 2 if yarn else 1.0)

    cq = x @ p["linear_q_down_proj.weight"].T
    if cfg.qk_layernorm:
        cq = rms_norm(cq, p["q_layernorm.weight"], eps)
    q = (cq @ p["linear_q_up_proj.weight"].T).view(seqlen, heads, nope + p_dim)
    q = rotate(q, positions, inv_freq, amplitude=amplitude)
    down = x @ p["linear_kv_down_proj.weight"].T
    latent, k_pe = down[:, :rank], down[:, rank:]
    if cfg.qk_layernorm:
        latent = rms_norm(latent, p["kv_layernorm.weight"], eps)
    kv = (latent @ p["linear_kv_up_proj.weight"].T).view(seqlen, groups, nope + v_dim)
    k_pe = rotate(k_pe, positions, inv_freq, amplitude=amplitude)  # one rope key for every head

    future = torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool), 1)
    outputs = []
    for h in range(heads):
        g = h // (heads // groups)
        k = torch.cat((kv[:, g, :nope], k_pe), -1)
        logits = (q[:, h] @ k.T * scale).masked_fill(future, float("-inf"))
        outputs.append(torch.softmax(logits, -1) @ kv[:, g, nope:])
    return torch.cat(outputs, -1) @ p["linear_proj.weight"].T


# ------------------------------------------------------------------------------------------ layer
def reference_layer(params: Mapping[str, Tensor], config, kind: str, x: Tensor,
                    compute_loss: bool = True) -> ReferenceResult:
    """The layer of `kind` on `x [S, B, d]` with `params` (Megatron names) → `ReferenceResult`.

    Differentiable in `x` and every parameter tensor. `indexer_loss` is the coefficient-scaled KL
    loss (per-token sum or mean over B·S rows per `config.calculate_per_token_loss`); it is built from
    detached inputs, so its gradient reaches only the indexer parameters.
    """
    kind = getattr(kind, "value", kind)
    seqlen, batch, _ = x.shape
    outs, kl_sums, selections = [], [], []
    for b in range(batch):
        if kind == "M":
            outs.append(_mla_sequence(params, config, x[:, b]))
            continue
        out, kl_sum, selection = _hybrid_sequence(params, config, kind, x[:, b], compute_loss)
        outs.append(out)
        kl_sums.append(kl_sum)
        selections.append(selection)
    loss = None
    if kl_sums and kl_sums[0] is not None:
        total = torch.stack(kl_sums).sum()
        loss = config.dsa_indexer_loss_coeff * (
            total if config.calculate_per_token_loss else total / (batch * seqlen))
    has_selection = bool(selections) and selections[0] is not None
    return ReferenceResult(torch.stack(outs, 1), loss, selections if has_selection else None)


# ------------------------------------------------------------------------------------------ harness
FP64_TOLERANCE = 1e-10  # fp64 vs fp64: max |a − b| ≤ 1e-10 · max(‖expected‖∞, 1e-6)


def randomize_parameters_(module: torch.nn.Module, seed: int) -> None:
    """Give every parameter a non-trivial value: unit-variance projections, norm gains near 1
    (not exactly 1), a sink of O(1) per head (a zero sink hides sink bugs) and a visible APE."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=F64).to(param.dtype)
            if name.endswith("attn_sink"):
                param.copy_(noise)
            elif name.endswith("ape"):
                param.copy_(0.5 * noise)
            elif param.dim() == 1:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))


def leaf_parameters(module: torch.nn.Module) -> dict[str, Tensor]:
    """Detached, grad-requiring copies of a module's parameters, keyed by Megatron name."""
    return {name: p.detach().clone().requires_grad_() for name, p in module.named_parameters()}


def assert_fp64_close(actual: Tensor, expected: Tensor, what: str) -> None:
    assert actual is not None, f"{what}: missing (None)"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    expected = expected.detach().to(actual.dtype)
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1e-6)
    error = (actual.detach() - expected).abs().max().item() if expected.numel() else 0.0
    assert error <= FP64_TOLERANCE * scale, f"{what}: max abs error {error:.3e} (scale {scale:.3e})"
