"""Inputs shared by the Triton indexer tests (interpreted on CPU, compiled on GPU)."""

import torch

from megatron_dsa.ops.indices import visible_compressed_entries
from megatron_dsa.ops.layout import TokenLayout

SCALE = 0.37  # not 1 and not DI^-1/2: a scale applied twice or never cannot hide (A2.1)


def inputs(tokens, heads, dim, entries, dtype=torch.float32, device="cpu", seed=0):
    """q `[T, HI, DI]`, k `[Tc, DI]`, weights `[T, HI]`, all requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(entries, dim, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(tokens, heads, generator=gen).to(device, dtype).requires_grad_()
    return q, k, w


def random_candidates(tokens, width, entries, seed=1):
    """Arbitrary ids with −1 anywhere, repeated ids, and row 1 without any candidate."""
    gen = torch.Generator().manual_seed(seed)
    cand = torch.randint(0, entries, (tokens, width), generator=gen)
    cand[torch.rand(tokens, width, generator=gen) < 0.3] = -1
    cand[1] = -1
    cand[2, : min(width, 3)] = 0  # the same key three times in one row
    return cand


def causal_candidates(tokens, width, ratio=4):
    """`j` for `j < (t + 1) // ratio`, −1 after: the compressed-entry rows of one sequence."""
    j = torch.arange(width)
    visible = (torch.arange(tokens) + 1) // ratio
    return torch.where(j < visible[:, None], j, -1)


def packed_candidates(lengths, ratio=4):
    """The layer's candidates for sequences of `lengths` tokens packed back to back: a row of a sequence with
    `e` entries before it sees `e + j` for `j < (position + 1) // ratio`, −1 after (`[T, max entries]`)."""
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = TokenLayout.packed(cu_seqlens, sum(lengths), torch.device("cpu"))
    return visible_compressed_entries(layout.compressed(ratio)).rows()


def run(fn, q, k, w, cand, upstream):
    """Scores and the grads of (q, k, weights) for `Σ upstream·scores` over the valid slots."""
    scores = fn(q, k, w, cand, SCALE)
    grads = torch.autograd.grad((scores.masked_fill(cand < 0, 0) * upstream).sum(), (q, k, w))
    return scores, grads
