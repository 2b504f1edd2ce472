"""TP state dicts: which parameters are split, and gathering/splitting them to and from TP = 1.

A tensor-parallel parameter carries `tensor_parallel_dim` (the dim it is split along into `tp`
contiguous blocks, rank order). Every other parameter is replicated: identical on all TP ranks.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megatron_dsa.parallel.state import ParallelState, group_rank, group_size

PARTITION_ATTR = "tensor_parallel_dim"


def mark_tensor_parallel(param: nn.Parameter, dim: int) -> nn.Parameter:
    setattr(param, PARTITION_ATTR, dim)
    return param


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, or a ValueError naming what must be divisible."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size "
                         f"({denominator})")
    return numerator // denominator


def tensor_parallel_parameter(full_shape: Sequence[int], dim: int, tp_group: Optional[ProcessGroup],
                              init: Callable[[Tensor], Tensor], dtype: Optional[torch.dtype] = None,
                              what: str = "the split dim") -> nn.Parameter:
    """This rank's block (along `dim`) of a TP = 1 parameter of `full_shape`, initialised by `init`.

    The whole TP = 1 tensor is drawn and sliced, so a TP = N layer makes exactly the RNG draws of
    the TP = 1 layer and its shards are the slices of the TP = 1 layer built with the same seed
    (the contract of Megatron's CPU initialisation). Drawing only the local block would give every
    rank the same values: duplicated heads."""
    size = group_size(tp_group)
    divide(full_shape[dim], size, what)
    full = init(torch.empty(tuple(full_shape), dtype=dtype))
    local = full.chunk(size, dim=dim)[group_rank(tp_group)].clone() if size > 1 else full
    return mark_tensor_parallel(nn.Parameter(local), dim)


def partition_dims(module: nn.Module) -> dict[str, Optional[int]]:
    """`{state-dict key: split dim, or None when replicated}` for every parameter of `module`.

    Ours carry `tensor_parallel_dim`; Megatron's parallel layers (when a host framework's classes
    build some projections) carry `tensor_model_parallel` and `partition_dim` instead."""
    return {name: partition_dim(p) for name, p in module.named_parameters()}


def partition_dim(param: nn.Parameter) -> Optional[int]:
    dim = getattr(param, PARTITION_ATTR, None)
    if dim is None and getattr(param, "tensor_model_parallel", False):
        return param.partition_dim
    return dim


def merge_tp_shards(shards: list[Mapping[str, Tensor]], dims: Mapping[str, Optional[int]]
                    ) -> dict[str, Tensor]:
    """Per-rank state dicts (rank order) → the TP = 1 state dict.

    Replicated entries must be equal on all ranks (checked); split entries are concatenated.
    """
    merged = {}
    for key in shards[0]:
        dim = dims.get(key)
        parts = [shard[key] for shard in shards]
        if dim is None:
            if any(not torch.equal(parts[0], p) for p in parts[1:]):
                raise ValueError(f"replicated parameter {key!r} differs between TP ranks")
            merged[key] = parts[0].clone()
        else:
            merged[key] = torch.cat(parts, dim=dim)
    return merged


def split_for_tp(full: Mapping[str, Tensor], dims: Mapping[str, Optional[int]], tp_size: int
                 ) -> list[dict[str, Tensor]]:
    """The TP = 1 state dict → one state dict per TP rank (the reverse of `merge_tp_shards`)."""
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp_size)]
    for key, value in full.items():
        dim = dims.get(key)
        if dim is not None and value.shape[dim] % tp_size:
            raise ValueError(f"{key!r} dim {dim} ({value.shape[dim]}) is not divisible by tp {tp_size}")
        pieces = value.chunk(tp_size, dim=dim) if dim is not None else [value] * tp_size
        for rank, piece in enumerate(pieces):
            shards[rank][key] = piece.clone()
    return shards


def gather_full_state_dict(module: nn.Module, state: ParallelState) -> dict[str, Tensor]:
    """Collective over the TP group: every rank returns the module's TP = 1 state dict."""
    dims = partition_dims(module)
    full = {}
    for key, value in module.state_dict().items():
        dim = dims.get(key)
        if dim is None or state.tp_size == 1:
            full[key] = value.detach().clone()
            continue
        parts = [torch.empty_like(value) for _ in range(state.tp_size)]
        dist.all_gather(parts, value.contiguous(), group=state.tp_group)
        full[key] = torch.cat(parts, dim=dim)
    return full


def load_full_state_dict(module: nn.Module, full: Mapping[str, Tensor], state: ParallelState,
                         strict: bool = True) -> None:
    """Load a TP = 1 state dict into a TP-sharded module (each rank takes its own blocks)."""
    shard = split_for_tp(full, partition_dims(module), state.tp_size)[state.tp_rank]
    module.load_state_dict(shard, strict=strict)
