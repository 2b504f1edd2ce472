"""Building blocks shared by the attention layers."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from megatron_dsa.backends import OpFamily, Requested, dispatch
from megatron_dsa.layers.projection_gemms import NATIVE, ProjectionGemms, has_call_hooks
from megatron_dsa.ops.stacked_projection import KeptStack

__all__ = ["HighPrecisionModule", "RMSNorm", "bits", "has_call_hooks", "linear", "make_norm", "output_init_std",
           "project_rows"]


def bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else 0


class HighPrecisionModule(nn.Module):
    """A module some of whose own tensors never drop below a minimum precision when cast.

    `keep_high_precision` maps direct parameter/buffer names to their floor dtype: `module.bfloat16()`
    leaves the fp32 `attn_sink` and `ape` in fp32 (values untouched), while `.double()` and a later
    `.float()` still apply. Device moves always apply.
    """

    keep_high_precision: dict[str, torch.dtype] = {}

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True):  # type: ignore[override]
        before = {name: getattr(self, name).data for name in self.keep_high_precision}
        super()._apply(fn, recurse)
        for name, old in before.items():
            tensor, floor = getattr(self, name), self.keep_high_precision[name]
            if bits(tensor.dtype) < bits(floor):
                tensor.data = old.to(device=tensor.device, dtype=floor if bits(old.dtype) > bits(floor) else old.dtype)
        return self


class RMSNorm(nn.Module):
    """RMSNorm with a learnable gain `weight [dim]` (Megatron `*_layernorm.weight`).

    `backend` picks the `rms_norm` implementation per call: the layer config (its per-op choice),
    `"auto"` or a backend name. forward(x `[..., dim]`) → `[..., dim]` in x's dtype."""

    def __init__(self, dim: int, eps: float, backend: Requested):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        norm = dispatch(OpFamily.RMS_NORM, self.backend, device=x.device, dtype=x.dtype)
        return norm(x, self.weight, self.eps)


def project_rows(x: Tensor, attached: Sequence[nn.Linear], detached: Sequence[nn.Linear] = (),
                 gemms: ProjectionGemms = NATIVE, kept: Optional[KeptStack] = None) -> dict[nn.Linear, Tensor]:
    """`{linear: x @ linear.weight^T}` for linears that read the token rows `x [T, d]`; the `detached`
    ones read `x.detach()` (their outputs pass no gradient to x).

    One stacked GEMM (`gemms.stacked`; the outputs are column slices of its result) when
    `gemms.stacks` them: natively, every linear a plain bias-free `nn.Linear` without hooks, in x's
    dtype and device, outside autocast; in FP8, plain linears on x's device. Otherwise each module is
    called, so its hooks (or its own forward, in its own precision) run. `kept`: an inference cache's stack
    of the weights (`ops.stacked_projection.KeptStack`), used where no gradient is needed."""
    linears = [*attached, *detached]
    if gemms.stacks(x, linears):
        outputs = gemms.stacked(x, [linear.weight for linear in linears], len(attached), kept)
    else:
        outputs = [linear(x) for linear in attached] + [linear(x.detach()) for linear in detached]
    return dict(zip(linears, outputs))


def make_norm(dim: int, eps: float, enabled: bool, backend: Requested) -> nn.Module:
    """`RMSNorm` when `enabled` (`qk_layernorm=True`), else `Identity` (no parameter), as Megatron."""
    return RMSNorm(dim, eps, backend) if enabled else nn.Identity()


def linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    """Bias-free linear with N(0, std) init (Megatron `init_method`)."""
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def output_init_std(std: float, num_layers: int) -> float:
    """Megatron's `output_layer_init_method`: std / sqrt(2 · num_layers)."""
    return std / math.sqrt(2.0 * num_layers)
