"""Decode indexer scores as one Triton kernel: the `decode_indexer_scores` op family (contract and math:
`megatron_dsa.ops.indexer.decode_indexer_scores`).

A decode step scores one query row per sequence against that sequence's cached compressed keys, which the
inference cache keeps contiguous (`[B, C, DI]`): the kernel reads them where they lie, with no candidate ids
and no gathered copy. The training kernel (`indexer.py`) would need a `[B, C]` id matrix and tiles rows
of many queries against shared keys; here every sequence has one query, so each key is read once and used
once, and the read of the keys sets the time (B = 32 sequences of 32768 keys of 128 bf16 values: 268 MB,
about 56 µs at an H200's 4.8 TB/s).

Grid `(B, column ranges)`: one sequence has too few keys to fill the GPU with one program, so each sequence's
columns are cut into ranges, from the shapes alone (never from the counts, so a captured CUDA graph serves
every step): about `PROGRAMS_PER_SM` programs per multiprocessor, each a whole number of `BLOCK_C`-key steps.
Ranges past a sequence's count only write −inf.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import interpreting, require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.tiles import MIN_DOT, cdiv, dot_precision, on_device, pow2, programs_in_wave
from megatron_dsa.ops.fp8_linear import FP8_MAX
from megatron_dsa.ops.indexer import FP8_KEYS, check_decode_indexer_inputs

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KEY_DTYPES = SUPPORTED_DTYPES + (FP8_KEYS,)  # e4m3 keys come with key_scales (an FP8 cache)
MIN_FP8_DOT_K = 32  # an e4m3 MMA's shortest contraction: narrower head dims are zero-padded up to it
# Keys per step: a [128, 128] bf16 tile is 32 KiB, three pipeline stages of it fit in shared memory with room
# for a second program per multiprocessor; float32 tiles take twice the bytes and registers, so half the keys.
BLOCK_C = {torch.float32: 64, torch.bfloat16: 128, torch.float16: 128}
# Programs per multiprocessor the column ranges aim at: a few resident at once keep enough key loads in flight
# to cover memory latency, and more, shorter ranges shrink the last wave's idle tail.
PROGRAMS_PER_SM = 8
STAGES = 3
WARPS = 4
# e4m3 keys are half the bytes: twice the keys per step keep a step's bytes, and 8 warps at 4 programs per
# multiprocessor (H200, B = 32, 32768 keys: 45.3 µs against 54.0 with the bf16 keys' launch, the same scores
# bit for bit; 512 keys per step or 4 stages were slower).
FP8_BLOCK_C = 256
FP8_WARPS = 8
FP8_PROGRAMS_PER_SM = 4
# The dot's orientation (kernel docstring): keys-major keeps the sum over heads inside each warp.
KEYS_MAJOR = True
INTERPRETER_BLOCK_C = 16  # several steps per range even on the tests' small caches


def column_ranges(batch: int, columns: int, block_c: int, device: torch.device,
                  programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Column ranges per sequence (the grid's second axis), from the shapes alone (module docstring)."""
    return max(1, min(cdiv(programs_in_wave(device, programs_per_sm), batch), cdiv(columns, block_c)))


def decode_indexer_scores(q: Tensor, keys: Tensor, weights: Tensor, counts: Tensor, scale: float,
                          key_scales: Optional[Tensor] = None, ranges: Optional[int] = None) -> Tensor:
    """The `decode_indexer_scores` contract (`ops.indexer.decode_indexer_scores`) → `[B, C]` float32, −inf past
    each sequence's count. `ranges` overrides the column ranges per sequence (tests; default `column_ranges`)."""
    check_decode_indexer_inputs(q, keys, weights, counts, key_scales)
    if q.dtype not in SUPPORTED_DTYPES or keys.dtype not in KEY_DTYPES:
        raise TypeError(f"triton decode indexer runs q of {[str(d) for d in SUPPORTED_DTYPES]} and keys of "
                        f"{[str(d) for d in KEY_DTYPES]}, got q {q.dtype} and keys {keys.dtype}")
    require_triton(q.device, "decode indexer", "q's device")
    batch, heads, dim = q.shape
    width = keys.shape[1]
    scores = torch.empty((batch, width), dtype=torch.float32, device=q.device)
    if scores.numel() == 0:
        return scores
    fp8 = key_scales is not None
    block_c = INTERPRETER_BLOCK_C if interpreting() else (FP8_BLOCK_C if fp8 else BLOCK_C[q.dtype])
    if ranges is None:
        ranges = column_ranges(batch, width, block_c, q.device, FP8_PROGRAMS_PER_SM if fp8 else PROGRAMS_PER_SM)
    if ranges < 1:
        raise ValueError(f"triton decode indexer: ranges must be >= 1, got {ranges}")
    per_range = cdiv(cdiv(width, ranges), block_c) * block_c
    if weights.stride(1) != 1:  # rows of heads apart are read where they lie (a column slice), scattered heads not
        weights = weights.contiguous()
    with on_device(q.device):
        launcher(_kernels().decode_indexer_scores_kernel)[(batch, cdiv(width, per_range))](
            q.contiguous(), keys.contiguous(), key_scales.contiguous() if fp8 else scores,
            weights, counts.contiguous(), scores, width, heads, dim, weights.stride(0), per_range, float(scale),
            BLOCK_H=pow2(heads, MIN_DOT), BLOCK_D=pow2(dim, MIN_FP8_DOT_K if fp8 else MIN_DOT),
            BLOCK_C=block_c,
            PRECISION=dot_precision(q.dtype), KEYS_MAJOR=KEYS_MAJOR, KEY_SCALES=fp8,
            FP8_MAX=FP8_MAX, INV_FP8_MAX=1.0 / FP8_MAX, TINY=torch.finfo(torch.float32).tiny,
            num_warps=FP8_WARPS if fp8 else WARPS, num_stages=STAGES, **chained_launch(q.device))
    return scores


def _kernels():
    from megatron_dsa.backends.triton_kernels import _decode_indexer_kernels

    return _decode_indexer_kernels

