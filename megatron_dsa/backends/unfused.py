"""The `unfused` backend: the readable PyTorch reference ops. Runs everywhere, never declines."""

from __future__ import annotations

import torch

from megatron_dsa.backends.registry import Backend, OpFamily, register_backend
from megatron_dsa.ops.compressor import compress
from megatron_dsa.ops.decode_append import append_rows
from megatron_dsa.ops.decode_attention import decode_attention, paged_decode_attention
from megatron_dsa.ops.decode_compressor import decode_compress
from megatron_dsa.ops.dense_attention import block_attention_backward, block_attention_forward, causal_attention
from megatron_dsa.ops.fp8_linear import fp8_gemm_reference
from megatron_dsa.ops.indexer import decode_indexer_scores, indexer_scores
from megatron_dsa.ops.indexer_loss import indexer_kl, indexer_kl_backward
from megatron_dsa.ops.indices import selection_rows, topk_columns
from megatron_dsa.ops.norms import rms_norm
from megatron_dsa.ops.paged_rows import write_decode_rows
from megatron_dsa.ops.rope import norm_rope, rope
from megatron_dsa.ops.sparse_attention import sparse_attention_backward, sparse_attention_forward

UNFUSED = Backend(
    name="unfused",  # last in every row of `AUTO_ORDER`: the fallback that never declines
    ops={
        OpFamily.SPARSE_ATTENTION_FWD: sparse_attention_forward,
        OpFamily.SPARSE_ATTENTION_BWD: sparse_attention_backward,
        OpFamily.INDEXER_SCORES: indexer_scores,
        OpFamily.TOPK: topk_columns,
        OpFamily.SELECTION_ROWS: selection_rows,
        OpFamily.INDEXER_LOSS: indexer_kl,
        OpFamily.INDEXER_KL_BWD: indexer_kl_backward,
        OpFamily.COMPRESSOR: compress,
        OpFamily.ROPE: rope,
        OpFamily.NORM_ROPE: norm_rope,
        OpFamily.RMS_NORM: rms_norm,
        OpFamily.DENSE_ATTENTION: causal_attention,
        OpFamily.DENSE_ATTENTION_BLOCK_FWD: block_attention_forward,
        OpFamily.DENSE_ATTENTION_BLOCK_BWD: block_attention_backward,
        OpFamily.DECODE_ATTENTION: decode_attention,
        OpFamily.DECODE_INDEXER_SCORES: decode_indexer_scores,
        OpFamily.DECODE_COMPRESSOR: decode_compress,
        OpFamily.DECODE_APPEND: append_rows,
        OpFamily.PAGED_DECODE_ATTENTION: paged_decode_attention,
        OpFamily.PAGED_ROWS_WRITE: write_decode_rows,
        OpFamily.FP8_GEMM: fp8_gemm_reference,
    },
    version=lambda: f"torch {torch.__version__}",
)

register_backend(UNFUSED)
