"""How the layer multiplies token rows by its projection weights: in the rows' dtype (`native`) or with FP8
GEMMs (`fp8`), as `HybridAttentionConfig.projection_precision` says.

A `ProjectionGemms` object does the three shapes of product the layer has: one linear (`linear_q_up_proj`,
`linear_proj`, the indexer's `linear_wq_b`, M's `linear_kv_up_proj`), the stacked input projections
(`layers.common.project_rows`: q and kv latents, compressors, indexer weights) and the grouped output
projection (`linear_o_group_proj`). Attention, norms, RoPE, the compressor's pooling and the indexer's
scores and loss never come here: they stay in the rows' dtype (and float32 inside their kernels).

Under FP8 every GEMM of forward and backward is an `fp8_gemm` call (`ops.fp8_linear`), dispatched per call
with the layer config's backend choice (`torch_scaled_mm` on GPUs with FP8 tensor cores, else the
`unfused` reference, which rounds the same way and multiplies in float32). The outputs come in the
autocast dtype under autocast (as `F.linear`'s do), else in the rows' dtype.

Tensor parallelism: each rank quantizes the operands of its own GEMMs. A scale covers one row of a GEMM's
contraction, so where TP splits a contraction (a row-parallel forward, a column-parallel input gradient)
a rank's scales cover its slice of the row: finer than TP = 1, and TP-N differs from TP = 1 by FP8
rounding there. Elsewhere the scales are those of TP = 1 (docs/user_guide.md, 'FP8 projections').
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_dsa.backends import OpFamily, Requested, dispatch
from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.ops.fp8_linear import Fp8Gemm, RoundedWeight, RoundedWeights, fp8_grouped_linear, fp8_linear
from megatron_dsa.ops.output_projection import grouped_output_projection
from megatron_dsa.ops.stacked_projection import KeptStack, stacked_projection, stacked_weights


class ProjectionGemms(Protocol):
    """The layer's products of token rows with projection weights (see the module docstring)."""

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """`x [..., K] @ weight [N, K]ᵀ` → `[..., N]`."""

    def stacks(self, x: Tensor, linears: Sequence[nn.Module]) -> bool:
        """Whether `stacked` may stand in for calling each of `linears` on `x`."""

    def stacked(self, x: Tensor, weights: Sequence[Tensor], attached: int, kept: Optional[KeptStack] = None
                ) -> tuple[Tensor, ...]:
        """`x [T, d] @ W_iᵀ` for each weight; only the first `attached` pass a gradient to x
        (`ops.stacked_projection`). `kept`: where no gradient is needed, the weights' stack is kept there
        (inference) instead of stacked again."""

    def grouped(self, o: Tensor, weight: Tensor, groups: int) -> Tensor:
        """The grouped output projection `o [..., H·D]` → `[..., G·Ro]` (`ops.output_projection`)."""


def has_call_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would run forward or backward hooks (its own or global ones), which a
    fused op that reads the module's parameters instead of calling it would skip."""
    from torch.nn.modules import module as hooks

    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def plain_linear(module: nn.Module) -> bool:
    """A bias-free `nn.Linear` (not a subclass) without hooks: its product may be computed from its weight
    instead of calling it."""
    return type(module) is nn.Linear and module.bias is None and not has_call_hooks(module)


class NativeGemms:
    """The products in the dtype of the rows and weights (`projection_precision="native"`)."""

    linear = staticmethod(F.linear)  # `F.linear` itself: the parallel linears' default product

    def stacks(self, x: Tensor, linears: Sequence[nn.Module]) -> bool:
        # Autocast casts each module's operands itself; one stacked GEMM in x's dtype would not.
        return (len(linears) > 1 and not torch.is_autocast_enabled(x.device.type)
                and all(plain_linear(linear) and linear.weight.dtype == x.dtype and linear.weight.device == x.device
                        for linear in linears))

    def stacked(self, x: Tensor, weights: Sequence[Tensor], attached: int, kept: Optional[KeptStack] = None
                ) -> tuple[Tensor, ...]:
        stacked = stacked_weights(weights, kept)
        if stacked is None:
            return stacked_projection(x, weights, attached)
        return (x @ stacked.t()).split([weight.shape[0] for weight in weights], dim=1)

    def grouped(self, o: Tensor, weight: Tensor, groups: int) -> Tensor:
        return grouped_output_projection(o, weight, groups)


_KEPT_ROUNDINGS: contextvars.ContextVar[Optional[RoundedWeights]] = contextvars.ContextVar(
    "megatron_dsa_kept_roundings", default=None)


@contextlib.contextmanager
def rounded_weights_kept(store: RoundedWeights) -> Iterator[None]:
    """Within it, FP8 products that need no gradient take their weights' rounding from `store` (an inference
    cache's `RoundedWeights`: its calls run again and again over the same resident weights). Elsewhere every
    product rounds its weight: an evaluation keeps nothing (under FSDP that would be a code for every element of
    weights it frees again), and training holds no FP8 copy."""
    token = _KEPT_ROUNDINGS.set(store)
    try:
        yield
    finally:
        _KEPT_ROUNDINGS.reset(token)


def _kept_rounding(weight: Tensor) -> Optional[RoundedWeight]:
    """`weight`'s kept rounding inside `rounded_weights_kept`, where the product needs no gradient; else None (the
    GEMM rounds the weight itself). Not under a trace: it reads no identities."""
    if torch.compiler.is_compiling():
        return None
    store = _KEPT_ROUNDINGS.get()
    if store is None or (torch.is_grad_enabled() and weight.requires_grad):
        return None
    return store.of(weight)


@dataclass(frozen=True, eq=False)
class Fp8Gemms:
    """The products as FP8 GEMMs (`projection_precision="fp8"`); `backend` picks the `fp8_gemm` backend per
    call (the layer config: its per-op choice). Through an inference cache each weight is rounded once
    (`rounded_weights_kept`)."""

    backend: Requested

    def gemm(self, x: Tensor) -> Fp8Gemm:
        """The `fp8_gemm` for products with x's rows (a decode step's few rows choose differently from training's
        many; the backward GEMMs of those products run through the same choice)."""
        return dispatch(OpFamily.FP8_GEMM, self.backend, device=x.device, dtype=x.dtype,
                        rows=x.numel() // max(x.shape[-1], 1))

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return fp8_linear(x, weight, self.gemm(x), out_dtype=_output_dtype(x), rounded=_kept_rounding(weight))

    def stacks(self, x: Tensor, linears: Sequence[nn.Module]) -> bool:
        return all(plain_linear(linear) and linear.weight.device == x.device for linear in linears)

    def stacked(self, x: Tensor, weights: Sequence[Tensor], attached: int, kept: Optional[KeptStack] = None
                ) -> tuple[Tensor, ...]:
        sizes = [weight.shape[0] for weight in weights]
        stacked = stacked_weights(weights, kept)  # None: stacked in autograd (a new tensor each call)
        out = fp8_linear(x, torch.cat(weights) if stacked is None else stacked, self.gemm(x),
                         grad_rows=sum(sizes[:attached]), out_dtype=_output_dtype(x),
                         rounded=None if stacked is None else _kept_rounding(stacked))
        return out.split(sizes, dim=1)

    def grouped(self, o: Tensor, weight: Tensor, groups: int) -> Tensor:
        width = o.shape[-1]
        if width % groups or weight.shape[1] != width // groups or weight.shape[0] % groups:
            raise ValueError(f"grouped projection: o width {width}, weight {tuple(weight.shape)}, groups {groups}")
        grouped = weight.view(groups, weight.shape[0] // groups, width // groups)
        out = fp8_grouped_linear(o.reshape(-1, width), grouped, self.gemm(o), out_dtype=_output_dtype(o),
                                 rounded=_in_groups(_kept_rounding(weight), groups))
        return out.view(*o.shape[:-1], -1)


def _in_groups(rounded: Optional[RoundedWeight], groups: int) -> Optional[RoundedWeight]:
    return None if rounded is None else rounded.in_groups(groups)


def _output_dtype(x: Tensor) -> torch.dtype:
    """What `F.linear` would return for rows `x`: the autocast dtype under autocast, else x's dtype."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


NATIVE = NativeGemms()


def projection_gemms(config: HybridAttentionConfig) -> ProjectionGemms:
    """The `ProjectionGemms` of `config.projection_precision`."""
    return Fp8Gemms(config) if config.projection_precision == "fp8" else NATIVE
