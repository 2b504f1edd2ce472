"""Orthonormal Walsh–Hadamard transform (Sylvester order) over the last dim."""

from __future__ import annotations

from torch import Tensor
import torch


def hadamard_transform(x: Tensor) -> Tensor:
    """`y = H_n x / sqrt(n)` with `H_2n = [[H_n, H_n], [H_n, −H_n]]`; `n = x.shape[-1]` a power of 2.

    Butterfly form: `log2(n)` passes of pairwise sums and differences. Self-inverse.
    """
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two last dim, got {n}")
    lead = x.shape[:-1]
    y = x
    span = 1
    while span < n:
        pairs = y.reshape(*lead, n // (2 * span), 2, span)
        first, second = pairs.unbind(-2)
        y = torch.stack((first + second, first - second), dim=-2).reshape(*lead, n)
        span *= 2
    return y * n ** -0.5
