"""Scalars the Triton kernels read through a pointer (RMSNorm eps, RoPE amplitude), made once per value.

A pointer, not a kernel argument, keeps a float64 value exact (Triton passes float scalars as fp32).
Each is a `[1]` tensor made by a fill kernel (no host-to-device copy: no sync, CUDA-graph capturable)
and kept for later calls, so a layer step does not launch one fill per op; kernels only read them.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CONSTANTS: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}


def device_scalar(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`[1]` tensor holding `value` in `dtype` on `device`; cached, except while a CUDA graph is being
    captured (the graph's private memory pool must not own a tensor that outlives it)."""
    key = (float(value), dtype, torch.device(device))
    cached = _CONSTANTS.get(key)
    if cached is not None:
        return cached
    scalar = torch.full((1,), float(value), dtype=dtype, device=device)
    if not (scalar.is_cuda and torch.cuda.is_current_stream_capturing()):
        _CONSTANTS[key] = scalar
    return scalar
