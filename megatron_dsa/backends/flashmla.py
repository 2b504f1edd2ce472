"""The `flashmla` backend: FlashMLA's sparse prefill forward (`flash_mla.flash_mla_sparse_fwd`).

FlashMLA is an optional dependency built from source (docs/kernels.md says how); it has no backward,
so it serves `sparse_attention_fwd` only and pairs with the cuDNN (or reference) backward.

Contract glue: q `[N, H, D]` with heads padded to 64/128 (zero queries, −inf sinks: a −inf sink has
no effect on the output; a chunk of rows at a time, `sparse_layout.padded_row_chunks`), kv `[M, 1, D]`,
ids `[N, 1, K]` int32 with K padded to a multiple of 128 (the SM90 kernel's tile) with −1. FlashMLA's
`attn_sink` scales the output by `exp(lse)/(exp(lse)+exp(sink))` and leaves the LSE sink-free, which is
our convention. Its LSE base
changed between FlashMLA versions (an older docstring says base 2; the current one returns natural
log), so the base is measured once with a one-key row and converted to natural log if needed.
Rows without a valid id come back with out 0 and lse +inf; we return lse −inf there.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from megatron_dsa.backends import probes
from megatron_dsa.backends.registry import Backend, OpFamily, register_backend
from megatron_dsa.backends.sparse_layout import (
    HEAD_TILE,
    empty_rows,
    heads_problem,
    kernel_ids,
    kv_rows_problem,
    pad_heads,
    padded_heads,
    padded_row_chunks,
    rows_in_chunks,
)

PACKAGE = "flash_mla"
INSTALL_HINT = "build FlashMLA from source (see docs/kernels.md, 'FlashMLA')"
HEAD_DIM = 512  # d_qk = d_v = 512: our V is the whole KV row
TOPK_ALIGNMENT = 128


def _fwd() -> Any:
    return probes.load(PACKAGE).flash_mla_sparse_fwd


@functools.lru_cache(maxsize=None)
def package_problem() -> Optional[str]:
    problem = probes.import_problem(PACKAGE, INSTALL_HINT)
    if problem is None and not hasattr(probes.load(PACKAGE), "flash_mla_sparse_fwd"):
        return f"this flash_mla build has no flash_mla_sparse_fwd (sparse prefill); {INSTALL_HINT}"
    return problem


def _run(query: Tensor, kv: Tensor, ids: Tensor, sink: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    result = _fwd()(query, kv.unsqueeze(1).contiguous(), ids.unsqueeze(1), float(scale),
                    d_v=kv.shape[-1], attn_sink=sink)
    return result[0], result[2]  # (out, max_logits, lse[, lse_indexer])


@functools.lru_cache(maxsize=None)
def _lse_is_base2(device: torch.device, dtype: torch.dtype) -> bool:
    """One row, one key with logit exactly 1: a natural-log LSE is 1, a base-2 one log2(e)."""
    kv = torch.zeros(1, HEAD_DIM, dtype=dtype, device=device)
    kv[0, 0] = 1.0
    query = torch.zeros(1, HEAD_TILE, HEAD_DIM, dtype=dtype, device=device)
    query[:, :, 0] = 1.0
    ids = torch.full((1, TOPK_ALIGNMENT), -1, dtype=torch.int32, device=device)
    ids[0, 0] = 0
    sink = torch.full((HEAD_TILE,), float("-inf"), device=device)
    _, lse = _run(query, kv, ids, sink, 1.0)
    return abs(float(lse[0, 0]) - math.log2(math.e)) < abs(float(lse[0, 0]) - 1.0)


def sparse_attention_forward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                             scale: float) -> tuple[Tensor, Tensor]:
    """The `sparse_attention_fwd` contract on `flash_mla.flash_mla_sparse_fwd` (see the module doc)."""
    rows, heads, head_dim = query.shape
    width = padded_heads(heads)
    ids = kernel_ids(indices, kv.shape[0], TOPK_ALIGNMENT)
    padded_sink = pad_heads(sink.float(), width, float("-inf"))

    def run(chunk: slice) -> tuple[Tensor, Tensor]:
        out, lse = _run(pad_heads(query[chunk], width), kv, ids[chunk], padded_sink, scale)
        return out[:, :heads], lse[:, :heads].float()

    out, lse = rows_in_chunks(run, padded_row_chunks(rows, heads, head_dim), rows)
    if _lse_is_base2(query.device, query.dtype):
        lse = lse * math.log(2.0)
    # Rows without keys: FlashMLA writes out = 0 (its reference defines it so) and lse = +inf; ours is −inf.
    # The output is not passed through a mask: that was a full strided pass over [N, H, D] (0.35 ms at
    # S = 4096 on an H200), and the GPU test checks the zeros.
    lse = torch.where(empty_rows(indices, kv.shape[0]).unsqueeze(1), float("-inf"), lse)
    return out.to(query.dtype).contiguous(), lse.contiguous()


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    heads = call.get("heads")
    return probes.first_problem(
        package_problem(),
        probes.gpu_problem(call, (9, 10), "FlashMLA sparse prefill"),
        probes.dtype_problem(call, (torch.bfloat16,)),
        probes.head_dim_problem(call, HEAD_DIM),
        heads_problem(heads) if heads is not None else None,
        kv_rows_problem(call),
    )


FLASHMLA = Backend(
    name="flashmla",
    ops={OpFamily.SPARSE_ATTENTION_FWD: sparse_attention_forward},
    probe=probe,
    version=lambda: probes.versions_line("flash_mla"),
)

register_backend(FLASHMLA)
