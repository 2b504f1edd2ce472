"""Pluggable projections and norms (`layers.submodules`): a layer built with other classes uses
them (counted calls prove it), keeps the checkpoint keys, and computes what the default layer does
(the same RNG draws build the same weights, so fp64 outputs and gradients agree to rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.layers.submodules import HybridAttentionSubmodules
from megatron_dsa.parallel.linear import ColumnParallelLinear, RowParallelLinear

CALLS: dict[str, int] = {}


class PairColumn(ColumnParallelLinear):
    """A column-parallel linear with Megatron's calling convention: returns `(output, None)`."""

    def forward(self, x):
        CALLS["column"] = CALLS.get("column", 0) + 1
        return super().forward(x), None


class PairRow(RowParallelLinear):
    def forward(self, x):
        CALLS["row"] = CALLS.get("row", 0) + 1
        return super().forward(x), None


class TorchNorm(nn.RMSNorm):
    def forward(self, x):
        CALLS["norm"] = CALLS.get("norm", 0) + 1
        return super().forward(x)


class BiasedColumn(ColumnParallelLinear):
    def forward(self, x):
        return super().forward(x), torch.zeros(1)


SUBMODULES = HybridAttentionSubmodules(
    column_parallel_linear=lambda i, o, group, std: PairColumn(i, o, group, std),
    row_parallel_linear=lambda i, o, group, std, sp: PairRow(i, o, group, std, sp),
    norm=lambda dim, eps: TorchNorm(dim, eps=eps))


def config_for(kind: str) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern=kind, csa_window_size=8,
                                             hca_compress_ratio=8, dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.5)


@pytest.mark.parametrize("kind", "WCHM")
def test_injected_classes_run_and_match_the_default_layer(kind: str) -> None:
    torch.manual_seed(4)
    default = HybridAttention(config_for(kind), kind=kind).double()
    torch.manual_seed(4)
    injected = HybridAttention(config_for(kind), kind=kind, submodules=SUBMODULES).double()
    assert list(injected.state_dict()) == list(default.state_dict())
    assert isinstance(injected.linear_q_up_proj, PairColumn) and isinstance(injected.linear_proj, PairRow)
    assert isinstance(injected.q_layernorm, TorchNorm)
    x = torch.randn(40, 2, default.config.hidden_size, dtype=torch.float64)
    upstream = torch.randn_like(x)
    results = []
    for layer in (default, injected):
        CALLS.clear()
        x_in = x.clone().requires_grad_()
        out, _ = layer(x_in)
        (out * upstream).sum().backward()
        results.append((out, x_in.grad, {n: p.grad for n, p in layer.named_parameters()}, dict(CALLS)))
    (out, grad, params, _), (out_i, grad_i, params_i, calls) = results
    column_calls = 2 if kind == "M" else 1  # M's kv up-projection is column-parallel too
    # q_layernorm and kv_layernorm; another class is called as a module (no fused norm + RoPE).
    assert calls == {"column": column_calls, "row": 1, "norm": 2}, calls
    torch.testing.assert_close(out_i, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_i, grad, rtol=0, atol=1e-12)
    for name, value in params.items():
        torch.testing.assert_close(params_i[name], value, rtol=0, atol=1e-12, msg=name)


def test_a_separately_returned_bias_is_rejected() -> None:
    submodules = HybridAttentionSubmodules(column_parallel_linear=lambda i, o, g, std: BiasedColumn(i, o, g, std))
    layer = HybridAttention(config_for("W"), kind="W", submodules=submodules)
    with pytest.raises(ValueError, match="separate bias"):
        layer(torch.randn(8, 1, layer.config.hidden_size))
