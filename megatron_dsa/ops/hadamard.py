"""Orthonormal Walsh–Hadamard transform (Sylvester order) over the last dim."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.device_cache import DeviceCache, device_scalar

_MATRICES: DeviceCache[Tensor] = DeviceCache()  # one per (n, dtype, device); a few KiB each


def hadamard_matrix(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Unscaled `H_n` `[n, n]` of ±1 (exact in every dtype), Sylvester order:
    `H[i, j] = (−1)^popcount(i & j)` (symmetric).

    Built with device ops (no host-to-device copy, so it is CUDA-graph capturable); cached, except
    while a CUDA graph is being captured (the graph's memory pool must not own the cache)."""
    return _MATRICES.get((n, dtype, torch.device(device)), device, lambda: _sylvester_matrix(n, dtype, device))


def _sylvester_matrix(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    index = torch.arange(n, device=device)
    common = index[:, None] & index[None, :]
    parity = torch.zeros_like(common)
    for bit in range(max(n - 1, 1).bit_length()):
        parity ^= (common >> bit) & 1
    return (1 - 2 * parity).to(dtype)


def hadamard_transform(x: Tensor) -> Tensor:
    """`y = H_n x / sqrt(n)` with `H_2n = [[H_n, H_n], [H_n, −H_n]]`; `n = x.shape[-1]` a power of 2.

    One matmul with the ±1 matrix whose scale rides in the GEMM's `alpha` (applied to the fp32
    accumulator, then rounded once; 1/sqrt(128) is not exact in bf16, so it is not folded into the
    matrix): for the indexer's n = 128 that is a small GEMM, far cheaper on a GPU than `log2(n)`
    elementwise butterfly passes, and the scale costs no extra pass forward or backward. Self-inverse.
    """
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two last dim, got {n}")
    rows = x.reshape(-1, n)
    # beta = 0: the (broadcast) input term is ignored, only alpha·(rows @ H) is written; a kept zero serves
    # as that input, so no fill kernel runs for it per call.
    ignored = device_scalar(0.0, x.dtype, x.device)
    y = torch.addmm(ignored, rows, hadamard_matrix(n, x.dtype, x.device), beta=0, alpha=n ** -0.5)
    return y.view(x.shape)
