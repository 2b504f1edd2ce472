"""The `triton` backend: our own Triton kernels (`backends/triton_kernels/`), on any CUDA GPU Triton
supports (tuned for Hopper) and, for tests, on CPU under the interpreter when requested by name."""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping, Optional

import torch

from megatron_dsa.backends import probes
from megatron_dsa.backends.registry import Backend, OpFamily, backend_named, register_backend
from megatron_dsa.backends.triton_kernels import (compressor, decode_append, decode_attention, decode_compressor,
                                                  decode_indexer, dense_attention, fp8_gemm, indexer, indexer_loss,
                                                  norm_rope, paged_rows, rms_norm, rope, selection, sparse_attention,
                                                  topk_order)
from megatron_dsa.backends.triton_kernels.availability import triton_decline_reason
from megatron_dsa.ops.indexer_loss import indexer_kl

# The kernels accumulate in float32; float64 stays on the unfused reference path.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# RoPE, RMSNorm (+ RoPE), the compressor's pooling and the selection rows also run float64 (elementwise,
# row reductions, copies).
DTYPES = {op: KERNEL_DTYPES + (torch.float64,)
          for op in (OpFamily.ROPE, OpFamily.NORM_ROPE, OpFamily.RMS_NORM, OpFamily.COMPRESSOR,
                     OpFamily.SELECTION_ROWS)}


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    explicit = bool(call.get("explicit"))
    return probes.first_problem(
        triton_decline_reason(call.get("device"), explicit),
        probes.dtype_problem(call, DTYPES.get(op, KERNEL_DTYPES)),
        _topk_width_problem(call, explicit) if op is OpFamily.TOPK else None,
        _fp8_keys_problem(call) if op in (OpFamily.DECODE_INDEXER_SCORES, OpFamily.DECODE_COMPRESSOR) else None,
        probes.fp8_capability_problem(call.get("device"), "FP8 attention rows")
        if op in (OpFamily.PAGED_ROWS_WRITE, OpFamily.PAGED_DECODE_ATTENTION) else None,
        _fp8_gemm_problem(call, explicit) if op is OpFamily.FP8_GEMM else None,
        decode_compressor.rotate_problem(call.get("head_dim"), call.get("rotate"))
        if op is OpFamily.DECODE_COMPRESSOR else None,
        probes.dense_problem(call, max_head_dim=dense_attention.MAX_HEAD_DIM, alignment=1)
        if op in DENSE_FAMILIES else None,
        _dense_float32_problem(call, explicit) if op in DENSE_FAMILIES else None,
    )


DENSE_FAMILIES = (OpFamily.DENSE_ATTENTION, OpFamily.DENSE_ATTENTION_BLOCK_FWD, OpFamily.DENSE_ATTENTION_BLOCK_BWD)


def _dense_float32_problem(call: Mapping[str, Any], explicit: bool) -> Optional[str]:
    """float32 tiles of the M kind's head dims leave the dense kernels blocks of 32 rows or fewer: `auto` keeps
    float32 on the reference (named, the kernels run)."""
    if call.get("dtype") != torch.float32 or explicit:
        return None
    return ("float32 dense attention runs faster on the unfused reference (H200, dsv4 M layer step: 1110 ms "
            "through these kernels against 246 ms); name 'triton' to run it")


def _fp8_keys_problem(call: Mapping[str, Any]) -> Optional[str]:
    """Triton converts e4m3 on GPUs of compute capability 8.9 and up (and in the interpreter)."""
    if call.get("key_dtype") != decode_indexer.FP8_KEYS:
        return None
    return probes.fp8_capability_problem(call.get("device"), "FP8 keys")


def _fp8_gemm_problem(call: Mapping[str, Any], explicit: bool) -> Optional[str]:
    """The few-rows FP8 GEMM: e4m3 MMAs (compute capability 8.9 and up); `auto` takes it for a known few rows
    (`fp8_gemm` says why), cuBLASLt's for more."""
    rows = call.get("rows")
    few = explicit or (rows is not None and rows <= fp8_gemm.MAX_AUTO_ROWS)
    return probes.first_problem(
        probes.fp8_capability_problem(call.get("device"), "FP8 GEMMs"),
        # The reason names no row count: `auto` logs each (choice, reasons) once, not once per batch shape.
        None if few else (f"{'rows unknown' if rows is None else 'more rows'}: `auto` takes it for at most "
                          f"{fp8_gemm.MAX_AUTO_ROWS} rows, cuBLASLt's FP8 GEMM (torch_scaled_mm) is the faster above"))


def _topk_width_problem(call: Mapping[str, Any], explicit: bool) -> Optional[str]:
    """Rows of up to `AUTO_MAX_COLUMNS` are sorted whole; wider rows are selected and their k picks sorted,
    which `auto` takes only for a known few rows (a decode step's) and only where cuDNN's top-k declines the
    call (asked through the registry, so its rules live in one place): `topk_order` gives the times."""
    columns, k, rows = call.get("columns"), call.get("topk"), call.get("rows")
    if columns is None:
        return None
    if k is not None and min(k, columns) > topk_order.MAX_WIDTH:
        return f"top-k {k} exceeds the {topk_order.MAX_WIDTH} picks one program sorts"
    if columns <= topk_order.AUTO_MAX_COLUMNS or explicit:
        return None
    if rows is None or rows > topk_order.SELECT_AUTO_MAX_ROWS:
        return (f"{columns} columns per row over {'an unknown number of' if rows is None else rows} rows: above "
                f"{topk_order.AUTO_MAX_COLUMNS} columns the register sort is slower than cuDNN's top-k and torch's "
                f"sort, and `auto` gives the select-then-sort path at most {topk_order.SELECT_AUTO_MAX_ROWS} rows")
    cudnn = backend_named("cudnn")
    if cudnn is None or cudnn.decline_reason(OpFamily.TOPK, call) is not None:
        return None
    return (f"{columns} columns per row: cuDNN's top-k selects wide rows faster than the Triton select "
            "('auto' leaves them to 'cudnn'; name 'triton' to run it)")


TRITON = Backend(
    name="triton",
    ops={
        OpFamily.SPARSE_ATTENTION_FWD: sparse_attention.sparse_attention_forward,
        OpFamily.SPARSE_ATTENTION_BWD: sparse_attention.sparse_attention_backward,
        OpFamily.INDEXER_SCORES: indexer.indexer_scores,
        OpFamily.TOPK: topk_order.topk,
        OpFamily.SELECTION_ROWS: selection.selection_rows,
        OpFamily.INDEXER_LOSS: partial(indexer_kl, mass=indexer_loss.attention_mass, kl=indexer_loss.kl_per_row),
        OpFamily.INDEXER_KL_BWD: indexer.indexer_kl_backward,
        OpFamily.COMPRESSOR: compressor.compress,
        OpFamily.ROPE: rope.rope,
        OpFamily.NORM_ROPE: norm_rope.norm_rope,
        OpFamily.RMS_NORM: rms_norm.rms_norm,
        OpFamily.DECODE_ATTENTION: decode_attention.decode_attention,
        OpFamily.DECODE_INDEXER_SCORES: decode_indexer.decode_indexer_scores,
        OpFamily.DECODE_COMPRESSOR: decode_compressor.decode_compress,
        OpFamily.DECODE_APPEND: decode_append.append_rows,
        OpFamily.PAGED_ROWS_WRITE: paged_rows.write_decode_rows,
        OpFamily.PAGED_DECODE_ATTENTION: decode_attention.paged_decode_attention,
        OpFamily.DENSE_ATTENTION: dense_attention.dense_attention,
        OpFamily.DENSE_ATTENTION_BLOCK_FWD: dense_attention.block_forward,
        OpFamily.DENSE_ATTENTION_BLOCK_BWD: dense_attention.block_backward,
        OpFamily.FP8_GEMM: fp8_gemm.fp8_gemm,
    },
    probe=probe,
    version=lambda: probes.versions_line("triton"),
)

register_backend(TRITON)
