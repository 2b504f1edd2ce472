"""Building blocks shared by the attention layers."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from megatron_dsa.backends import OpFamily, Requested, dispatch
from megatron_dsa.ops.stacked_projection import stacked_projection


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


def has_call_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would run forward or backward hooks (its own or global ones), which a
    fused op that reads the module's parameters instead of calling it would skip."""
    from torch.nn.modules import module as hooks

    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def project_rows(x: Tensor, attached: Sequence[nn.Linear],
                 detached: Sequence[nn.Linear] = ()) -> dict[nn.Linear, Tensor]:
    """`{linear: x @ linear.weight^T}` for linears that read the token rows `x [T, d]`; the `detached`
    ones read `x.detach()` (their outputs pass no gradient to x).

    One stacked GEMM (`ops.stacked_projection`; the outputs are column slices of its result) when
    every linear is a plain bias-free `nn.Linear` without hooks, in x's dtype and device, outside
    autocast; otherwise each module is called, so its hooks (or its own forward) run."""
    linears = [*attached, *detached]
    if _stackable(x, linears):
        outputs = stacked_projection(x, [linear.weight for linear in linears], len(attached))
    else:
        outputs = [linear(x) for linear in attached] + [linear(x.detach()) for linear in detached]
    return dict(zip(linears, outputs))


def _stackable(x: Tensor, linears: Sequence[nn.Module]) -> bool:
    return (len(linears) > 1 and not torch.is_autocast_enabled(x.device.type)
            and all(type(linear) is nn.Linear and linear.bias is None and not has_call_hooks(linear)
                    and linear.weight.dtype == x.dtype and linear.weight.device == x.device
                    for linear in linears))


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
