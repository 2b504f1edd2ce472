"""Context parallelism: sequence partitions and the autograd collectives of the CP ring.

Partitions (host-side plans, identical on every rank):

* `zigzag` (default, load-balanced): each sequence is cut into `2·cp` equal chunks; rank `r` holds
  chunks `r` and `2·cp − 1 − r`, so every rank gets the same amount of causal work.
* `contiguous`: `cp` equal chunks; rank `r` holds chunk `r`.

SBHD input `[S, B, d]` is split along `S` (`S` divisible by `2·cp`, resp. `cp`). Packed (THD) input
is split per sequence: every sequence's padded length must be divisible by `2·cp` (resp. `cp`) and
each rank holds its chunks of every sequence, in sequence order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_dsa.parallel.mappings import reduce_scatter_sum, start_all_gather_into
from megatron_dsa.parallel.state import group_size

PARTITIONS = ("zigzag", "contiguous")


def chunks_per_sequence(cp_size: int, partition: str) -> int:
    if partition not in PARTITIONS:
        raise ValueError(f"cp_partition must be one of {PARTITIONS}, got {partition!r}")
    return 2 * cp_size if partition == "zigzag" else cp_size


def rank_chunks(cp_size: int, cp_rank: int, partition: str) -> tuple[int, ...]:
    """Chunk ids (in local order) that `cp_rank` holds of every sequence."""
    if chunks_per_sequence(cp_size, partition) == cp_size:
        return (cp_rank,)
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


@dataclass(frozen=True)
class Piece:
    """One chunk of one sequence held by a rank: global positions `[start, start + length)`."""

    sequence: int
    chunk: int
    start: int
    length: int
    real_length: int  # real (unpadded) tokens of the whole sequence


@dataclass(frozen=True)
class ContextParallelPlan:
    """Which rows of which sequences every CP rank holds (host metadata, the same on all ranks).

    `sequence_lengths` are the (padded) physical lengths, `real_lengths` the real token counts.
    """

    sequence_lengths: tuple[int, ...]
    real_lengths: tuple[int, ...]
    cp_size: int
    partition: str

    @classmethod
    def build(cls, sequence_lengths: Sequence[int], cp_size: int, partition: str = "zigzag",
              real_lengths: Optional[Sequence[int]] = None) -> "ContextParallelPlan":
        chunks = chunks_per_sequence(cp_size, partition)
        for index, length in enumerate(sequence_lengths):
            if length % chunks:
                raise ValueError(f"sequence {index} has length {length}, which is not a multiple of "
                                 f"{chunks} ({'2·cp' if partition == 'zigzag' else 'cp'} for the "
                                 f"{partition} partition with cp={cp_size}); pad it to a multiple of {chunks}")
        real = tuple(real_lengths) if real_lengths is not None else tuple(sequence_lengths)
        return cls(tuple(sequence_lengths), real, cp_size, partition)

    def pieces(self, cp_rank: int) -> list[Piece]:
        """The pieces `cp_rank` holds, in local row order (sequence-major, then its chunk order)."""
        chunks = chunks_per_sequence(self.cp_size, self.partition)
        out = []
        for seq, (length, real) in enumerate(zip(self.sequence_lengths, self.real_lengths)):
            size = length // chunks
            for chunk in rank_chunks(self.cp_size, cp_rank, self.partition):
                out.append(Piece(seq, chunk, chunk * size, size, real))
        return out

    @cached_property
    def all_pieces(self) -> list[list[Piece]]:
        return [self.pieces(rank) for rank in range(self.cp_size)]

    def local_rows(self, cp_rank: int) -> int:
        return sum(p.length for p in self.pieces(cp_rank))

    def global_rows(self, cp_rank: int, sequence_starts: Sequence[int]) -> Tensor:
        """`[local rows]` row ids in the unsharded layout (sequence `s` starts at `sequence_starts[s]`)."""
        ids = [torch.arange(sequence_starts[p.sequence] + p.start,
                            sequence_starts[p.sequence] + p.start + p.length)
               for p in self.pieces(cp_rank)]
        return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)


def shard_sequence(x: Tensor, cp_size: int, cp_rank: int, partition: str = "zigzag",
                   dim: int = 0) -> Tensor:
    """This rank's part of an SBHD tensor along `dim` (the sequence), in local order."""
    plan = ContextParallelPlan.build([x.shape[dim]], cp_size, partition)
    return x.index_select(dim, plan.global_rows(cp_rank, [0]).to(x.device))


def unshard_sequence(parts: Sequence[Tensor], partition: str = "zigzag", dim: int = 0) -> Tensor:
    """Reassemble the full sequence from every rank's part (rank order)."""
    cp_size = len(parts)
    total = sum(p.shape[dim] for p in parts)
    plan = ContextParallelPlan.build([total], cp_size, partition)
    order = torch.cat([plan.global_rows(rank, [0]) for rank in range(cp_size)])
    stacked = torch.cat(list(parts), dim=dim)
    return stacked.index_select(dim, torch.argsort(order).to(stacked.device))


def shard_packed(x: Tensor, cu_seqlens_padded: Sequence[int], cp_size: int, cp_rank: int,
                 partition: str = "zigzag") -> Tensor:
    """This rank's rows of a packed `[T, ...]` tensor: its chunks of every sequence."""
    starts = list(cu_seqlens_padded[:-1])
    lengths = [b - a for a, b in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:])]
    plan = ContextParallelPlan.build(lengths, cp_size, partition)
    return x.index_select(0, plan.global_rows(cp_rank, starts).to(x.device))


# ---------------------------------------------------------------- autograd collectives over CP
class _StartAllGatherRows(torch.autograd.Function):
    """Forward posts an all-gather of equal-size row blocks (`async_op`) into a buffer it returns
    unfilled; `_FinishAllGatherRows` waits. Backward: every rank's gradient for each block is summed
    and the owner keeps its block (the adjoint of a gather: a reduce-scatter).

    On NCCL both are the single-tensor collectives (`mappings.start_all_gather_into`, `reduce_scatter_sum`):
    no staging copy, and half an all-reduce's bytes in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, pending: "PendingGather") -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        gathered = x.new_empty((size * x.shape[0], *x.shape[1:]))
        pending.source = x.contiguous()
        pending.work = start_all_gather_into(gathered, pending.source, group, async_op=True)
        return gathered

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_sum(grad, ctx.group), None, None


class _FinishAllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered: Tensor, pending: "PendingGather") -> Tensor:
        pending.wait()
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class PendingGather:
    """An all-gather in flight: compute queued before `finish()` overlaps it (on NCCL the wait is a
    stream dependency, not a host sync)."""

    def __init__(self, x: Tensor, group: ProcessGroup):
        self.work, self.source = None, None
        self._gathered = _StartAllGatherRows.apply(x, group, self)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work, self.source = None, None

    def finish(self) -> Tensor:
        """`[cp·n, ...]` in rank order (differentiable)."""
        return _FinishAllGatherRows.apply(self._gathered, self)


def start_all_gather_rows(x: Tensor, group: Optional[ProcessGroup]) -> Callable[[], Tensor]:
    """Begin gathering `[n, ...]` from each rank; the returned call gives `[cp·n, ...]` in rank order."""
    if group_size(group) == 1:
        return lambda: x
    return PendingGather(x, group).finish


def all_gather_rows(x: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    """`[n, ...]` from each rank → `[cp·n, ...]` in rank order (differentiable)."""
    return start_all_gather_rows(x, group)()


class RingTransfer:
    """One ring step in flight, outside autograd: `send` goes to the next CP rank while a tensor of
    the same shape and dtype arrives from the previous one.

    Every ring step is one symmetric group (a send and a receive), so the k-th group of each rank
    pairs with the k-th group of its neighbours: on NCCL, where a communicator's groups run in
    order on one stream, a lone send would wait for a receive queued behind the neighbour's own
    lone send (a deadlock once messages exceed NCCL's buffers). `wait` makes the current stream wait
    for the transfer (the host does not block), so compute queued before it overlaps the transfer.
    """

    def __init__(self, send: Tensor, group: ProcessGroup):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.send, self.received = send.contiguous(), torch.empty_like(send, memory_format=torch.contiguous_format)
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, self.send, dist.get_global_rank(group, (rank + 1) % size), group),
            dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % size), group)])

    def wait(self) -> Tensor:
        """Complete the step; returns the tensor received from the previous rank."""
        for request in self.requests:
            request.wait()
        self.requests, self.send = [], None
        return self.received


class _ExchangeBlocks(torch.autograd.Function):
    """Point-to-point block exchange laid out like an all-gather of equal blocks.

    Forward: block `b` of rank `src` lands at block `src·n + b` of the output on every rank that
    needs it (`wanted`); blocks nobody needs stay zero. Backward: each received block's gradient goes
    back to its sender and is added to the sender's block gradient.
    """

    @staticmethod
    def forward(ctx, blocks: Tensor, group: ProcessGroup, wanted: tuple) -> Tensor:
        ctx.group, ctx.wanted = group, wanted
        return _exchange(blocks, group, wanted, reverse=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.group, ctx.wanted, reverse=True), None, None


def _exchange(x: Tensor, group: ProcessGroup, wanted: tuple, reverse: bool) -> Tensor:
    """`wanted[dst]` = the `(src, block)` pairs rank `dst` reads. Forward fills an
    `[size·n, ...]` buffer from `[n, ...]` blocks; reverse sums the buffer gradients back."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[0] // size if reverse else x.shape[0]
    shape = x.shape[1:]
    out = torch.zeros((n if reverse else size * n, *shape), dtype=x.dtype, device=x.device)
    ops, pending = [], []
    for dst, pairs in enumerate(wanted):
        for src, block in pairs:
            if reverse:  # gradient of block (src, block) held by dst travels back to src
                if dst == rank and src == rank:
                    out[block] += x[src * n + block]
                elif dst == rank:
                    ops.append(dist.P2POp(dist.isend, x[src * n + block].contiguous(),
                                          dist.get_global_rank(group, src), group))
                elif src == rank:
                    buffer = torch.empty(shape, dtype=x.dtype, device=x.device)
                    ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, dst), group))
                    pending.append((block, buffer))
            else:
                if dst == rank and src == rank:
                    out[src * n + block] = x[block]
                elif src == rank:
                    ops.append(dist.P2POp(dist.isend, x[block].contiguous(),
                                          dist.get_global_rank(group, dst), group))
                elif dst == rank:
                    buffer = out[src * n + block]
                    ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, src), group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for block, buffer in pending:
        out[block] += buffer
    return out


def exchange_blocks(blocks: Tensor, group: Optional[ProcessGroup], wanted: tuple) -> Tensor:
    """`[n, ...]` blocks per rank → `[cp·n, ...]` where only the blocks in `wanted[this rank]`
    (pairs `(src rank, block)`) are filled, sent point to point; differentiable."""
    if group_size(group) == 1:
        return blocks
    return _ExchangeBlocks.apply(blocks, group, wanted)
