"""Which classes build the layer's tensor-parallel projections and its q / kv norms.

`HybridAttentionSubmodules` holds three builders; the defaults are the package's own modules. A host
framework swaps in its classes (the Megatron adapter builds Megatron's local, Apex or Transformer
Engine linears and norms from a `ModuleSpec`), so their features (e.g. Transformer Engine's FP8
recipes) apply to these projections:

| builder | builds | contract |
|---|---|---|
| `column_parallel_linear(in, out, tp_group, std)` | `linear_q_up_proj`, M's `linear_kv_up_proj` | `x [..., in]` (the same on every TP rank) → this rank's `[..., out/tp]`; sums the input gradient over TP |
| `row_parallel_linear(in, out, tp_group, std, sequence_parallel)` | `linear_proj` | this rank's `[S, B, in/tp]` → `[S, B, out]` summed over TP (reduce-scattered along S under SP) |
| `norm(dim, eps)` | `q_layernorm`, `kv_layernorm` (with `qk_layernorm`) | RMSNorm over the last dim |

A module may return its output or Megatron's `(output, bias)` pair (bias None). Its weight is named
`weight`, so checkpoints keep their keys. The replicated input projections (q and kv latents, the
compressors' and indexer's) stay the package's: they run as one stacked GEMM.

`projection_precision="fp8"` (`layers.projection_gemms`) makes the package's own parallel linears multiply in
FP8; a host's class brings its own precision (Transformer Engine's FP8 recipes), so the two are not mixed:
a builder given together with `fp8` is a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megatron_dsa.layers.projection_gemms import NATIVE, ProjectionGemms
from megatron_dsa.parallel.linear import ColumnParallelLinear, RowParallelLinear

ColumnBuilder = Callable[[int, int, Optional[ProcessGroup], float], nn.Module]
RowBuilder = Callable[[int, int, Optional[ProcessGroup], float, bool], nn.Module]
NormBuilder = Callable[[int, float], nn.Module]


@dataclass(frozen=True)
class HybridAttentionSubmodules:
    """Builders of the layer's parallel projections and q / kv norms (None: the package's own)."""

    column_parallel_linear: Optional[ColumnBuilder] = None
    row_parallel_linear: Optional[RowBuilder] = None
    norm: Optional[NormBuilder] = None

    def build_column(self, in_features: int, out_features: int, tp_group: Optional[ProcessGroup],
                     std: float, gemms: ProjectionGemms = NATIVE) -> nn.Module:
        if self.column_parallel_linear is None:
            return ColumnParallelLinear(in_features, out_features, tp_group, std, matmul=gemms.linear)
        _check_host_precision("column_parallel_linear", gemms)
        return self.column_parallel_linear(in_features, out_features, tp_group, std)

    def build_row(self, in_features: int, out_features: int, tp_group: Optional[ProcessGroup], std: float,
                  sequence_parallel: bool, gemms: ProjectionGemms = NATIVE) -> nn.Module:
        if self.row_parallel_linear is None:
            return RowParallelLinear(in_features, out_features, tp_group, std, sequence_parallel,
                                     matmul=gemms.linear)
        _check_host_precision("row_parallel_linear", gemms)
        return self.row_parallel_linear(in_features, out_features, tp_group, std, sequence_parallel)


def _check_host_precision(builder: str, gemms: ProjectionGemms) -> None:
    if gemms is not NATIVE:
        raise ValueError(f"projection_precision='fp8' multiplies in the package's own linears, but the submodules "
                         f"give {builder}, whose class sets its own precision (e.g. Transformer Engine's FP8 "
                         f"recipe): leave projection_precision 'native' or drop the {builder} builder")


def apply(module: nn.Module, x: Tensor) -> Tensor:
    """`module(x)`, taking the output out of Megatron's `(output, bias)` pair. A bias returned
    separately (`skip_bias_add`) would be dropped: rejected, the layer has no biases."""
    result = module(x)
    if not isinstance(result, tuple):
        return result
    output, bias = result
    if bias is not None:
        raise ValueError(f"{type(module).__name__} returned a separate bias; the hybrid layer has no biases "
                         f"(build it with bias=False)")
    return output
