"""A decode step's compressor write as one Triton kernel: the `decode_compressor` op family (contract and math:
`megatron_dsa.ops.decode_compressor.decode_compress`).

Composed from the training ops, a decode step's write of one compressor was about ten launches of a microsecond
or two each on a few KiB (write the new slot, reorder the slots, pool, RMSNorm + RoPE, Hadamard, for an FP8
cache the row's amax, scale and codes, write the entry and its scale), and a CUDA-graph replay pays the gap
between launches as well as the launches. Here one program per sequence does all of it, holding the entry in
registers (`_decode_compressor_kernels.py`): the new row is read once, the K slot rows once, the entry written
once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.rms_norm import eps_tensor
from megatron_dsa.backends.triton_kernels.tiles import cdiv, on_device, pow2
from megatron_dsa.ops.compressor import channel_factor
from megatron_dsa.ops.decode_compressor import check_decode_compress_inputs
from megatron_dsa.ops.fp8_linear import FP8_MAX
from megatron_dsa.ops.indexer import FP8_KEYS
from megatron_dsa.ops.precision import compute_dtype

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The Hadamard transform runs on a [Dc/2, Dc/2] sign matrix in registers: up to the indexer's head dims.
MAX_ROTATE_DIM = 256
# Elements of one [slots, channels] tile of slot rows (kv, gate and ape each: 16 float32 values per thread of
# 8 warps, 64 of 2).
TILE_ELEMENTS = 4096
BLOCK_ROW = 1024  # the new row's copy into its slot, this many elements at a time
# Warps of a program that holds a whole entry (one launch, or a split write's finish): 8 spread the entry and its
# slot tile thinnest (H200, B = 32, graph replays: C's write 5.5 µs against 7.2 with 4 warps and 8.3 with 2).
WARPS = 8
# A split write's pooling programs (one [128, 16] tile of slots × channels each): 2 warps and 8 channel pairs
# took H's write 21.8 µs at B = 32 and 7.4 at B = 1, against 24.6 and 10.2 with 4 warps and 16 pairs
# (`benchmarks/decode_compressor.py`).
POOL_WARPS = 2
# Up to this ratio one program per sequence pools, normalises and stores its entry (C's ratio 4: two tiles of
# slots). A longer group is pooled over (sequence, channel block) programs first and finished in a second
# launch: one program walking H's 128 slots tile after tile took 52 µs a step at B = 32 (H200), the memory's
# latency sixteen times over.
MAX_ONE_LAUNCH_RATIO = 8
SPLIT_PAIRS = 8  # channel pairs per pooling program of a split write: all 128 slots of 16 channels in one tile


def rotate_problem(head_dim: Optional[int], rotate: Optional[bool]) -> Optional[str]:
    """Why the kernel cannot apply the Hadamard transform to entries of `head_dim` channels (None: it can)."""
    if not rotate or head_dim is None:
        return None
    if head_dim & (head_dim - 1) or head_dim > MAX_ROTATE_DIM:
        return f"the in-kernel Hadamard transform takes power-of-two head dims up to {MAX_ROTATE_DIM}, got {head_dim}"
    return None


def decode_compress(state: Tensor, new_rows: Tensor, positions: Tensor, ape: Tensor, norm_weight: Tensor, eps: float,
                    inv_freq: Tensor, rotate: bool, store: Tensor, scales: Optional[Tensor] = None,
                    counts: Optional[Tensor] = None) -> None:
    """The `decode_compressor` contract (`ops.decode_compressor.decode_compress`), in place."""
    check_decode_compress_inputs(state, new_rows, positions, ape, norm_weight, inv_freq, store, scales, counts)
    if state.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton decode compressor runs state of {[str(d) for d in SUPPORTED_DTYPES]}, got "
                        f"{state.dtype}")
    require_triton(state.device, "decode compressor", "state's device")
    for name, buffer in (("state", state), ("store", store), ("scales", scales)):
        if buffer is not None and not buffer.is_contiguous():
            raise ValueError(f"triton decode compressor writes {name} in place: it must be contiguous")
    batch, slots, row_width = state.shape
    ratio, dc = ape.shape[0], store.shape[-1]
    problem = rotate_problem(dc, rotate)
    if problem is not None:
        raise ValueError(f"triton decode compressor: {problem}")
    if new_rows.stride(-1) != 1:
        new_rows = new_rows.contiguous()
    compute = compute_dtype(state.dtype)
    eps_t = eps_tensor(eps, "decode compressor", compute, state.device)
    args = [state, new_rows, positions.contiguous(), ape.contiguous(), norm_weight.contiguous(),
            inv_freq.to(state.device, compute).contiguous(), eps_t, store, state if scales is None else scales,
            positions if counts is None else counts]
    sizes = [new_rows.stride(0), store.shape[1]]
    constants = dict(SLOTS=slots, RATIO=ratio, COFF=channel_factor(ratio), DC=dc, HALF=inv_freq.shape[0],
                     ROTATE=bool(rotate), FP8=store.dtype == FP8_KEYS, BLOCK_ROW=min(BLOCK_ROW, pow2(row_width)),
                     HADAMARD_SCALE=dc ** -0.5 if rotate else 1.0, FP8_MAX=FP8_MAX, INV_FP8_MAX=1.0 / FP8_MAX,
                     TINY=torch.finfo(torch.float32).tiny, COUNTS=counts is not None)
    whole = pow2(dc // 2)  # the entry's channel pairs
    with on_device(state.device):
        import triton.language as tl

        kernel, chained = launcher(_kernels().decode_compress_kernel), chained_launch(state.device)
        if ratio <= MAX_ONE_LAUNCH_RATIO:
            kernel[(batch,)](*args, state, *sizes, STAGE=0, BLOCK_S=_slot_block(ratio, whole), BLOCK_P=whole,
                             LOG2_P=whole.bit_length() - 1, COMPUTE=tl.float32, num_warps=WARPS, **constants, **chained)
            return
        pooled = torch.empty((batch, dc), dtype=state.dtype, device=state.device)
        block = min(whole, SPLIT_PAIRS)
        kernel[(batch, cdiv(dc // 2, block))](*args, pooled, *sizes, STAGE=1, BLOCK_S=_slot_block(ratio, block),
                                               BLOCK_P=block, LOG2_P=block.bit_length() - 1, COMPUTE=tl.float32,
                                               num_warps=POOL_WARPS, **constants, **chained)
        kernel[(batch,)](*args, pooled, *sizes, STAGE=2, BLOCK_S=1, BLOCK_P=whole, LOG2_P=whole.bit_length() - 1,
                         COMPUTE=tl.float32, num_warps=WARPS, **constants, **chained)


def _slot_block(ratio: int, pairs: int) -> int:
    """Slots per tile: a `[slots, 2·pairs]` tile of `TILE_ELEMENTS`, at most the group."""
    return max(1, min(pow2(ratio), TILE_ELEMENTS // (2 * pairs)))


def _kernels():
    from megatron_dsa.backends.triton_kernels import _decode_compressor_kernels

    return _decode_compressor_kernels
