"""Lightning-indexer scores (spec §4.2)."""

from __future__ import annotations

import torch
from torch import Tensor


def indexer_scores(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float) -> Tensor:
    """`I(t, c) = Σ_h weights[t,h] · scale · ReLU(<q[t,h], k[c]>)` for each candidate `c` of row `t`.

    q: `[T, HI, DI]`; k: `[Tc, DI]` compressed indexer keys; weights: `[T, HI]` head weights (already
    multiplied by `HI^−1/2`); candidates: `[T, C]` rows of `k`, −1 = none. `scale` (= `DI^−1/2`) is
    applied exactly once, on the weights side (`c·ReLU(x) = ReLU(c·x)` for `c > 0`).
    Returns `[T, C]` in float32 (float64 for float64 input), −inf at invalid candidates.
    """
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"indexer expects q [T, HI, DI] and k [Tc, DI], got {tuple(q.shape)}, {tuple(k.shape)}")
    if weights.shape != q.shape[:2] or candidates.shape[0] != q.shape[0]:
        raise ValueError(f"indexer weights {tuple(weights.shape)} / candidates {tuple(candidates.shape)} "
                         f"do not match q {tuple(q.shape)}")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    valid = candidates >= 0
    # Invalid candidates read an appended zero row: no out-of-range gather, even when `k` is empty.
    padded = torch.cat((k, k.new_zeros(1, k.shape[-1])))
    rows = torch.where(valid, candidates, k.shape[0])
    # index_select's backward is an index_add (fast with the many repeated rows here); advanced
    # indexing's backward sorts the indices and is orders of magnitude slower on GPUs.
    keys = padded.index_select(0, rows.flatten()).view(*rows.shape, k.shape[-1]).to(compute)
    dots = torch.relu(torch.einsum("thd,tcd->thc", q.to(compute), keys))
    scores = torch.einsum("th,thc->tc", weights.to(compute) * scale, dots)
    return scores.masked_fill(~valid, float("-inf"))
