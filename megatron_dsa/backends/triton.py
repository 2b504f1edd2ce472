"""The `triton` backend: our own Triton kernels (`backends/triton_kernels/`), on any CUDA GPU Triton
supports (tuned for Hopper) and, for tests, on CPU under the interpreter when requested by name."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megatron_dsa.backends import probes
from megatron_dsa.backends.registry import Backend, OpFamily, register_backend
from megatron_dsa.backends.triton_kernels import indexer, rope
from megatron_dsa.backends.triton_kernels.availability import triton_decline_reason

# The kernels accumulate in float32; float64 stays on the unfused reference path.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPES = {OpFamily.INDEXER_SCORES: KERNEL_DTYPES, OpFamily.ROPE: KERNEL_DTYPES + (torch.float64,)}


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    return probes.first_problem(
        triton_decline_reason(call.get("device"), bool(call.get("explicit"))),
        probes.dtype_problem(call, DTYPES.get(op, KERNEL_DTYPES)),
    )


TRITON = Backend(
    name="triton",
    priority=15,  # after the measured vendor kernels (cuDNN, FlashMLA, FlashAttention), before unfused
    ops={OpFamily.INDEXER_SCORES: indexer.indexer_scores, OpFamily.ROPE: rope.rope},
    probe=probe,
    version=lambda: probes.versions_line("triton"),
)

register_backend(TRITON)
