"""A decode step's last write as one Triton kernel: the `decode_append` op family (contract:
`megatron_dsa.ops.decode_append.append_rows`).

In torch it is three launches of a microsecond or two each (the slot `seqlens % R`, the indexed copy, the length
increment), and a CUDA-graph replay pays each launch's gap too; here one program per sequence does all three
(`_decode_append_kernels.py`).
"""

from __future__ import annotations

from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.tiles import on_device, pow2
from megatron_dsa.ops.decode_append import check_append_inputs

MAX_BLOCK_D = 1024  # columns a program copies per step (a 512- or 576-wide row in one step or two)
WARPS = 4


def append_rows(buffer: Tensor, rows: Tensor, seqlens: Tensor) -> None:
    """The `decode_append` contract (`ops.decode_append.append_rows`), in place."""
    check_append_inputs(buffer, rows, seqlens)
    require_triton(buffer.device, "decode_append", "buffer's device")
    if not seqlens.is_contiguous():
        raise ValueError("triton decode_append updates seqlens in place: it must be contiguous")
    batch, slots, width = buffer.shape
    if batch == 0 or width == 0:
        seqlens += 1
        return
    with on_device(buffer.device):
        launcher(_kernels().decode_append_kernel)[(batch,)](
            buffer, rows, seqlens, slots, width, *buffer.stride(), *rows.stride(),
            BLOCK_D=min(MAX_BLOCK_D, pow2(width)), num_warps=WARPS, **chained_launch(buffer.device))


def _kernels():
    from megatron_dsa.backends.triton_kernels import _decode_append_kernels

    return _decode_append_kernels
