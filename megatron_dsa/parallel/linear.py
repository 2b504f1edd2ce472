"""Tensor-parallel linear layers (bias-free, as the DSv4 layer has no biases).

Weights keep Megatron's names (`weight`) and local shapes: a column-parallel layer holds rows
`[out/tp, in]`, a row-parallel layer columns `[out, in/tp]`; `sharding.py` maps them to TP = 1.
Each rank's block is the slice of the TP = 1 weight drawn with the same seed. `matmul(x, weight)` computes
the local product `x @ weight^T` (default `F.linear`; the layer passes its FP8 product under
`projection_precision="fp8"`, `layers.projection_gemms`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megatron_dsa.parallel.mappings import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_dsa.parallel.sharding import divide, tensor_parallel_parameter

__all__ = ["ColumnParallelLinear", "Matmul", "RowParallelLinear", "divide"]

Matmul = Callable[[Tensor, Tensor], Tensor]  # (x [..., in], weight [out, in]) -> x @ weight^T


class ColumnParallelLinear(nn.Module):
    """`y_local = x @ W_local^T`, `W_local = W[rank·out/tp : (rank+1)·out/tp]`.

    The input is shared by all ranks (each uses it for its own output slice), so its gradient is
    summed over the group in backward. The output stays split (no gather).
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Optional[ProcessGroup],
                 std: float, what: str = "output features", matmul: Matmul = F.linear):
        super().__init__()
        self.tp_group, self.matmul = tp_group, matmul
        self.weight = tensor_parallel_parameter((out_features, in_features), 0, tp_group,
                                                lambda w: w.normal_(std=std), what=what)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(copy_to_tensor_parallel_region(x, self.tp_group), self.weight)


class RowParallelLinear(nn.Module):
    """`y = Σ_ranks x_local @ W_local^T` with `W_local = W[:, rank·in/tp : (rank+1)·in/tp]`.

    The sum is an all-reduce, or a reduce-scatter along dim 0 under sequence parallelism.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Optional[ProcessGroup],
                 std: float, sequence_parallel: bool = False, what: str = "input features", matmul: Matmul = F.linear):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.matmul = tp_group, sequence_parallel, matmul
        self.weight = tensor_parallel_parameter((out_features, in_features), 1, tp_group,
                                                lambda w: w.normal_(std=std), what=what)

    def forward(self, x: Tensor) -> Tensor:
        partial = self.matmul(x, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_parallel_region(partial, self.tp_group)
