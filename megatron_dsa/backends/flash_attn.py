"""The `flash_attn` backend: FlashAttention-4 (`flash-attn-4`, `flash_attn.cute.flash_attn_varlen_func`)
for the dense causal attention of the `M` kind.

FA4 is CuTe-DSL (JIT-compiled at first call) and runs forward and backward on SM90/SM100, with
different qk and v head dims (192/128) and GQA. Its LSE is natural log but carries no gradient
(FA4 marks it non-differentiable), so the backend declines calls whose `lse_grad` is set.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from megatron_dsa.backends import probes
from megatron_dsa.backends.dense_layout import rows_first_lse, varlen_boundaries
from megatron_dsa.backends.registry import Backend, OpFamily, register_backend
from megatron_dsa.ops.layout import TokenLayout

PACKAGE = "flash_attn.cute"
INSTALL_HINT = "install the [flash-attn] extra (pip install 'megatron_dsa[flash-attn]')"
MAX_HEAD_DIM = 256
HEAD_DIM_ALIGNMENT = 8  # 16 bytes of bf16/fp16


def dense_attention(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout, scale: float) -> tuple[Tensor, Tensor]:
    """The `dense_attention` contract on FA4 varlen: `out [T, H, Dv]`, natural-log `lse [T, H]` fp32."""
    cu, longest = varlen_boundaries(layout)
    out, lse = probes.load(PACKAGE).flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        softmax_scale=float(scale), causal=True, return_lse=True)
    return out, rows_first_lse(lse, q.shape[0], q.shape[1])


def dense_problem(call: Mapping[str, Any]) -> Optional[str]:
    """Shape rules shared by the dense fused kernels: head dims ≤ 256 and 16-byte aligned, G | H."""
    if call.get("lse_grad"):
        return "the kernel's lse carries no gradient (lse_grad needed)"
    for name in ("head_dim", "v_head_dim"):
        dim = call.get(name)
        if dim is not None and (dim > MAX_HEAD_DIM or dim % HEAD_DIM_ALIGNMENT):
            return f"{name} {dim} unsupported (needs <= {MAX_HEAD_DIM} and a multiple of {HEAD_DIM_ALIGNMENT})"
    heads, groups = call.get("heads"), call.get("groups")
    if heads is not None and groups is not None and heads % groups:
        return f"{groups} kv groups do not divide {heads} heads"
    return None


def gqa_problem(call: Mapping[str, Any]) -> Optional[str]:
    """FA4's SM90 backward asserts `head_dim == head_dim_v` when query heads share KV heads
    (measured on an H200 with flash-attn-4 4.0.0b36: MLA dims 192/128 with GQA)."""
    capability = probes.cuda_capability(call.get("device"))
    heads, groups = call.get("heads"), call.get("groups")
    if capability is None or capability[0] != 9 or heads is None or groups is None or heads == groups:
        return None
    if call.get("head_dim") != call.get("v_head_dim"):
        return (f"FA4's SM90 backward needs qk head dim == v head dim with GQA "
                f"({heads} query heads over {groups} KV heads, {call.get('head_dim')} != {call.get('v_head_dim')})")
    return None


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    return probes.first_problem(
        probes.import_problem(PACKAGE, INSTALL_HINT),
        probes.gpu_problem(call, (9, 10, 11), "FlashAttention-4"),
        probes.dtype_problem(call, (torch.bfloat16, torch.float16)),
        dense_problem(call),
        gqa_problem(call),
    )


FLASH_ATTN = Backend(
    name="flash_attn",
    priority=30,  # the fastest dense option measured on H200 (kernels.md §7)
    ops={OpFamily.DENSE_ATTENTION: dense_attention},
    probe=probe,
    version=lambda: probes.versions_line("flash-attn-4", "nvidia-cutlass-dsl"),
)

register_backend(FLASH_ATTN)
