"""The op families as `torch.library` custom ops (`torch.ops.megatron_dsa.*`), so `torch.compile` traces a
layer whole.

Dynamo cannot trace a backend's kernels (Triton launches, cuDNN, FlashAttention calls), nor the probes
that pick the backend (imports, self-tests). Under `torch.compile` the dispatcher therefore picks the
backend while tracing (host logic, run once per compiled graph) and returns the family's adaptor
below, which calls one custom op naming that backend: the op's fake implementation gives the output
shapes, `register_autograd` its backward, and its real implementation runs the backend's kernel (and
counts the call, as eager dispatch does, so tests see which backend ran inside the compiled graph).
Eager calls never come here: they call the backend directly (no extra dispatcher hop).

Every op takes the backend name first. Structured arguments travel as tensors and host integers:
a `TokenLayout` as its fields (`_layout_args`), a `CompressedLayout` as its token layout's and its
own, `VisibleEntries` as its three tensors.

Backward:
- `sparse_attention_fwd` → `sparse_attention_bwd` (the backend's own backward kernel, chosen when the
  backward is traced, with `lse_grad` as eager dispatch asks);
- `rope` → `rope` with `inverse` flipped (the rotation's transpose is its inverse; the amplitude scales
  both);
- `norm_rope`, `rms_norm`, `compressor`, `dense_attention` → `vjp`: the backend's forward is run again
  under autograd and differentiated (these backends carry their backward inside their own autograd, so
  the gradient is exactly the eager one; the cost is one more forward of the op in backward);
- `indexer_scores`, `topk`, `selection_rows`, `indexer_loss`, `indexer_kl_bwd` take no gradient (the
  selection runs without autograd; the indexer loss's gradient is `indexer_kl_bwd`, which
  `backends.indexer_kl` calls from its backward); nor do `decode_attention`, `decode_indexer_scores`,
  `decode_compressor`, `decode_append`, `paged_decode_attention` and `paged_rows_write` (inference only;
  the appends and writes change the cache in place), nor `fp8_gemm`
  (`ops.fp8_linear.Fp8Linear` calls it for its backward GEMMs too).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from megatron_dsa.backends import registry
from megatron_dsa.backends.registry import OpFamily
from megatron_dsa.ops.compressor import channel_factor
from megatron_dsa.ops.indices import (SegmentedVisibleRows, SelectionRows, UniformVisibleRows, VisibleEntries,
                                      VisibleStructure, row_range)
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout
from megatron_dsa.ops.paged_rows import PagedRows
from megatron_dsa.ops.precision import compute_dtype

NAMESPACE = "megatron_dsa"


def _kernel(op: OpFamily, backend: str) -> Callable[..., Any]:
    """The implementation of `op` in `backend`, counted as a dispatched call."""
    registry.count_call(backend, op)
    return registry.backend_op(backend, op)


def _custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)


# ------------------------------------------------------------------------------ structured arguments
def _layout_args(layout: TokenLayout) -> tuple[list[Optional[Tensor]], list[int]]:
    """A token layout as `([cu_seqlens, seqlens, position_offsets, halo_lengths], [num_rows, max_seqlen])`."""
    return ([layout.cu_seqlens, layout.seqlens, layout.position_offsets, layout.halo_lengths],
            [layout.num_rows, layout.max_seqlen])


def _layout(tensors: Sequence[Optional[Tensor]], sizes: Sequence[int]) -> TokenLayout:
    cu_seqlens, seqlens, position_offsets, halo_lengths = tensors
    return TokenLayout(cu_seqlens=cu_seqlens, num_rows=sizes[0], max_seqlen=sizes[1], seqlens=seqlens,
                       position_offsets=position_offsets, halo_lengths=halo_lengths)


def _compressed_args(layout: CompressedLayout) -> tuple[list[Optional[Tensor]], list[int]]:
    """`(token layout tensors + [cu_compressed, first_entry], token sizes + [ratio, capacity, max_entries])`."""
    tensors, sizes = _layout_args(layout.tokens)
    return ([*tensors, layout.cu_compressed, layout.first_entry],
            [*sizes, layout.ratio, layout.capacity, layout.max_entries])


def _compressed(tensors: Sequence[Optional[Tensor]], sizes: Sequence[int]) -> CompressedLayout:
    ratio, capacity, max_entries = sizes[2:]
    return CompressedLayout(tokens=_layout(tensors[:4], sizes[:2]), ratio=ratio, cu_compressed=tensors[4],
                            capacity=capacity, max_entries=max_entries, first_entry=tensors[5])


def _visible_args(visible: Optional[VisibleStructure]) -> tuple[Optional[list[int]], list[Tensor]]:
    """The hint as a custom op's arguments: its host ints, and a segmented structure's tensors (else none)."""
    if visible is None:
        return None, []
    if isinstance(visible, SegmentedVisibleRows):
        return ([visible.ratio, visible.num_rows, visible.max_rows, visible.keys],
                [visible.cu_rows, visible.cu_keys, visible.first_positions, visible.key_rows])
    return [visible.seqlen, visible.entries, visible.ratio, visible.start, visible.stop], []


def _uniform_args(visible: Optional[UniformVisibleRows]) -> Optional[list[int]]:
    """The `topk` family's hint: the uniform-batch structure only (row segments give their prefixes as `counts`)."""
    if isinstance(visible, SegmentedVisibleRows):
        raise TypeError("the topk family's visible hint is a UniformVisibleRows; give row segments' prefixes as counts")
    return _visible_args(visible)[0]


def _visible(fields: Optional[Sequence[int]], tensors: Sequence[Tensor] = ()) -> Optional[VisibleStructure]:
    if fields is None:
        return None
    return SegmentedVisibleRows(*fields, *tensors) if tensors else UniformVisibleRows(*fields)


# ------------------------------------------------------------------------------ recomputed backward
# `call(kernel, tensors, floats, ints)` runs a family's forward through the backend's kernel; its first
# (or only) output is what the gradient flows from.
_FORWARD_CALLS: dict[str, Callable[..., Any]] = {
    OpFamily.NORM_ROPE.value: lambda kernel, t, f, i: kernel(t[0], t[1], t[2], f[0], t[3]),
    OpFamily.RMS_NORM.value: lambda kernel, t, f, i: kernel(t[0], t[1], f[0]),
    OpFamily.COMPRESSOR.value: lambda kernel, t, f, i: kernel(t[0], t[1], t[2], t[3], f[0],
                                                              _compressed(t[5:], i[1:]), t[4], bool(i[0])),
    OpFamily.DENSE_ATTENTION.value: lambda kernel, t, f, i: kernel(t[0], t[1], t[2], _layout(t[3:], i), f[0])[0],
}


def _autograd_inside_op() -> Any:
    """Record autograd again inside a custom op's implementation, which the dispatcher runs with the
    autograd keys excluded (removing the Autograd functionality removes it for every device)."""
    keys = torch._C.DispatchKey
    excluded = (torch._C._dispatch_tls_local_exclude_set() - torch._C.DispatchKeySet(keys.AutogradCPU)
                - torch._C.DispatchKeySet(keys.ADInplaceOrView))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


@_custom_op("vjp")
def vjp(family: str, backend: str, tensors: list[Optional[Tensor]], floats: list[float], ints: list[int],
        wrt: list[int], grad: Tensor) -> list[Tensor]:
    """Gradients `[len(wrt)]` of `family`'s forward in `backend` with respect to `tensors[i]` for `i` in
    `wrt` (each present), given the gradient `grad` of its output: the forward runs again under autograd.
    The gradient of an input the output does not depend on is zeros."""
    call = _FORWARD_CALLS[family]
    kernel = registry.backend_op(backend, OpFamily(family))
    with torch.enable_grad(), _autograd_inside_op():
        inputs = [t.detach().requires_grad_() if i in wrt else t for i, t in enumerate(tensors)]
        out = call(kernel, inputs, floats, ints)
        grads = torch.autograd.grad(out, [inputs[i] for i in wrt], grad, allow_unused=True)
    return [torch.zeros_like(tensors[i]) if g is None else g for i, g in zip(wrt, grads)]


@vjp.register_fake
def _(family, backend, tensors, floats, ints, wrt, grad):
    return [torch.empty_like(tensors[i]) for i in wrt]


def _present(tensors: Sequence[Optional[Tensor]], wrt: Sequence[int]) -> list[int]:
    return [i for i in wrt if tensors[i] is not None]


def _recomputed_backward(ctx, grad: Tensor) -> dict[int, Tensor]:
    """`{tensor slot: gradient}` of the slots `ctx.wrt` through `vjp` (see `_save_for_recompute`)."""
    tensors = list(ctx.saved_tensors)
    tensors = [tensors[k] if k is not None else None for k in ctx.saved_slot]
    wrt = _present(tensors, ctx.wrt)
    return dict(zip(wrt, vjp(ctx.family, ctx.backend, tensors, ctx.floats, ctx.ints, wrt, grad)))


def _save_for_recompute(ctx, family: OpFamily, backend: str, tensors: Sequence[Optional[Tensor]],
                        floats: list[float], ints: list[int], wrt: Sequence[int]) -> None:
    present = [t for t in tensors if t is not None]
    ctx.save_for_backward(*present)
    slots, k = [], 0
    for t in tensors:
        slots.append(None if t is None else k)
        k += t is not None
    ctx.saved_slot, ctx.family, ctx.backend = slots, family.value, backend
    ctx.floats, ctx.ints, ctx.wrt = floats, ints, list(wrt)


# ------------------------------------------------------------------------------ rope, norms
@_custom_op("rope")
def rope_op(backend: str, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool,
            amplitude: float) -> Tensor:
    """`rope` family: `x [T, Dh]` or `[T, H, Dh]` rotated at `positions [T]` (new storage)."""
    return _kernel(OpFamily.ROPE, backend)(x, positions, inv_freq, inverse=inverse, amplitude=amplitude)


@rope_op.register_fake
def _(backend, x, positions, inv_freq, inverse, amplitude):
    return torch.empty_like(x)


def _rope_setup(ctx, inputs, output):
    ctx.backend, ctx.inverse, ctx.amplitude = inputs[0], inputs[4], inputs[5]
    ctx.save_for_backward(inputs[2], inputs[3])


def _rope_backward(ctx, grad: Tensor):
    positions, inv_freq = ctx.saved_tensors
    # The rotation's transpose is the opposite rotation, scaled by the same amplitude.
    return None, rope_op(ctx.backend, grad, positions, inv_freq, not ctx.inverse, ctx.amplitude), None, None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


@_custom_op("norm_rope")
def norm_rope_op(backend: str, x: Tensor, positions: Tensor, inv_freq: Tensor, eps: float,
                 weight: Optional[Tensor]) -> Tensor:
    """`norm_rope` family: `rope(rms_norm(x, weight, eps), positions, inv_freq)`, shaped like `x`."""
    return _kernel(OpFamily.NORM_ROPE, backend)(x, positions, inv_freq, eps, weight)


@norm_rope_op.register_fake
def _(backend, x, positions, inv_freq, eps, weight):
    return torch.empty_like(x)


def _norm_rope_setup(ctx, inputs, output):
    backend, x, positions, inv_freq, eps, weight = inputs
    _save_for_recompute(ctx, OpFamily.NORM_ROPE, backend, [x, positions, inv_freq, weight], [eps], [], (0, 3))


def _norm_rope_backward(ctx, grad: Tensor):
    grads = _recomputed_backward(ctx, grad)
    return None, grads[0], None, None, None, grads.get(3)


norm_rope_op.register_autograd(_norm_rope_backward, setup_context=_norm_rope_setup)


@_custom_op("rms_norm")
def rms_norm_op(backend: str, x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """`rms_norm` family: `x [..., D]` normalised over D (times `weight [D]` when given)."""
    return _kernel(OpFamily.RMS_NORM, backend)(x, weight, eps)


@rms_norm_op.register_fake
def _(backend, x, weight, eps):
    return torch.empty_like(x)


def _rms_norm_setup(ctx, inputs, output):
    backend, x, weight, eps = inputs
    _save_for_recompute(ctx, OpFamily.RMS_NORM, backend, [x, weight], [eps], [], (0, 1))


def _rms_norm_backward(ctx, grad: Tensor):
    grads = _recomputed_backward(ctx, grad)
    return None, grads[0], grads.get(1), None


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


# ------------------------------------------------------------------------------ compressor
@_custom_op("compressor")
def compressor_op(backend: str, kv: Tensor, gate: Tensor, ape: Tensor, norm_weight: Tensor, eps: float,
                  inv_freq: Tensor, rotate: bool, layout_tensors: list[Optional[Tensor]],
                  layout_sizes: list[int]) -> Tensor:
    """`compressor` family: `[capacity, Dc]` entries of the `CompressedLayout` given as `_compressed_args`."""
    layout = _compressed(layout_tensors, layout_sizes)
    return _kernel(OpFamily.COMPRESSOR, backend)(kv, gate, ape, norm_weight, eps, layout, inv_freq, rotate)


@compressor_op.register_fake
def _(backend, kv, gate, ape, norm_weight, eps, inv_freq, rotate, layout_tensors, layout_sizes):
    ratio, capacity = layout_sizes[2], layout_sizes[3]
    return kv.new_empty(capacity, kv.shape[-1] // channel_factor(ratio))


def _compressor_setup(ctx, inputs, output):
    backend, kv, gate, ape, norm_weight, eps, inv_freq, rotate, layout_tensors, layout_sizes = inputs
    _save_for_recompute(ctx, OpFamily.COMPRESSOR, backend, [kv, gate, ape, norm_weight, inv_freq, *layout_tensors],
                        [eps], [int(rotate), *layout_sizes], (0, 1, 2, 3))


def _compressor_backward(ctx, grad: Tensor):
    grads = _recomputed_backward(ctx, grad)
    return None, grads[0], grads[1], grads[2], grads[3], None, None, None, None, None


compressor_op.register_autograd(_compressor_backward, setup_context=_compressor_setup)


# ------------------------------------------------------------------------------ dense attention (M)
@_custom_op("dense_attention")
def dense_attention_op(backend: str, q: Tensor, k: Tensor, v: Tensor, layout_tensors: list[Optional[Tensor]],
                       layout_sizes: list[int], scale: float) -> tuple[Tensor, Tensor]:
    """`dense_attention` family: causal attention within each segment of the `TokenLayout` given as
    `_layout_args` → `(out [T, H, Dv], lse [T, H])`. The `lse` output takes no gradient."""
    out, lse = _kernel(OpFamily.DENSE_ATTENTION, backend)(q, k, v, _layout(layout_tensors, layout_sizes), scale)
    return out, lse


@dense_attention_op.register_fake
def _(backend, q, k, v, layout_tensors, layout_sizes, scale):
    return (q.new_empty(*q.shape[:2], v.shape[-1]),
            q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype)))


def _dense_attention_setup(ctx, inputs, output):
    backend, q, k, v, layout_tensors, layout_sizes, scale = inputs
    ctx.mark_non_differentiable(output[1])
    _save_for_recompute(ctx, OpFamily.DENSE_ATTENTION, backend, [q, k, v, *layout_tensors], [scale],
                        list(layout_sizes), (0, 1, 2))


def _dense_attention_backward(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):
    grads = _recomputed_backward(ctx, grad_out)
    return None, grads[0], grads[1], grads[2], None, None, None


dense_attention_op.register_autograd(_dense_attention_backward, setup_context=_dense_attention_setup)


# ------------------------------------------------------------------------------ dense attention blocks (M under CP)
@_custom_op("dense_attention_block_fwd")
def dense_attention_block_fwd_op(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float,
                                 causal: bool) -> tuple[Tensor, Tensor]:
    """`dense_attention_block_fwd` family: `(out [n, H, Dv], lse [n, H])` of one block of the context-parallel
    ring. No gradient: the ring's autograd Function calls `dense_attention_block_bwd` itself."""
    out, lse = _kernel(OpFamily.DENSE_ATTENTION_BLOCK_FWD, backend)(q, k, v, scale, causal)
    # Contiguous, as the fake implementation promises: kernels on batched `[1, H, n, D]` layouts return views.
    return out.contiguous(), lse.contiguous()


@dense_attention_block_fwd_op.register_fake
def _(backend, q, k, v, scale, causal):
    return q.new_empty(*q.shape[:2], v.shape[-1], dtype=compute_dtype(q.dtype)), \
        q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype))


@_custom_op("dense_attention_block_bwd")
def dense_attention_block_bwd_op(backend: str, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 grad_out: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """`dense_attention_block_bwd` family: `(dq, dk, dv)` of one block, given the merged `out` and `lse`."""
    grads = _kernel(OpFamily.DENSE_ATTENTION_BLOCK_BWD, backend)(q, k, v, out, lse, grad_out, scale, causal)
    return tuple(grad.contiguous() for grad in grads)


@dense_attention_block_bwd_op.register_fake
def _(backend, q, k, v, out, lse, grad_out, scale, causal):
    compute = compute_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=compute), k.new_empty(k.shape, dtype=compute), v.new_empty(v.shape, dtype=compute)


# ------------------------------------------------------------------------------ sparse attention
@_custom_op("sparse_attention_fwd")
def sparse_attention_fwd_op(backend: str, bwd_requested: str, query: Tensor, kv: Tensor, indices: Tensor,
                            sink: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """`sparse_attention_fwd` family: `(out [N, H, D], lse [N, H])`. `bwd_requested` names the backend
    asked for the backward (`auto` or a name): the choice is made when the backward is traced, knowing
    whether `lse` takes a gradient, as eager dispatch does."""
    out, lse = _kernel(OpFamily.SPARSE_ATTENTION_FWD, backend)(query, kv, indices, sink, scale)
    return out, lse


@sparse_attention_fwd_op.register_fake
def _(backend, bwd_requested, query, kv, indices, sink, scale):
    return torch.empty_like(query), query.new_empty(query.shape[:2], dtype=compute_dtype(query.dtype))


@_custom_op("sparse_attention_bwd")
def sparse_attention_bwd_op(backend: str, query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                            out: Tensor, lse: Tensor, grad_out: Tensor,
                            grad_lse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """`sparse_attention_bwd` family: `(grad_query, grad_kv, grad_sink)`."""
    grads = _kernel(OpFamily.SPARSE_ATTENTION_BWD, backend)(query, kv, indices, sink, scale, out, lse,
                                                            grad_out, grad_lse)
    return tuple(grads)


@sparse_attention_bwd_op.register_fake
def _(backend, query, kv, indices, sink, scale, out, lse, grad_out, grad_lse):
    return torch.empty_like(query), torch.empty_like(kv), torch.empty_like(sink)


def _sparse_setup(ctx, inputs, output):
    _, ctx.requested, query, kv, indices, sink, ctx.scale = inputs
    ctx.save_for_backward(query, kv, indices, sink, *output)


def _sparse_backward(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):
    query, kv, indices, sink, out, lse = ctx.saved_tensors
    backend, _ = registry.resolve(OpFamily.SPARSE_ATTENTION_BWD, ctx.requested, **sparse_call(query, kv, indices),
                                  lse_grad=grad_lse is not None)
    grad_query, grad_kv, grad_sink = sparse_attention_bwd_op(backend, query, kv, indices, sink, ctx.scale,
                                                             out, lse, grad_out, grad_lse)
    return None, None, grad_query, grad_kv, None, grad_sink, None


sparse_attention_fwd_op.register_autograd(_sparse_backward, setup_context=_sparse_setup)


# ------------------------------------------------------------------------------ indexer and selection
@_custom_op("indexer_scores")
def indexer_scores_op(backend: str, q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float,
                      visible: Optional[list[int]], segments: list[Tensor]) -> Tensor:
    """`indexer_scores` family: `[n, C]` scores (compute dtype, −inf at invalid candidates); `visible`:
    the `UniformVisibleRows` fields (`segments` empty), or a `SegmentedVisibleRows`' ints with its tensors in
    `segments`, or None. No gradient (the indexer loss has its own backward)."""
    return _kernel(OpFamily.INDEXER_SCORES, backend)(q, k, weights, candidates, scale, _visible(visible, segments))


@indexer_scores_op.register_fake
def _(backend, q, k, weights, candidates, scale, visible, segments):
    return q.new_empty(candidates.shape, dtype=compute_dtype(q.dtype))


@_custom_op("topk")
def topk_op(backend: str, scores: Tensor, valid: Optional[Tensor], k: int, visible: Optional[list[int]],
            counts: Optional[Tensor], ordered: bool) -> Tensor:
    """`topk` family: `[n, min(k, C)]` int64 columns, −1 where fewer are valid (`ordered=False`: a set; valid None
    with counts: prefixes; see `ops.indices.topk_columns`)."""
    return _kernel(OpFamily.TOPK, backend)(scores, valid, k, _visible(visible), counts, ordered)


@topk_op.register_fake
def _(backend, scores, valid, k, visible, counts, ordered):
    return scores.new_empty(scores.shape[0], min(k, scores.shape[1]), dtype=torch.long)


@_custom_op("selection_rows")
def selection_rows_op(backend: str, columns: Tensor, scores: Tensor, table: Tensor, group: Tensor, count: Tensor,
                      start: int, stop: int, window: Tensor, kv_offset: int
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`selection_rows` family for the query rows `[start, stop)` of `VisibleEntries(table, group, count)`:
    `(entry_scores, entry_rows, compressed, combined)` as `ops.indices.SelectionRows`."""
    entries = VisibleEntries(table, group, count)
    rows = _kernel(OpFamily.SELECTION_ROWS, backend)(columns, scores, entries, slice(start, stop), window,
                                                     kv_offset)
    return tuple(t.clone() if t is window else t for t in rows)  # an output never aliases an input


@selection_rows_op.register_fake
def _(backend, columns, scores, table, group, count, start, stop, window, kv_offset):
    n, width = columns.shape
    return (scores.new_empty(n, width), columns.new_empty(n, width, dtype=torch.long),
            columns.new_empty(n, width, dtype=torch.long),
            columns.new_empty(n, window.shape[1] + width, dtype=torch.long))


@_custom_op("indexer_loss")
def indexer_loss_op(backend: str, student_scores: Tensor, query: Tensor, kv: Tensor, candidates: Tensor,
                    full_lse: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """`indexer_loss` family on one tensor-parallel rank: `(KL [T], teacher target [T, C])`."""
    per_row, target = _kernel(OpFamily.INDEXER_LOSS, backend)(student_scores, query, kv, candidates, full_lse,
                                                              scale, None, return_target=True)
    return per_row, target


@indexer_loss_op.register_fake
def _(backend, student_scores, query, kv, candidates, full_lse, scale):
    return student_scores.new_empty(student_scores.shape[0]), torch.empty_like(student_scores)


@_custom_op("indexer_kl_bwd")
def indexer_kl_bwd_op(backend: str, q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, target: Tensor,
                      student_scores: Tensor, grad_rows: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """`indexer_kl_bwd` family: `(grad_q, grad_k, grad_weights)`."""
    grads = _kernel(OpFamily.INDEXER_KL_BWD, backend)(q, k, weights, candidates, target, student_scores,
                                                      grad_rows, scale)
    return tuple(grads)


@indexer_kl_bwd_op.register_fake
def _(backend, q, k, weights, candidates, target, student_scores, grad_rows, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights)


# ------------------------------------------------------------------------------ decode attention
@_custom_op("decode_attention")
def decode_attention_op(backend: str, query: Tensor, kv_new: Tensor, window_rows: Tensor, seqlens: Tensor, window: int,
                        entries: Optional[Tensor], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                        scale: float, inverse_rope_freq: Optional[Tensor]) -> Tensor:
    """`decode_attention` family: `out [B, H, D]` of one new query row per cached sequence (inference: no
    gradient)."""
    return _kernel(OpFamily.DECODE_ATTENTION, backend)(query, kv_new, window_rows, seqlens, window, entries,
                                                       entry_ids, ratio, sink, scale, inverse_rope_freq)


@decode_attention_op.register_fake
def _(backend, query, kv_new, window_rows, seqlens, window, entries, entry_ids, ratio, sink, scale,
      inverse_rope_freq):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@_custom_op("decode_indexer_scores")
def decode_indexer_scores_op(backend: str, q: Tensor, keys: Tensor, weights: Tensor, counts: Tensor,
                             scale: float, key_scales: Optional[Tensor]) -> Tensor:
    """`decode_indexer_scores` family: `[B, C]` scores (compute dtype) of one query row per sequence against its
    cached compressed keys (e4m3 with `key_scales`: an FP8 cache), −inf past `counts[b]` (inference: no
    gradient)."""
    return _kernel(OpFamily.DECODE_INDEXER_SCORES, backend)(q, keys, weights, counts, scale, key_scales)


@decode_indexer_scores_op.register_fake
def _(backend, q, keys, weights, counts, scale, key_scales):
    return q.new_empty(keys.shape[:2], dtype=compute_dtype(q.dtype))


@_custom_op("decode_compressor", mutates_args=("state", "store", "scales", "counts"))
def decode_compressor_op(backend: str, state: Tensor, new_rows: Tensor, positions: Tensor, ape: Tensor,
                         norm_weight: Tensor, eps: float, inv_freq: Tensor, rotate: bool, store: Tensor,
                         scales: Optional[Tensor], counts: Optional[Tensor]) -> None:
    """`decode_compressor` family: the new tokens join their compressor's pending slots (`state`) and their groups'
    entries are written to `store` (and `scales`), the entries each sees to `counts`, in place (inference: no
    gradient)."""
    _kernel(OpFamily.DECODE_COMPRESSOR, backend)(state, new_rows, positions, ape, norm_weight, eps, inv_freq, rotate,
                                                 store, scales, counts)


@_custom_op("decode_append", mutates_args=("buffer", "seqlens"))
def decode_append_op(backend: str, buffer: Tensor, rows: Tensor, seqlens: Tensor) -> None:
    """`decode_append` family: each sequence's new row into slot `seqlens[b] % R` of `buffer`, then `seqlens += 1`,
    in place (inference: no gradient)."""
    _kernel(OpFamily.DECODE_APPEND, backend)(buffer, rows, seqlens)


@_custom_op("paged_decode_attention")
def paged_decode_attention_op(backend: str, query: Tensor, window_pages: Tensor, window: int, dim: int, rope: int,
                              seqlens: Tensor, entry_pages: Optional[Tensor], entry_slots: int,
                              entry_ids: Optional[Tensor], ratio: int, sink: Tensor, scale: float,
                              inverse_rope_freq: Optional[Tensor]) -> Tensor:
    """`paged_decode_attention` family: `out [B, H, D]` over an FP8 attention-row cache, its pages passed as
    tensors and their shapes (`ops.paged_rows.PagedRows`) as integers (inference: no gradient)."""
    window_rows = PagedRows(window_pages, window, dim, rope)
    entries = None if entry_pages is None else PagedRows(entry_pages, entry_slots, dim, rope)
    return _kernel(OpFamily.PAGED_DECODE_ATTENTION, backend)(query, window_rows, seqlens, window, entries, entry_ids,
                                                             ratio, sink, scale, inverse_rope_freq)


@paged_decode_attention_op.register_fake
def _(backend, query, window_pages, window, dim, rope, seqlens, entry_pages, entry_slots, entry_ids, ratio, sink,
      scale, inverse_rope_freq):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _paged_decode_attention(backend: str):
    def run(query: Tensor, window_rows: PagedRows, seqlens: Tensor, window: int, entries: Optional[PagedRows],
            entry_ids: Optional[Tensor], ratio: int, sink: Tensor, scale: float,
            inverse_rope_freq: Optional[Tensor] = None) -> Tensor:
        return paged_decode_attention_op(
            backend, query, window_rows.pages, int(window), window_rows.dim, window_rows.rope, seqlens,
            None if entries is None else entries.pages, 0 if entries is None else entries.slots, entry_ids,
            int(ratio), sink, float(scale), inverse_rope_freq)
    return run


@_custom_op("paged_rows_write", mutates_args=("pages",))
def paged_rows_write_op(backend: str, pages: Tensor, slots: int, dim: int, rope: int, rows: Tensor,
                        positions: Tensor, ratio: int) -> None:
    """`paged_rows_write` family: row b quantized into slot `(positions[b] // ratio) % slots` of page b, in place
    (inference: no gradient)."""
    _kernel(OpFamily.PAGED_ROWS_WRITE, backend)(pages, slots, dim, rope, rows, positions, ratio)


@_custom_op("fp8_gemm")
def fp8_gemm_op(backend: str, a: Tensor, b: Tensor, out_dtype: torch.dtype, b_scales: Optional[Tensor]) -> Tensor:
    """`fp8_gemm` family: `a [M, K]·b [N, K]ᵀ` in `out_dtype`, the rows of both rounded to FP8 (b's already where
    `b_scales` come with its codes, which may be G groups `[G, N, K]`: `[M, G·N]`; no gradient:
    `ops.fp8_linear.Fp8Linear` runs its backward GEMMs through this family too)."""
    return _kernel(OpFamily.FP8_GEMM, backend)(a, b, out_dtype, b_scales)


@fp8_gemm_op.register_fake
def _(backend, a, b, out_dtype, b_scales):
    return a.new_empty((a.shape[0], b.shape[0] * b.shape[1] if b.dim() == 3 else b.shape[0]), dtype=out_dtype)


# ------------------------------------------------------------------------------ the families' contracts
def _indexer_loss(backend: str):
    def run(student_scores: Tensor, query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor, scale: float,
            tp_group: Any = None, return_target: bool = False):
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            raise NotImplementedError("torch.compile of the indexer loss under tensor parallelism is not "
                                      "supported (its teacher target is all-reduced over the group)")
        per_row, target = indexer_loss_op(backend, student_scores, query, kv, candidates, full_lse, float(scale))
        return (per_row, target) if return_target else per_row
    return run


def _selection_rows(backend: str):
    def run(columns: Tensor, scores: Tensor, entries: VisibleEntries, rows: slice, window: Tensor,
            kv_offset: int) -> SelectionRows:
        start, stop = row_range(rows, entries.group.shape[0])
        return SelectionRows(*selection_rows_op(backend, columns, scores, entries.table, entries.group,
                                                entries.count, start, stop, window, kv_offset))
    return run


ADAPTORS: dict[OpFamily, Callable[[str], Callable[..., Any]]] = {
    OpFamily.ROPE: lambda backend: (
        lambda x, positions, inv_freq, inverse=False, amplitude=1.0:
        rope_op(backend, x, positions, inv_freq, inverse, float(amplitude))),
    OpFamily.NORM_ROPE: lambda backend: (
        lambda x, positions, inv_freq, eps, weight=None:
        norm_rope_op(backend, x, positions, inv_freq, float(eps), weight)),
    OpFamily.RMS_NORM: lambda backend: (
        lambda x, weight, eps: rms_norm_op(backend, x, weight, float(eps))),
    OpFamily.COMPRESSOR: lambda backend: (
        lambda kv, gate, ape, norm_weight, eps, layout, inv_freq, rotate:
        compressor_op(backend, kv, gate, ape, norm_weight, float(eps), inv_freq, rotate, *_compressed_args(layout))),
    OpFamily.DENSE_ATTENTION: lambda backend: (
        lambda q, k, v, layout, scale: dense_attention_op(backend, q, k, v, *_layout_args(layout), float(scale))),
    OpFamily.DENSE_ATTENTION_BLOCK_FWD: lambda backend: (
        lambda q, k, v, scale, causal: dense_attention_block_fwd_op(backend, q, k, v, float(scale), bool(causal))),
    OpFamily.DENSE_ATTENTION_BLOCK_BWD: lambda backend: (
        lambda q, k, v, out, lse, grad_out, scale, causal:
        dense_attention_block_bwd_op(backend, q, k, v, out, lse, grad_out, float(scale), bool(causal))),
    OpFamily.INDEXER_SCORES: lambda backend: (
        lambda q, k, weights, candidates, scale, visible=None:
        indexer_scores_op(backend, q, k, weights, candidates, float(scale), *_visible_args(visible))),
    OpFamily.TOPK: lambda backend: (
        lambda scores, valid, k, visible=None, counts=None, ordered=True:
        topk_op(backend, scores, valid, k, _uniform_args(visible), counts, bool(ordered))),
    OpFamily.SELECTION_ROWS: _selection_rows,
    OpFamily.DECODE_ATTENTION: lambda backend: (
        lambda query, kv_new, window_rows, seqlens, window, entries, entry_ids, ratio, sink, scale,
        inverse_rope_freq=None:
        decode_attention_op(backend, query, kv_new, window_rows, seqlens, int(window), entries, entry_ids, int(ratio),
                            sink, float(scale), inverse_rope_freq)),
    OpFamily.DECODE_INDEXER_SCORES: lambda backend: (
        lambda q, keys, weights, counts, scale, key_scales=None:
        decode_indexer_scores_op(backend, q, keys, weights, counts, float(scale), key_scales)),
    OpFamily.DECODE_COMPRESSOR: lambda backend: (
        lambda state, new_rows, positions, ape, norm_weight, eps, inv_freq, rotate, store, scales=None, counts=None:
        decode_compressor_op(backend, state, new_rows, positions, ape, norm_weight, float(eps), inv_freq, bool(rotate),
                             store, scales, counts)),
    OpFamily.DECODE_APPEND: lambda backend: (
        lambda buffer, rows, seqlens: decode_append_op(backend, buffer, rows, seqlens)),
    OpFamily.PAGED_DECODE_ATTENTION: _paged_decode_attention,
    OpFamily.PAGED_ROWS_WRITE: lambda backend: (
        lambda pages, slots, dim, rope, rows, positions, ratio:
        paged_rows_write_op(backend, pages, int(slots), int(dim), int(rope), rows, positions, int(ratio))),
    OpFamily.FP8_GEMM: lambda backend: (
        lambda a, b, out_dtype, b_scales=None: fp8_gemm_op(backend, a, b, out_dtype, b_scales)),
    OpFamily.INDEXER_LOSS: _indexer_loss,
    OpFamily.INDEXER_KL_BWD: lambda backend: (
        lambda q, k, weights, candidates, target, student_scores, grad_rows, scale:
        indexer_kl_bwd_op(backend, q, k, weights, candidates, target, student_scores, grad_rows, float(scale))),
}
for _family, _adaptor in ADAPTORS.items():
    registry.register_traceable(_family, _adaptor)


def sparse_call(query: Tensor, kv: Tensor, indices: Tensor) -> dict[str, Any]:
    """The call description sparse-attention probes read (shapes of one call, no device reads)."""
    return dict(device=query.device, dtype=query.dtype, head_dim=query.shape[-1], heads=query.shape[1],
                topk=indices.shape[1], kv_rows=kv.shape[0])


def sparse_attention(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                     requested: registry.Requested) -> tuple[Tensor, Tensor]:
    """`backends.dispatched_sparse_attention.sparse_attention` inside a `torch.compile` trace: the forward backend is
    chosen now; the backward's when the backward is traced (it depends on whether `lse` takes a gradient)."""
    forward = registry.traced_choice(OpFamily.SPARSE_ATTENTION_FWD, requested, **sparse_call(query, kv, indices))
    backward = registry.requested_name(OpFamily.SPARSE_ATTENTION_BWD, requested)
    return sparse_attention_fwd_op(forward, backward, query, kv, indices, sink, float(scale))
