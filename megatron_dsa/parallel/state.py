"""Process groups of the layer: tensor (TP), context (CP) and data (DP) parallel.

`ParallelState` only holds groups; it never creates them behind the caller's back. Build one with
`initialize_parallel_state(tp, cp)` after `torch.distributed.init_process_group`, or hand in groups a
host framework (Megatron-Core's `ProcessGroupCollection`) already created. `ParallelState()` with no
groups is the single-process state: every collective is then the identity.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: Optional[ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class ParallelState:
    """Groups the layer communicates over (None = size 1)."""

    tp_group: Optional[ProcessGroup] = None
    cp_group: Optional[ProcessGroup] = None
    dp_group: Optional[ProcessGroup] = None

    @property
    def tp_size(self) -> int:
        return group_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp_group)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp_group)

    @property
    def cp_rank(self) -> int:
        return group_rank(self.cp_group)

    @property
    def dp_size(self) -> int:
        return group_size(self.dp_group)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp_group)


def initialize_parallel_state(tp_size: int = 1, cp_size: int = 1,
                              timeout: Optional[datetime.timedelta] = None) -> ParallelState:
    """Split the default world into `dp × cp × tp` groups, TP fastest (Megatron rank order).

    Rank `r` has `tp_rank = r % tp`, `cp_rank = (r // tp) % cp`, `dp_rank = r // (tp·cp)`.
    Every rank must call this with the same arguments (group creation is collective). `timeout`:
    how long the groups' collectives wait for a rank (torch's default for new groups otherwise,
    which is not the default group's timeout).
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_parallel_state needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size < 1 or cp_size < 1 or world % (tp_size * cp_size):
        raise ValueError(f"world size {world} must be divisible by tp_size × cp_size = "
                         f"{tp_size} × {cp_size}")
    dp_size = world // (tp_size * cp_size)
    groups: dict[str, Optional[ProcessGroup]] = {"tp": None, "cp": None, "dp": None}
    for dp in range(dp_size):
        for cp in range(cp_size):
            _new_group_if_mine(groups, "tp", [dp * cp_size * tp_size + cp * tp_size + t
                                              for t in range(tp_size)], rank, timeout)
    for dp in range(dp_size):
        for tp in range(tp_size):
            _new_group_if_mine(groups, "cp", [dp * cp_size * tp_size + c * tp_size + tp
                                              for c in range(cp_size)], rank, timeout)
    for cp in range(cp_size):
        for tp in range(tp_size):
            _new_group_if_mine(groups, "dp", [d * cp_size * tp_size + cp * tp_size + tp
                                              for d in range(dp_size)], rank, timeout)
    return ParallelState(tp_group=groups["tp"], cp_group=groups["cp"], dp_group=groups["dp"])


def _new_group_if_mine(groups: dict, key: str, ranks: list[int], rank: int,
                       timeout: Optional[datetime.timedelta]) -> None:
    group = dist.new_group(ranks, timeout=timeout)  # every rank takes part in every new_group call
    if rank in ranks:
        groups[key] = group
