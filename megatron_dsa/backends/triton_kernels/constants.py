"""Scalars the Triton kernels read through a pointer (RMSNorm eps, RoPE amplitude), made once per value.

A pointer, not a kernel argument, keeps a float64 value exact (Triton passes float scalars as fp32).
Each is a `[1]` tensor made by a fill kernel (no host-to-device copy: no sync, CUDA-graph capturable)
and kept for later calls, so a layer step does not launch one fill per op; kernels only read them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.ops.device_cache import DeviceCache

_CONSTANTS: DeviceCache[Tensor] = DeviceCache()


def device_scalar(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`[1]` tensor holding `value` in `dtype` on `device`; cached, except while a CUDA graph is being
    captured (the graph's private memory pool must not own a tensor that outlives it)."""
    return _CONSTANTS.get((float(value), dtype, torch.device(device)), device,
                          lambda: torch.full((1,), float(value), dtype=dtype, device=device))
