"""Inputs and oracles shared by the Triton indexer-loss tests (interpreted on CPU, compiled on GPU)."""

import torch

from megatron_dsa.ops.sparse_attention import full_normaliser

SCALE = 0.37  # not 1 and not D^-1/2: a scale applied twice or never cannot hide (A2.1)
ORACLE_ROWS = 256  # query rows per oracle chunk: gathered float32 keys stay ≤ 512 MiB at C=1024, D=512


def mass_inputs(tokens, heads, dim, entries, candidates, dtype=torch.float32, device="cpu", seed=0):
    """query `[T, H, D]`, kv `[M, D]` in `dtype` and the full normaliser `[T, H]` float32 over the
    candidates plus a sink (as the layer's dense loss builds it), computed from the rounded inputs."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(tokens, heads, dim, generator=gen).to(device, dtype)
    kv = torch.randn(entries, dim, generator=gen).to(device, dtype)
    sink = torch.randn(heads, generator=gen).to(device)
    lse = full_normaliser(query.float(), kv.float(), candidates.to(device), sink, SCALE)
    return query, kv, lse


def reference_mass(query, kv, candidates, full_lse, scale=SCALE):
    """`Σ_h exp(scale·<q[t,h], kv[c]> − lse[t,h])` in float32 from the (upcast) inputs, 0 where the
    id is outside `[0, M)`: a plain einsum over row chunks."""
    valid = (candidates >= 0) & (candidates < kv.shape[0])
    parts = []
    for start in range(0, query.shape[0], ORACLE_ROWS):
        rows = slice(start, start + ORACLE_ROWS)
        keys = kv.float()[candidates[rows].clamp(0, kv.shape[0] - 1)]
        logits = torch.einsum("thd,tcd->thc", query[rows].float(), keys) * scale
        parts.append(torch.exp(logits - full_lse[rows].unsqueeze(-1)).sum(1))
    return torch.cat(parts).masked_fill(~valid, 0.0)


def kl_inputs(tokens, width, device="cpu", seed=0):
    """student `[T, C]` float32 (requires grad), target `[T, C]` float32 L1-normalised over the valid
    columns with exact zeros among them, valid `[T, C]` bool with row 1 fully invalid."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(tokens, width, generator=gen) > 0.3
    valid[1] = False
    mass = torch.rand(tokens, width, generator=gen).masked_fill(~valid, 0.0)
    mass[torch.rand(tokens, width, generator=gen) < 0.2] = 0.0  # exact zero targets on valid columns
    target = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    student = 3 * torch.randn(tokens, width, generator=gen)
    return student.to(device).requires_grad_(), target.to(device), valid.to(device)


def run_kl(fn, student, target, valid, upstream):
    """Per-row KL and the student's gradient of `Σ upstream·KL`."""
    kl = fn(student, target, valid)
    (grad,) = torch.autograd.grad((kl * upstream).sum(), (student,))
    return kl, grad
