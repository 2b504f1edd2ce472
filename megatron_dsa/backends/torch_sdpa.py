"""The `torch_sdpa` backend: torch's own fused attention kernels (the aten ops behind
`scaled_dot_product_attention` that also return the logsumexp) for the dense `M` kind.

They take batched `[B, H, S, D]` tensors, so this backend serves whole-sequence batches
(`TokenLayout.uniform`) and declines packed/padded layouts. On CUDA it runs the memory-efficient
kernel (any qk/v head dims); on CPU torch's flash kernel, which needs equal head dims, so the
smaller side is zero-padded (zero dims add nothing to the logits or the output). The CPU kernel
serves explicit requests only: `auto` on a CPU keeps the reference. The LSE carries no gradient
(torch marks it non-differentiable), so calls needing `lse_grad` are declined.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_dsa.backends import probes
from megatron_dsa.backends.dense_layout import batched_dense_attention, expand_groups, from_batch, to_batch
from megatron_dsa.backends.registry import Backend, OpFamily, register_backend
from megatron_dsa.ops.precision import compute_dtype


def _efficient(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                                      scale=scale)[:2]
    return out, lse


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda t: F.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(pad(q), pad(k), pad(v), 0.0, True,
                                                                          scale=scale)
    return out[..., :v.shape[-1]], lse


def _kernel(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return (_efficient if q.device.type == "cuda" else _cpu_flash)(q, k, v, scale)


# ---------------------------------------------------------------- blocks of the context-parallel ring
def _batched_block(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`q [n, H, D]`, `k/v [m, G, D]` → `[1, H, n|m, D]` (GQA groups expanded to the query heads)."""
    heads = q.shape[1]
    return to_batch(q, 1, q.shape[0]), to_batch(expand_groups(k, heads), 1, k.shape[0]), \
        to_batch(expand_groups(v, heads), 1, v.shape[0])


def _rows_first(lse: Tensor, rows: int) -> Tensor:
    """A kernel's `[1, H, ≥n]` (or `[1, H, n, 1]`) LSE → `[n, H]` in its float dtype."""
    return lse.reshape(lse.shape[1], -1)[:, :rows].transpose(0, 1)


def _group_sum(grad: Tensor, groups: int) -> Tensor:
    """`[1, H, m, D]` gradient of expanded K/V → `[m, G, D]` (the query heads of a group share it)."""
    grad = from_batch(grad)
    return grad if grad.shape[1] == groups else grad.view(grad.shape[0], groups, -1, grad.shape[-1]).sum(2)


def _pad_to(t: Tensor, width: int) -> Tensor:
    return F.pad(t, (0, width - t.shape[-1]))


def block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """The `dense_attention_block_fwd` contract on torch's kernels: CUDA's memory-efficient one (any qk/v
    head dims) or, on the CPU, its flash kernel (head dims zero-padded to one width). `causal` is the
    kernels' `is_causal` (top-left aligned: query `i` sees keys `≤ i`, the diagonal block). Results in the
    compute dtype, as the family's contract says."""
    bq, bk, bv = _batched_block(q, k, v)
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(bq, bk, bv, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
    else:
        width = max(q.shape[-1], v.shape[-1])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad_to(bq, width), _pad_to(bk, width), _pad_to(bv, width), 0.0, causal, scale=scale)
        out = out[..., :v.shape[-1]]
    compute = compute_dtype(q.dtype)
    return from_batch(out).to(compute), _rows_first(lse, q.shape[0]).to(compute)


def block_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The `dense_attention_block_bwd` contract on the backward kernels of `block_forward`, given the merged
    `out` and `lse` of every block (the kernels form `delta = <dO, O>` and `P = exp(s − lse)` from them)."""
    bq, bk, bv = _batched_block(q, k, v)
    rows, groups = q.shape[0], k.shape[1]
    b_out, b_grad = to_batch(out.to(q.dtype), 1, rows), to_batch(grad_out.to(q.dtype), 1, rows)
    b_lse = lse.transpose(0, 1).unsqueeze(0)  # [1, H, n]
    if q.device.type == "cuda":
        # The kernel reads its LSE padded to a multiple of 32 rows, as its forward returns it.
        padded = -(-rows // 32) * 32
        b_lse = F.pad(b_lse.float(), (0, padded - rows)).contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the generator state is unread
        dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            b_grad, bq, bk, bv, None, b_out, b_lse, seed, seed, 0.0, [True, True, True, False], causal,
            scale=scale)[:3]
    else:
        width = max(q.shape[-1], v.shape[-1])
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad_to(b_grad, width), _pad_to(bq, width), _pad_to(bk, width), _pad_to(bv, width),
            _pad_to(b_out, width), b_lse.to(q.dtype if q.dtype == torch.float64 else torch.float32).contiguous(),
            0.0, causal, scale=scale)
        dq, dk, dv = dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    compute = compute_dtype(q.dtype)
    return from_batch(dq).to(compute), _group_sum(dk.to(compute), groups), _group_sum(dv.to(compute), groups)


# The CUDA memory-efficient kernel's dtypes (float64 raises inside aten); the CPU kernel also takes float64.
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    device = call.get("device")
    on_cpu = device is not None and torch.device(device).type == "cpu"
    return probes.first_problem(
        "the CPU kernel runs only when 'torch_sdpa' is requested by name"
        if on_cpu and not call.get("explicit") else None,
        None if on_cpu or device is None else probes.gpu_problem(call, (8, 9, 10, 11, 12), "torch SDPA"),
        None if on_cpu else probes.dtype_problem(call, CUDA_DTYPES),
        probes.batched_layout_problem(call) if op is OpFamily.DENSE_ATTENTION else None,  # blocks: one sequence
        probes.dense_problem(call),
    )


TORCH_SDPA = Backend(
    name="torch_sdpa",
    ops={OpFamily.DENSE_ATTENTION: batched_dense_attention(_kernel),
         OpFamily.DENSE_ATTENTION_BLOCK_FWD: block_forward, OpFamily.DENSE_ATTENTION_BLOCK_BWD: block_backward},
    probe=probe,
    version=lambda: f"torch {torch.__version__}",
)

register_backend(TORCH_SDPA)
