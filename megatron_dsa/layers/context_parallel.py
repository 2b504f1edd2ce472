"""Context-parallel execution of one attention layer (see docs/parallelism.md, "Context parallelism").

Each CP rank holds pieces (chunks) of every sequence. This module turns the host-side plan into
the tensors a rank needs, with differentiable communication so backward sends every gradient home:

* W/C/H: every piece is extended by the `halo` rows that precede it in its sequence (the window and
  the compressor groups of its first tokens reach back that far). Those rows come from the ranks
  that own them: point to point (`p2p`) or by an all-gather of piece tails (`all_gather`). Every compressed entry is pooled exactly once, by the rank holding its last
  token; the entries (and the indexer keys) are then all-gathered, so each query sees exactly its
  ratio-causal set of global entries.
* M: the rows that make the other ranks' keys and values (the MLA latent and RoPE key per token, or
  K/V where the up-projection is an injected class) arrive one ring step at a time (`p2p`,
  isend/irecv) or at once (`all_gather`); each visiting key piece is up-projected where it is
  attended; attention runs per (query piece, key piece) block, skipping blocks entirely in the
  future, with a causal mask on the diagonal block, and the blocks are merged through their
  log-sum-exp.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterator, Optional, Protocol

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_dsa.backends import AUTO, OpFamily, Requested, dispatch
from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.device_cache import DeviceCache, KeepsDeviceValues, device_cached_property
from megatron_dsa.ops.dense_attention import accumulate_attention
from megatron_dsa.ops.indices import INVALID, RowSegments, VisibleEntries
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout
from megatron_dsa.ops.precision import compute_dtype
from megatron_dsa.ops.row_maps import RowMap
from megatron_dsa.packed_seq import PackedSeqParams, check_packed_hidden_states
from megatron_dsa.parallel.context import (ContextParallelPlan, Piece, RingTransfer, all_gather_rows, exchange_blocks,
                                           start_all_gather_rows)
from megatron_dsa.parallel.state import ParallelState


def block_relation(query: Piece, key: Piece) -> str:
    """How a query piece attends a key piece of the same sequence: `skip` (keys all in the future),
    `causal` (the same chunk: the diagonal block) or `full` (keys all in the past)."""
    if key.chunk > query.chunk:
        return "skip"
    return "causal" if key.chunk == query.chunk else "full"


MAX_SHARED_ROWS = 16  # row contexts kept (a step of a stack uses one per distinct halo)


@dataclass(frozen=True, eq=False)
class ContextParallelRows(KeepsDeviceValues):
    """One rank's view of a CP forward: its pieces, extended by their halos, as a `TokenLayout`.

    The row context (`layers.rows.TokenRows`) of a layer call under context parallelism. `batch`: B
    of an SBHD input `[S/cp, B, d]` (the rank's chunks along S), None for packed `[T/cp, 1, d]`.

    Everything it holds is a function of its fields, built on the host and copied to the device once:
    `for_input` shares one object per plan input (the sequence lengths, padded and real), rank, group,
    halo, device, comm type, ring key rows and B, so the layers of a step (those of one halo) and later steps
    of the same shapes or packing reuse it instead of rebuilding the plan and its index tensors every call."""

    plan: ContextParallelPlan
    rank: int
    group: ProcessGroup
    halo: int
    device: torch.device
    comm_type: str = "p2p"
    batch: Optional[int] = None
    ring_key_rows: int = HybridAttentionConfig.cp_ring_key_rows  # the config's (`_RingSchedule`)

    @classmethod
    def for_input(cls, hidden: Tensor, packed: Optional[PackedSeqParams], parallel_state: ParallelState,
                  config: HybridAttentionConfig, halo: int) -> "ContextParallelRows":
        """This rank's rows of the gathered layer input: SBHD `[S/cp, B, d]` holds its chunks along S;
        packed `[T/cp, 1, d]` its chunks of every sequence (`packed` describes the global pack, on the
        host; see `parallel.context`)."""
        state = parallel_state
        if packed is None:
            local, batch, _ = hidden.shape
            lengths, real = (local * state.cp_size,) * batch, None
        else:
            check_packed_hidden_states(hidden)
            cu = packed.cu_seqlens_q
            if cu.device.type != "cpu":
                raise ValueError("context parallelism with packed input needs packed_seq_params.cu_seqlens_q "
                                 "(and cu_seqlens_q_padded) on the host: the partition plan is host metadata")
            padded = cu if packed.cu_seqlens_q_padded is None else packed.cu_seqlens_q_padded
            lengths, real, batch = tuple((padded[1:] - padded[:-1]).tolist()), tuple((cu[1:] - cu[:-1]).tolist()), None

        def build() -> "ContextParallelRows":
            plan = ContextParallelPlan.build(lengths, state.cp_size, config.cp_partition, real)
            return cls(plan, state.cp_rank, state.cp_group, halo, hidden.device, config.cp_comm_type, batch,
                       config.cp_ring_key_rows)

        key = (lengths, real, state.cp_size, config.cp_partition, state.cp_rank, state.cp_group, halo, hidden.device,
               config.cp_comm_type, batch, config.cp_ring_key_rows)
        rows = _SHARED_ROWS.get(key, hidden.device, build)
        if packed is not None and hidden.shape[0] != rows.plan.local_rows(rows.rank):
            raise ValueError(f"packed hidden_states has {hidden.shape[0]} rows but this CP rank holds "
                             f"{rows.plan.local_rows(rows.rank)} (its chunks of every padded sequence)")
        return rows

    # ---------------------------------------------------------------- the layer's rows
    def enter(self, hidden: Tensor) -> Tensor:
        """This rank's input → its extended rows `[N_ext, d]` (halo rows fetched, padding zeroed)."""
        rows = hidden[:, 0] if self.batch is None else hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
        extended = self.extend(rows) if self.halo else rows
        return torch.where(self.layout.row_valid.unsqueeze(1), extended, 0.0) if self._padded else extended

    def leave(self, latent: Tensor) -> Tensor:
        """Extended rows `[N_ext, F]` → this rank's output, shaped as its input (halo and padding dropped)."""
        out = self.outputs(torch.where(self.layout.query_valid.unsqueeze(1), latent, 0.0) if self._padded else latent)
        return out.unsqueeze(1) if self.batch is None else out.view(self.batch, -1, out.shape[-1]).transpose(0, 1)

    def attend_causal(self, q: Tensor, keys: KeyValueSource, scale: float, backend: Requested) -> Tensor:
        """Causal attention over every rank's keys of the same sequences (`ring_attention`)."""
        return ring_attention(q, keys.ring_keys(), self.plan, self.rank, self.group, scale, self.comm_type,
                              self.ring_key_rows, backend)

    @cached_property
    def pieces(self) -> list[Piece]:
        return self.plan.pieces(self.rank)

    @cached_property
    def halo_lengths(self) -> list[int]:
        return [min(self.halo, p.start) for p in self.pieces]

    @cached_property
    def local_offsets(self) -> list[int]:
        """Row of each piece's first token in the rank's local rows."""
        starts, row = [], 0
        for piece in self.pieces:
            starts.append(row)
            row += piece.length
        return starts

    # ---------------------------------------------------------------- extended rows
    @cached_property
    def _segments(self) -> tuple[list[int], list[int], list[int]]:
        """Host lengths, position offsets and real (unpadded) lengths of the extended segments."""
        lengths = [h + p.length for h, p in zip(self.halo_lengths, self.pieces)]
        offsets = [p.start - h for h, p in zip(self.halo_lengths, self.pieces)]
        real = [max(0, min(length, p.real_length - offset))
                for length, offset, p in zip(lengths, offsets, self.pieces)]
        return lengths, offsets, real

    @cached_property
    def _padded(self) -> bool:
        """Whether some extended row is padding (then `enter` and `leave` zero those rows; else they skip
        the two `[N_ext, F]` selects and their backward)."""
        lengths, _, real = self._segments
        return lengths != real

    @device_cached_property
    def layout(self) -> TokenLayout:
        """Extended segments `[halo ; piece]`, positions global within each sequence."""
        lengths, offsets, real = self._segments
        cu = torch.tensor([0] + lengths, device=self.device).cumsum(0)
        as_tensor = lambda values: torch.tensor(values, device=self.device, dtype=torch.long)  # noqa: E731
        return TokenLayout(cu_seqlens=cu, num_rows=sum(lengths), max_seqlen=max(lengths, default=0),
                           seqlens=as_tensor(real), position_offsets=as_tensor(offsets),
                           halo_lengths=as_tensor(self.halo_lengths))

    def extend(self, rows: Tensor) -> Tensor:
        """Local rows `[N, F]` (pieces in order) → extended rows `[N_ext, F]` (halo rows fetched).

        Every rank offers the last `halo` rows of each of its pieces. `p2p` sends each tail only to
        the ranks whose halos read it (point to point, several preceding pieces when a piece is
        shorter than the halo); `all_gather` gathers all tails. Both give the same rank-major layout.
        """
        tails = self._tail_rows.take(torch.cat((rows, rows.new_zeros(1, rows.shape[1]))))
        if self.comm_type == "p2p":
            blocks = tails.view(len(self.pieces), self.halo, -1)
            gathered = exchange_blocks(blocks, self.group, self._wanted_tails).flatten(0, 1)
        else:
            gathered = all_gather_rows(tails, self.group)
        return self._extended_rows.take(torch.cat((rows, gathered)))

    @cached_property
    def _wanted_tails(self) -> tuple:
        """For every rank: the `(owner rank, piece slot)` tails its halos read (host plan)."""
        return tuple(tuple(sorted({(rank, slot) for rank, slot, _ in _halo_owners(self.plan, dst, self.halo).values()}))
                     for dst in range(self.plan.cp_size))

    @device_cached_property
    def _tail_rows(self) -> RowMap:
        """Each piece's last `halo` rows of `[local rows ; zero row]`, right-aligned; short pieces padded with
        the zero row."""
        index, zero_row = [], self.plan.local_rows(self.rank)
        for start, piece in zip(self.local_offsets, self.pieces):
            take = min(self.halo, piece.length)
            index += [zero_row] * (self.halo - take)
            index += list(range(start + piece.length - take, start + piece.length))
        return RowMap.build(torch.tensor(index, dtype=torch.long), zero_row + 1, self.device, free=(zero_row,))

    @device_cached_property
    def _extended_rows(self) -> RowMap:
        """Rows of `[local rows ; gathered tails]` that form the extended segments."""
        gathered = self.plan.cp_size * len(self.pieces) * self.halo
        return RowMap.build(self._extend_index(), self.plan.local_rows(self.rank) + gathered, self.device)

    def _extend_index(self) -> Tensor:
        """`_extended_rows`' index, on the host."""
        local_rows = self.plan.local_rows(self.rank)
        owner = self._piece_owners
        parts = []
        for halo, start, piece in zip(self.halo_lengths, self.local_offsets, self.pieces):
            halo_rows = []
            for position in range(piece.start - halo, piece.start):
                rank, slot, holder = owner[(piece.sequence, position)]
                # The tail of `holder` is right-aligned: its last row sits at slot offset halo − 1.
                halo_rows.append(local_rows + (rank * len(self.pieces) + slot) * self.halo
                                 + self.halo - (holder.start + holder.length - position))
            parts += [torch.tensor(halo_rows, dtype=torch.long), torch.arange(start, start + piece.length)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    @cached_property
    def _piece_owners(self) -> dict[tuple[int, int], tuple[int, int, Piece]]:
        return _halo_owners(self.plan, self.rank, self.halo)

    def outputs(self, extended: Tensor) -> Tensor:
        """Extended rows → this rank's piece rows (halo rows dropped)."""
        return self._piece_rows.take(extended) if self.halo else extended

    @device_cached_property
    def _piece_rows(self) -> RowMap:
        rows, cursor = [], 0
        for halo, piece in zip(self.halo_lengths, self.pieces):
            rows.append(torch.arange(cursor + halo, cursor + halo + piece.length))
            cursor += halo + piece.length
        return RowMap.build(torch.cat(rows) if rows else torch.empty(0, dtype=torch.long), cursor, self.device)

    # ---------------------------------------------------------------- compressed entries
    def owned_entries(self, piece: Piece, ratio: int) -> tuple[int, int]:
        """`[first, stop)`: entries whose last token `(j+1)·r − 1` lies in the piece (and in the
        real part of the sequence)."""
        first = piece.start // ratio
        stop = min((piece.start + piece.length) // ratio, piece.real_length // ratio)
        return first, max(first, stop)

    def compressed_layout(self, ratio: int) -> CompressedLayout:
        return self.kept(self._per_ratio, ("compressed_layout", ratio), lambda: self._compressed_layout(ratio))

    def _compressed_layout(self, ratio: int) -> CompressedLayout:
        spans = [self.owned_entries(p, ratio) for p in self.pieces]
        as_tensor = lambda values: torch.tensor(values, device=self.device, dtype=torch.long)  # noqa: E731
        counts = [stop - first for first, stop in spans]
        return CompressedLayout.owned(self.layout, ratio, as_tensor([f for f, _ in spans]),
                                      as_tensor(counts), capacity=sum(counts))

    def slots_per_piece(self, ratio: int) -> int:
        """Fixed per-piece slot count so every rank all-gathers the same number of rows."""
        return max((len(range(*self.owned_entries(p, ratio)))
                    for pieces in self.plan.all_pieces for p in pieces), default=0)

    def gather_entries(self, entries: Tensor, ratio: int) -> Callable[[], Tensor]:
        """Start gathering this rank's pooled entries `[Σ counts, F]`; the returned call gives every
        rank's, `[cp · pieces · slots, F]`. Compute queued in between overlaps the all-gather."""
        padded = torch.cat((entries, entries.new_zeros(1, entries.shape[1])))
        return start_all_gather_rows(self._slot_rows(ratio).take(padded), self.group)

    def _slot_rows(self, ratio: int) -> RowMap:
        """Rows of `[entries ; zero row]` that fill this rank's fixed slots (built once per ratio, so
        no host-to-device copy per step)."""
        def build() -> RowMap:
            slots, parts, cursor = self.slots_per_piece(ratio), [], 0
            counts = [len(range(*self.owned_entries(piece, ratio))) for piece in self.pieces]
            empty = sum(counts)
            for count in counts:
                parts += [torch.arange(cursor, cursor + count), torch.full((slots - count,), empty)]
                cursor += count
            index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
            return RowMap.build(index, empty + 1, self.device, free=(empty,))

        return self.kept(self._per_ratio, ("slot_rows", ratio), build)

    @cached_property
    def _per_ratio(self) -> dict[tuple[str, int], object]:
        """The values built once per compression ratio (`kept`: see `KeepsDeviceValues`)."""
        return {}

    def entry_table(self, ratio: int) -> Tensor:
        """`[nseq, C_max]` row of sequence `s`'s entry `j` in the gathered buffer (−1 past `C_s`)."""
        slots = self.slots_per_piece(ratio)
        per_rank = len(self.pieces)
        totals = [real // ratio for real in self.plan.real_lengths]
        table = torch.full((len(totals), max(totals, default=0)), INVALID, dtype=torch.long)
        for rank, pieces in enumerate(self.plan.all_pieces):
            for slot, piece in enumerate(pieces):
                first, stop = self.owned_entries(piece, ratio)
                rows = (rank * per_rank + slot) * slots + torch.arange(stop - first)
                table[piece.sequence, first:stop] = rows
        return table.to(self.device)

    def visible_entries(self, ratio: int) -> VisibleEntries:
        """Entries of the gathered buffer each extended row may see: column `j` is entry `j` of the
        row's sequence, visible when `j < floor((pos+1)/r)`."""
        return self.kept(self._per_ratio, ("visible_entries", ratio), lambda: self._visible_entries(ratio))

    def _visible_entries(self, ratio: int) -> VisibleEntries:
        sequences = torch.tensor([p.sequence for p in self.pieces], device=self.device)
        count = torch.div(self.layout.positions + 1, ratio, rounding_mode="floor")
        return VisibleEntries(self.entry_table(ratio), sequences[self.layout.segment_ids], count,
                              segments=self._row_segments(ratio))

    def _row_segments(self, ratio: int) -> Optional[RowSegments]:
        """The extended pieces as `RowSegments` for an SBHD batch (every sequence of one length, no padding: each
        sequence's entries all filled); None for packed input, whose sequences differ."""
        if self.batch is None or self._padded:
            return None
        lengths, offsets, _ = self._segments
        return RowSegments(ratio, tuple(zip(lengths, offsets, (piece.sequence for piece in self.pieces))))

    @cached_property
    def real_query_count(self) -> int:
        """Real query rows of the whole (global) batch: the divisor of the mean indexer loss."""
        return sum(self.plan.real_lengths)


_SHARED_ROWS: DeviceCache[ContextParallelRows] = DeviceCache(max_entries=MAX_SHARED_ROWS)


def _halo_owners(plan: ContextParallelPlan, rank: int, halo: int) -> dict[tuple[int, int], tuple[int, int, Piece]]:
    """(sequence, position) → (owner rank, piece slot there, piece) for every row `rank`'s halos read.

    Looked up by bisection over each sequence's pieces: O(halo · pieces) host work per call, never
    a walk over every position of the sequence (that cost tens of ms per layer at 128k tokens)."""
    by_sequence: dict[int, list[tuple[int, int, int, Piece]]] = {}
    for owner, pieces in enumerate(plan.all_pieces):
        for slot, piece in enumerate(pieces):
            by_sequence.setdefault(piece.sequence, []).append((piece.start, owner, slot, piece))
    for entries in by_sequence.values():
        entries.sort(key=lambda entry: entry[0])
    owners = {}
    for piece in plan.pieces(rank):
        entries = by_sequence[piece.sequence]
        starts = [entry[0] for entry in entries]
        for position in range(piece.start - min(halo, piece.start), piece.start):
            _, owner, slot, holder = entries[bisect.bisect_right(starts, position) - 1]
            owners[(piece.sequence, position)] = (owner, slot, holder)
    return owners


class KeyExpansion(Protocol):
    """How the rows an M ring carries become a block's keys and values, and how their gradients go back."""

    groups: int
    v_head_dim: int

    def keys_values(self, rows: Tensor, weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """Rows `[n, F]` → `k [n, G, Dqk]`, `v [n, G, Dv]`."""

    def backward(self, rows: Tensor, weight: Optional[Tensor], grad_k: Tensor, grad_v: Tensor,
                 grad_weight: Optional[Tensor]) -> Tensor:
        """The gradient of `rows` `[n, F]` (compute dtype) given those of `keys_values`' k and v (compute
        dtype); adds the gradient of `weight` into `grad_weight` (compute dtype) when one is given."""


@dataclass(frozen=True)
class RingKeys:
    """An M layer's keys and values as the CP ring carries them: this rank's `rows [N, F]` (pieces in
    order), which `expansion` turns into K/V block by block, with `weight` (None when the rows are K/V)."""

    rows: Tensor
    expansion: KeyExpansion
    weight: Optional[Tensor] = None


class KeyValueSource(Protocol):
    """An M layer's keys and values, as a row context asks for them."""

    def expand(self) -> tuple[Tensor, Tensor]:
        """`k [N, G, Dqk]`, `v [N, G, Dv]` of every row (differentiable)."""

    def ring_keys(self) -> RingKeys:
        """What a context-parallel ring carries instead (differentiable in its rows and weight)."""


@dataclass(frozen=True)
class PackedKeyValues:
    """Rows that are K and V already, packed `[n, G·Dqk + G·Dv]`: nothing to expand."""

    groups: int
    head_dim: int
    v_head_dim: int

    @classmethod
    def ring_keys(cls, k: Tensor, v: Tensor) -> RingKeys:
        """`k [N, G, Dqk]`, `v [N, G, Dv]` → the ring's rows."""
        return RingKeys(torch.cat((k.flatten(1), v.flatten(1)), dim=1), cls(k.shape[1], k.shape[2], v.shape[2]))

    def keys_values(self, rows: Tensor, weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        width = self.groups * self.head_dim
        return (rows[:, :width].unflatten(1, (self.groups, self.head_dim)),
                rows[:, width:].unflatten(1, (self.groups, self.v_head_dim)))

    def backward(self, rows: Tensor, weight: Optional[Tensor], grad_k: Tensor, grad_v: Tensor,
                 grad_weight: Optional[Tensor]) -> Tensor:
        return torch.cat((grad_k.flatten(1), grad_v.flatten(1)), dim=1)


def ring_attention(q: Tensor, keys: RingKeys, plan: ContextParallelPlan, rank: int, group: ProcessGroup,
                   scale: float, comm_type: str, key_rows: int, backend: Requested = AUTO) -> Tensor:
    """Causal attention of this rank's query pieces over every rank's key pieces (dense `M` kind).

    q `[N, H, Dqk]` and `keys.rows [N, F]` are this rank's rows (pieces in order). Returns `[N, H, Dv]`
    (sized by the query heads and the expansion's V head dim). The rows travel (`p2p`: around the ring;
    `all_gather`: all at once, their gradient reduce-scattered back) and each visiting key piece is
    expanded to K/V where it is attended. Each (query piece, key piece) block runs the dispatched
    `dense_attention_block_fwd` / `_bwd` ops of `backend` (a name, `auto` or the layer config). Key pieces are
    expanded in chunks of at most `key_rows` rows (`_RingSchedule`).
    """
    schedule = _RingSchedule(plan, rank, key_rows)
    rows = keys.rows
    if comm_type == "all_gather":
        rows = all_gather_rows(rows, group)
    return BlockAttentionFunction.apply(q, rows, keys.weight, keys.expansion, schedule, group, float(scale),
                                        backend, comm_type == "p2p")


def block_call(q: Tensor, expansion: KeyExpansion) -> dict:
    """The call description the dense block ops' probes read (shapes only, no device reads)."""
    return dict(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], v_head_dim=expansion.v_head_dim,
                heads=q.shape[1], groups=expansion.groups,
                lse_grad=False)  # the ring merges the LSE itself: no gradient flows into it


class _RingSchedule:
    """Which (query rows, key rows) blocks meet when rank `source`'s rows visit this rank.

    A key piece is cut into chunks of at most `key_rows` rows (the config's `cp_ring_key_rows`); the diagonal
    block of a piece then becomes, per key chunk, a causal square (the query rows at the chunk's own positions)
    and a fully visible block (the piece's query rows after it): the same (query, key) pairs, each met once.

    A block's temporaries grow with its key rows, not with the rank's: at dsv4's M dims (64 groups, qk 448 + 64,
    v 512) 1024 key rows up-project to 126 MB, make 67 MB of K and, in backward, 268 MB of float32 dK and dV; a
    whole piece (4096 rows at S = 16384 under CP-2) made 4× that. On H200s 1024-row chunks took CP-2's peak at
    16k from 0.69 to 0.46 of CP-1's and CP-4's to 0.30, for 4–7% more time than 2048-row ones
    (docs/performance.md)."""

    def __init__(self, plan: ContextParallelPlan, rank: int, key_rows: int):
        if key_rows < 1:
            raise ValueError(f"key_rows must be >= 1, got {key_rows}")
        self.plan, self.rank, self.key_rows = plan, rank, key_rows
        self.query_pieces = plan.pieces(rank)
        self.query_bounds = _piece_bounds(self.query_pieces)

    def blocks(self, source: int) -> list[tuple[slice, list[tuple[slice, bool]]]]:
        """`(key rows, [(query rows, causal), ...])` for every key chunk of `source` some query row attends
        (a block of another sequence, or with keys all in the future, is skipped)."""
        key_pieces = self.plan.pieces(source)
        found = []
        for key_piece, key_rows in zip(key_pieces, _piece_bounds(key_pieces)):
            relations = [(query_rows, block_relation(q_piece, key_piece))
                         for q_piece, query_rows in zip(self.query_pieces, self.query_bounds)
                         if q_piece.sequence == key_piece.sequence]
            for start in range(key_rows.start, key_rows.stop, self.key_rows):
                chunk = slice(start, min(start + self.key_rows, key_rows.stop))
                queries = []
                for query_rows, relation in relations:
                    if relation == "full":
                        queries.append((query_rows, False))
                    elif relation == "causal":  # the same positions: rows of the chunk, then the rows after it
                        first = query_rows.start + (chunk.start - key_rows.start)
                        after = first + (chunk.stop - chunk.start)
                        queries.append((slice(first, after), True))
                        if after < query_rows.stop:
                            queries.append((slice(after, query_rows.stop), False))
                if queries:
                    found.append((chunk, queries))
        return found


class BlockAttentionFunction(torch.autograd.Function):
    """M-kind attention over every rank's keys, block by block, as one autograd Function.

    `ring` (`p2p`; TransformerEngine's algorithm, docs/parallelism.md, 'the P2P ring'): the rows
    (`RingKeys`: the MLA latent and RoPE key per token, or packed K/V) travel to the next rank `cp − 1`
    times; each step's transfer is posted before the step's blocks are computed, so it overlaps them.
    Otherwise `rows` holds every rank's rows already (`[cp·N, F]`, all-gathered by the caller, whose
    backward reduce-scatters the gradient returned here).

    Memory (per rank, O(N) beyond one key piece): each visiting key piece is expanded to K/V only while
    its blocks run (forward), and again in backward; each block's `(out, lse)` is merged into one running
    result by LSE as soon as it is computed. Saved: q, the rows (the rank's own; all ranks' under
    `all_gather`), the expansion's weight, the returned output and the merged LSE; backward recomputes
    each block from them (`dense_attention_block_bwd`, probabilities `exp(s − lse_merged)`,
    `delta = <dO, O_merged>`) and turns its dK/dV into the rows' gradient at once (and the weight's, summed
    over every block this rank expanded). In the ring, each block's partial row-gradient sum travels with
    it one step behind (exchanged after the step's compute, awaited only after the next step's compute), so
    after the last step every rank holds its own rows' full gradient.
    """

    @staticmethod
    def forward(ctx, q: Tensor, rows: Tensor, weight: Optional[Tensor], expansion: KeyExpansion,
                schedule: _RingSchedule, group: ProcessGroup, scale: float, backend: Requested, ring: bool) -> Tensor:
        compute = compute_dtype(q.dtype)
        attend = dispatch(OpFamily.DENSE_ATTENTION_BLOCK_FWD, backend, **block_call(q, expansion))
        out = q.new_zeros(*q.shape[:2], expansion.v_head_dim, dtype=compute)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=compute)
        for source, rows_source in _visiting(rows, schedule, group, ring):
            for key_rows, queries in schedule.blocks(source):
                k, v = expansion.keys_values(rows_source[key_rows], weight)
                for query_rows, causal in queries:
                    accumulate_attention(out[query_rows], lse[query_rows], attend(q[query_rows], k, v, scale, causal))
                del k, v  # one key chunk's K/V alive at a time
        out = out.to(q.dtype)
        ctx.save_for_backward(q, rows, weight, out, lse)
        ctx.expansion, ctx.schedule, ctx.group, ctx.scale, ctx.backend, ctx.ring = (expansion, schedule, group,
                                                                                      scale, backend, ring)
        ctx.autocast = _autocast_state(q.device)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, rows, weight, out, lse = ctx.saved_tensors
        schedule, expansion = ctx.schedule, ctx.expansion
        cp = schedule.plan.cp_size
        block_grads = dispatch(OpFamily.DENSE_ATTENTION_BLOCK_BWD, ctx.backend, **block_call(q, expansion))
        grad_q = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        grad_weight = (torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if ctx.needs_input_grad[2]
                       else None)

        def grads_of(source: int, rows_source: Tensor, grad_rows: Tensor) -> None:
            """Add this rank's share of the gradient of `source`'s rows (`rows_source`) into `grad_rows`
            (compute dtype), the blocks' dQ into `grad_q` and the expansion weight's into `grad_weight`."""
            for key_rows, queries in schedule.blocks(source):
                keys = rows_source[key_rows]
                with torch.autocast(q.device.type, **ctx.autocast):  # K/V as forward expanded them
                    k, v = expansion.keys_values(keys, weight)
                for query_rows, causal in queries:
                    d_q, d_k, d_v = block_grads(q[query_rows], k, v, out[query_rows], lse[query_rows],
                                                grad_out[query_rows], ctx.scale, causal)
                    grad_q[query_rows] += d_q
                    del d_q  # a float32 block as large as q's piece: not alive beside the expansion's gradients
                    grad_rows[key_rows] += expansion.backward(keys, weight, d_k, d_v, grad_weight)
                del k, v

        if ctx.ring:
            arriving = grad_rows = None
            for source, rows_source in _visiting(rows, schedule, ctx.group, ring=True):
                grad_rows = torch.zeros(rows.shape, dtype=lse.dtype, device=rows.device)
                grads_of(source, rows_source, grad_rows)
                if arriving is not None:  # the predecessor's sum for these rows, from its previous step
                    grad_rows += arriving.wait()
                if cp > 1:
                    # Send the sum on with the rows' next visitor; receive the sum for our next rows. After
                    # the last step that is the sum for this rank's own rows: their gradient is home. Sums
                    # travel in the rows' dtype (one rounding per hop): packed K/V rows would otherwise carry
                    # float32 sums as large as a third of a bf16 rank's peak.
                    arriving, grad_rows = RingTransfer(grad_rows.to(rows.dtype), ctx.group), None
            home = arriving.wait() if arriving is not None else grad_rows
        else:
            home = torch.zeros(rows.shape, dtype=lse.dtype, device=rows.device)
            for source, (rows_source, grad_source) in enumerate(zip(rows.chunk(cp), home.chunk(cp))):
                grads_of(source, rows_source, grad_source)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_q.to(q.dtype), home.to(rows.dtype), grad_weight, None, None, None, None, None, None


def _autocast_state(device: torch.device) -> dict:
    """The forward's autocast settings for `device`, to expand K/V the same way in backward."""
    return dict(enabled=torch.is_autocast_enabled(device.type), dtype=torch.get_autocast_dtype(device.type))


def _visiting(rows: Tensor, schedule: _RingSchedule, group: ProcessGroup, ring: bool) -> Iterator[tuple[int, Tensor]]:
    """`(source rank, its rows)` in the order they are attended. Ring: the rank's own first, then each
    predecessor's as they arrive; the next transfer is posted before a step's rows are handed out, so the
    caller's compute overlaps it. Otherwise `rows` holds every rank's: its chunks in rank order."""
    cp = schedule.plan.cp_size
    if not ring:
        yield from enumerate(rows.chunk(cp))
        return
    for step in range(cp):
        transfer = RingTransfer(rows, group) if step + 1 < cp else None
        yield (schedule.rank - step) % cp, rows
        if transfer is not None:
            rows = transfer.wait()


def _piece_bounds(pieces: list[Piece]) -> list[slice]:
    bounds, row = [], 0
    for piece in pieces:
        bounds.append(slice(row, row + piece.length))
        row += piece.length
    return bounds


def context_halo(window: int, ratio: int) -> int:
    """Rows before a piece its first tokens depend on: the window, or the compressor's groups
    (`2r − 1` for the overlapping ratio 4, `r − 1` otherwise)."""
    compressor = 0 if ratio == 0 else (2 * ratio - 1 if ratio == 4 else ratio - 1)
    return max(window - 1, compressor, 0)
