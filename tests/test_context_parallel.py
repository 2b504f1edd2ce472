"""CP-N == CP-1 on real gloo process groups, fp64, every layer kind, SBHD and ragged THD.

Per rank: the output and input gradient equal the matching slices of the single-process run; the
parameter gradients summed over CP equal the single-process gradients (so not cp× too large); the
indexer losses of the CP ranks add up to the single-process loss; the selected compressed entries
(global ids) are the same sets. fp64 end to end: tolerance 1e-12 absolute.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from distributed import assert_bf16_parity, run_distributed
from live_memory import LiveBytes
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.device_cache import DeviceCache
from megatron_dsa.layers import context_parallel
from megatron_dsa.layers.rows import token_rows
from megatron_dsa.layers.submodules import HybridAttentionSubmodules
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel import ColumnParallelLinear, initialize_parallel_state
from megatron_dsa.parallel.context import ContextParallelPlan, shard_packed, shard_sequence, unshard_sequence
from megatron_dsa.parallel.sharding import load_full_state_dict, partition_dims

ATOL = 1e-12
RAGGED = [5, 27, 100, 3, 29]  # lengths not multiples of the ratio, one shorter than the window


def cp_config(kind: str, partition: str, comm: str, **overrides) -> HybridAttentionConfig:
    # M: GQA with qk_head_dim + P = 48 != v_head_dim = 32, so a ring that shapes its output like K
    # instead of (query heads, v_head_dim) fails (bug class A6.1).
    values = dict(num_layers=1, layer_pattern=kind, csa_window_size=8, hca_compress_ratio=8,
                  dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.5, cp_partition=partition,
                  cp_comm_type=comm, o_groups=2, num_query_groups=2, qk_head_dim=40)
    return HybridAttentionConfig.from_preset("tiny", **{**values, **overrides})


@dataclass
class Batch:
    hidden: torch.Tensor
    upstream: torch.Tensor
    packed: Optional[PackedSeqParams]
    cu_padded: Optional[list[int]]


def make_batch(config: HybridAttentionConfig, chunks: int, packed: bool, seqlen: int = 48) -> Batch:
    if not packed:
        hidden = torch.randn(seqlen, 2, config.hidden_size, dtype=torch.float64)
        return Batch(hidden, torch.randn_like(hidden), None, None)
    padded = [-(-length // chunks) * chunks + chunks for length in RAGGED]  # ≥ one chunk of padding
    cu = torch.tensor([0] + RAGGED).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    hidden = torch.randn(int(cu_padded[-1]), 1, config.hidden_size, dtype=torch.float64)
    params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded, max_seqlen_q=max(padded))
    return Batch(hidden, torch.randn_like(hidden), params, cu_padded.tolist())


def reference(config: HybridAttentionConfig, kind: str, batch: Batch):
    layer = HybridAttention(config, kind=kind).double()
    if hasattr(layer, "core_attention"):
        with torch.no_grad():
            layer.core_attention.attn_sink.normal_()
    x = batch.hidden.clone().requires_grad_()
    out, _ = layer(x, packed_seq_params=batch.packed)
    (out * batch.upstream).sum().backward()
    return layer, x, out


def close(actual, expected, what):
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= ATOL, f"{what}: max abs error {err:.3e}"


def cp_parity_body(rank: int, world: int, partition: str, comm: str, packed: bool, kinds: str,
                   tp: int = 1, window: int = 8, seqlen: int = 48, block_backend: str = "auto") -> None:
    state = initialize_parallel_state(tp_size=tp, cp_size=world // tp)
    cp, cp_rank = state.cp_size, state.cp_rank
    chunks = 2 * cp if partition == "zigzag" else cp
    blocks = {"dense_attention_block_fwd": block_backend, "dense_attention_block_bwd": block_backend}
    for kind in kinds:
        for sparse in ((True, False) if kind == "C" else (True,)):
            config = cp_config(kind, partition, comm, dsa_indexer_use_sparse_loss=sparse, csa_window_size=window,
                               attention_backend_overrides=blocks)
            torch.manual_seed(17)
            batch = make_batch(config, chunks, packed, seqlen)
            ref, x, ref_out = reference(config, kind, batch)
            if packed:
                mine = lambda t: shard_packed(t, batch.cu_padded, cp, cp_rank, partition)  # noqa: E731
            else:
                mine = lambda t: shard_sequence(t, cp, cp_rank, partition)  # noqa: E731
            layer = HybridAttention(config, kind=kind, parallel_state=state).double()
            load_full_state_dict(layer, ref.state_dict(), state)
            x_local = mine(batch.hidden).clone().requires_grad_()
            out, _ = layer(x_local, packed_seq_params=batch.packed)
            (out * mine(batch.upstream)).sum().backward()
            tag = f"{kind} sparse={sparse} {partition}/{comm} packed={packed} rank={rank}"
            close(out, mine(ref_out), f"{tag} output")
            close(x_local.grad, mine(x.grad), f"{tag} input grad")
            dims = partition_dims(layer)
            for name, param in layer.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=state.cp_group)
                if dims[name] is not None and tp > 1:  # TP-split: gather to the TP = 1 layout
                    parts = [torch.empty_like(grad) for _ in range(tp)]
                    dist.all_gather(parts, grad, group=state.tp_group)
                    grad = torch.cat(parts, dim=dims[name])
                close(grad, dict(ref.named_parameters())[name].grad, f"{tag} grad of {name}")
            if kind == "C":
                loss = layer.last_indexer_loss.clone()
                dist.all_reduce(loss, group=state.cp_group)
                close(loss, ref.last_indexer_loss, f"{tag} indexer loss")
                assert_same_selection(layer, ref, mine, packed)


def assert_same_selection(layer, ref, mine, packed: bool) -> None:
    """The indexer's picks, as entry numbers j of each query's sequence, are the same sets."""
    picks = ref.core_attention.last_selection.entries
    if not packed:  # reference rows are batch-major [B·S]; shard them along S like the input
        batch = 2
        picks = picks.view(batch, -1, picks.shape[1]).transpose(0, 1)
        picks = mine(picks).transpose(0, 1).reshape(-1, picks.shape[-1])
    else:
        picks = mine(picks)
    ours = layer.core_attention.last_selection.entries
    assert ours.shape == picks.shape
    assert torch.equal(ours.sort(1).values, picks.sort(1).values), "top-k sets differ"


@pytest.mark.parametrize("world,partition,comm,packed", [
    (2, "zigzag", "p2p", False),
    (2, "zigzag", "p2p", True),
    (2, "contiguous", "all_gather", True),
    (4, "zigzag", "all_gather", False),
    (4, "zigzag", "p2p", True),
    (4, "contiguous", "p2p", False),
])
def test_context_parallel_matches_single_process(world, partition, comm, packed):
    run_distributed(cp_parity_body, world, partition, comm, packed, "WCHM", timeout_s=300)


def test_context_parallel_with_a_window_shorter_than_two_compression_groups():
    """Window 4 against ratio 4 (C) and 8 (H): the halo a rank borrows is set by the compressor's
    groups, not by the window. S = 44 makes zigzag chunks of 11 rows, so chunk starts fall inside
    compressor groups: a halo one row short changes the first rows of a chunk."""
    run_distributed(cp_parity_body, 2, "zigzag", "p2p", False, "CH", 1, 4, 44, timeout_s=300)


def test_tensor_and_context_parallel_grid():
    """TP 2 × CP 2 (4 ranks): heads split over TP, sequence pieces over CP, ragged packed input."""
    run_distributed(cp_parity_body, 4, "zigzag", "p2p", True, "WCHM", 2, timeout_s=300)


def packed_batch(config: HybridAttentionConfig, real: list[int], padded: list[int]) -> Batch:
    cu = torch.tensor([0] + real).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    hidden = torch.randn(int(cu_padded[-1]), 1, config.hidden_size, dtype=torch.float64)
    params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded, max_seqlen_q=max(padded))
    return Batch(hidden, torch.randn_like(hidden), params, cu_padded.tolist())


def cudnn_row_segments_body(rank: int, world: int, comm: str) -> None:
    """A bf16 C layer under CP-2 (SBHD, B = 2) whose selection scores run on the cuDNN indexer forward over the
    rank's row segments, the kernel being this repository's CPU model of it (`vendor_fakes.FakeCudnnDSA`: THD
    segments, causal offsets, −inf limits), against the unfused single-process layer: the same picks, and
    outputs and gradients within the bf16 parity bounds (the indexer's through the KL loss, which reads the
    scores)."""
    import sys

    from megatron_dsa.backends import probes
    from vendor_fakes import FakeCudnnDSA, fake_cudnn

    # A fresh process: nothing probed yet, so the fake package and a Hopper capability are what the probes see.
    sys.modules["cudnn"] = fake_cudnn(FakeCudnnDSA(128))
    probes.cuda_capability = lambda device: (9, 0)
    state = initialize_parallel_state(cp_size=world)
    config = cp_config("C", "zigzag", comm, dsa_indexer_n_heads=16, dsa_indexer_head_dim=128,
                       attention_backend="unfused")
    torch.manual_seed(23)
    ref = HybridAttention(config, kind="C").bfloat16()
    x = torch.randn(48, 2, config.hidden_size).bfloat16().requires_grad_()
    upstream = torch.randn(48, 2, config.hidden_size)
    ref_out, _ = ref(x)
    (ref_out.float() * upstream).sum().backward()
    fused = config.replace(attention_backend_overrides={"indexer_scores": "cudnn"})
    layer = HybridAttention(fused, kind="C", parallel_state=state).bfloat16()
    layer.load_state_dict(ref.state_dict())
    mine = lambda t: shard_sequence(t, world, rank, "zigzag")  # noqa: E731
    x_local = mine(x.detach()).clone().requires_grad_()
    reset_call_counts()
    out, _ = layer(x_local)
    assert call_counts().get(("cudnn", "indexer_scores"), 0) > 0, call_counts()
    (out.float() * mine(upstream)).sum().backward()
    assert_same_selection(layer, ref, mine, packed=False)
    pairs = [("output", out, mine(ref_out)), ("input grad", x_local.grad, mine(x.grad))]
    pairs += list(cp_summed_grads(layer, ref, state.cp_group, torch.float32))
    assert_bf16_parity(pairs, f"C/{comm} cuDNN indexer on row segments rank={rank}")


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_cudnn_indexer_scores_row_segments_under_cp(comm):
    run_distributed(cudnn_row_segments_body, 2, comm, timeout_s=300)


def shared_rows_body(rank: int, world: int) -> None:
    """The CP row context is shared while the packing is the same and rebuilt when it changes: packings
    of one total row count (documents reordered; the same padding holding other real lengths) each
    match the single-process run after another one was cached, and a repeated packing reuses the rows."""
    state = initialize_parallel_state(cp_size=world)
    config = cp_config("C", "zigzag", "p2p")
    padded = [-(-length // (2 * world)) * (2 * world) + 2 * world for length in RAGGED]
    torch.manual_seed(5)
    packings = {"ragged": packed_batch(config, RAGGED, padded),
                "reordered": packed_batch(config, RAGGED[::-1], padded[::-1]),
                "other real lengths": packed_batch(config, [length - 1 for length in RAGGED], padded)}
    layer = HybridAttention(config, kind="C", parallel_state=state).double()
    halo = layer.kind_spec.context_halo(config)
    outputs = {}
    for name in ("ragged", "reordered", "other real lengths", "ragged"):
        batch = packings[name]
        torch.manual_seed(17)  # the same weights for every packing
        ref, x, ref_out = reference(config, "C", batch)
        load_full_state_dict(layer, ref.state_dict(), state)
        mine = lambda t: shard_packed(t, batch.cu_padded, world, rank, "zigzag")  # noqa: E731
        x_local = mine(batch.hidden).clone().requires_grad_()
        out, _ = layer(x_local, packed_seq_params=batch.packed)
        (out * mine(batch.upstream)).sum().backward()
        close(out, mine(ref_out), f"{name} output rank={rank}")
        close(x_local.grad, mine(x.grad), f"{name} input grad rank={rank}")
        outputs.setdefault(name, []).append(out.detach())
    assert torch.equal(*outputs["ragged"]), "the repeated packing gave another output"

    rows = {name: token_rows(mine(batch.hidden), None, batch.packed, state, config, halo)
            for name, batch in packings.items()}
    assert len({id(r) for r in rows.values()}) == 3, "two packings share one row context"
    batch = packings["reordered"]
    mine = lambda t: shard_packed(t, batch.cu_padded, world, rank, "zigzag")  # noqa: E731
    assert token_rows(mine(batch.hidden), None, batch.packed, state, config, halo) is rows["reordered"]
    assert token_rows(mine(batch.hidden), None, batch.packed, state, config, halo + 1) is not rows["reordered"]
    cached, _ = layer(mine(batch.hidden), packed_seq_params=batch.packed)
    shared, context_parallel._SHARED_ROWS = context_parallel._SHARED_ROWS, DeviceCache()  # the uncached path
    try:
        rebuilt, _ = layer(mine(batch.hidden), packed_seq_params=batch.packed)
    finally:
        context_parallel._SHARED_ROWS = shared
    assert torch.equal(cached, rebuilt)


def test_cp_row_context_is_shared_until_the_packing_changes():
    run_distributed(shared_rows_body, 2, timeout_s=300)


def m_block_ops_body(rank: int, world: int, comm: str, block_backend: str) -> None:
    """M layer, CP == CP-1 (fp64) with the ring's blocks on `block_backend`, and the dispatched block ops of
    that backend ran (and no other's) in forward and backward."""
    reset_call_counts()
    cp_parity_body(rank, world, "zigzag", comm, False, "M", block_backend=block_backend)
    counts = {key: n for key, n in call_counts().items() if key[1].startswith("dense_attention_block")}
    ran = block_backend if block_backend != "auto" else "unfused"  # auto on a CPU: the reference
    assert set(counts) == {(ran, "dense_attention_block_fwd"), (ran, "dense_attention_block_bwd")}, counts
    # zigzag, 2·cp chunks: a rank's two pieces of a sequence see 2·cp + 1 blocks in all (B = 2 sequences),
    # forward and backward alike
    assert counts[(ran, "dense_attention_block_fwd")] == counts[(ran, "dense_attention_block_bwd")] == 2 * (2 * world + 1)


@pytest.mark.parametrize("world,comm,block_backend", [(2, "p2p", "torch_sdpa"), (2, "all_gather", "torch_sdpa"),
                                                      (4, "p2p", "auto")])
def test_m_ring_blocks_run_the_dispatched_block_ops(world, comm, block_backend):
    """torch_sdpa: its CPU flash kernel (forward, and backward from the merged out/LSE) runs every block."""
    run_distributed(m_block_ops_body, world, comm, block_backend, timeout_s=120)


MEMORY_ROWS = 1024


def m_layer_memory(world: int = 1, rank: int = 0, state=None, comm: str = "p2p",
                   key_rows: int = MEMORY_ROWS // 16) -> tuple[int, int]:
    """(peak live bytes of fwd+bwd, bytes saved for backward) of a bf16 M layer on this rank's share of
    `MEMORY_ROWS` tokens. Dims in dsv4-flash's proportions (H = G, qk = v head dim), the logit chunk half the
    query block, as at 16k tokens on a GPU: what scales with CP there scales here. The ring's key chunks
    (`cp_ring_key_rows`) are a quarter of a CP-2 piece by default, as 1024 rows are at 16k tokens."""
    import megatron_dsa.ops.dense_attention as dense

    heads, head_dim = 8, 64
    default_chunk, dense.CHUNK_ELEMENTS = dense.CHUNK_ELEMENTS, MEMORY_ROWS * heads * head_dim // 2
    config = HybridAttentionConfig.from_preset(
        "tiny", num_layers=1, layer_pattern="M", hidden_size=512, num_attention_heads=heads, num_query_groups=heads,
        qk_head_dim=head_dim - 16, qk_pos_emb_head_dim=16, v_head_dim=head_dim, kv_lora_rank=64, q_lora_rank=128,
        o_groups=8, o_lora_rank=128, cp_comm_type=comm, cp_ring_key_rows=key_rows)
    torch.manual_seed(0)
    layer = HybridAttention(config, kind="M", parallel_state=state).bfloat16()
    x = shard_sequence(torch.randn(MEMORY_ROWS, 1, 512).bfloat16(), world, rank, "zigzag").requires_grad_()
    try:
        with LiveBytes() as memory:
            out, _ = layer(x)
            saved = memory.saved
            out.float().square().mean().backward()
            del out
    finally:
        dense.CHUNK_ELEMENTS = default_chunk
    return memory.peak, saved


# (peak, saved) bounds per CP size, measured: CP-2 0.439 / 0.455 of CP-1 (all_gather 0.439 / 0.464), CP-4
# 0.261 / 0.281, with key chunks a quarter of a CP-2 piece; with a whole piece per block: CP-2 0.507 (0.524 in
# an earlier measurement, before the ring's backward was trimmed), CP-4 0.284.
# Before the ring carried the MLA latent: 0.685 / 0.568 and 0.385 / 0.338 (all_gather 0.685 / 0.683 and
# 0.471 / 0.511); before it merged blocks online, kept no list of partials and sent dK/dV sums in K/V's
# dtype: 0.92 / 0.67 at CP-2.
MEMORY_BOUNDS = {2: (0.47, 0.48), 4: (0.28, 0.30)}


def m_memory_body(rank: int, world: int, comms: tuple[str, ...], single_peak: int, single_saved: int) -> None:
    state = initialize_parallel_state(cp_size=world)
    peak_bound, saved_bound = MEMORY_BOUNDS[world]
    for comm in comms:
        peak, saved = m_layer_memory(world, rank, state, comm)
        assert peak <= peak_bound * single_peak, \
            f"rank {rank}: CP-{world} {comm} peak {peak / single_peak:.3f} of CP-1"
        assert saved <= saved_bound * single_saved, \
            f"rank {rank}: CP-{world} {comm} saved {saved / single_saved:.3f} of CP-1"


@pytest.mark.parametrize("world,comms", [(2, ("p2p", "all_gather")), (4, ("p2p",))])
def test_m_layer_memory_per_rank_shrinks_with_cp(world, comms):
    """Per-rank peak of live tensors and bytes saved for backward of an M layer, CP-N against CP-1: near
    1/N, since the ring carries the MLA latent and expands one visiting key piece at a time."""
    run_distributed(m_memory_body, world, comms, *m_layer_memory(), timeout_s=120)


class CountingColumn(ColumnParallelLinear):
    """An injected column-parallel class (its own forward): the ring cannot recompute it per block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def m_ring_rows_body(rank: int, world: int) -> None:
    """What an M layer's ring sends and gathers: the normalised latent and RoPE key per token (`R + P`
    columns) with the package's up-projection, expanded K/V (`G·(Dqk + Dv)`) with an injected class; both
    give the CP-1 output, input gradient and every (CP-summed) parameter gradient (fp64)."""
    state = initialize_parallel_state(cp_size=world)
    for comm, injected in (("p2p", False), ("all_gather", False), ("p2p", True)):
        check_m_ring_rows(rank, world, state, comm, injected)


def check_m_ring_rows(rank: int, world: int, state, comm: str, injected: bool) -> None:
    import megatron_dsa.layers.context_parallel as context_parallel

    config = cp_config("M", "zigzag", comm)
    submodules = HybridAttentionSubmodules(column_parallel_linear=CountingColumn) if injected else None
    torch.manual_seed(3)
    batch = make_batch(config, 2 * world, packed=False)
    ref = HybridAttention(config, kind="M", submodules=submodules).double()
    x = batch.hidden.clone().requires_grad_()
    ref_out, _ = ref(x)
    (ref_out * batch.upstream).sum().backward()
    layer = HybridAttention(config, kind="M", parallel_state=state, submodules=submodules).double()
    layer.load_state_dict(ref.state_dict())
    assert isinstance(layer.linear_kv_up_proj, CountingColumn) == injected
    widths = []
    transfer, gather = context_parallel.RingTransfer, context_parallel.all_gather_rows

    class RecordedTransfer(transfer):
        def __init__(self, send, group):
            widths.append(send.shape[1])
            super().__init__(send, group)

    def recorded_gather(rows, group):
        widths.append(rows.shape[1])
        return gather(rows, group)

    context_parallel.RingTransfer, context_parallel.all_gather_rows = RecordedTransfer, recorded_gather
    try:
        mine = lambda t: shard_sequence(t, world, rank, "zigzag")  # noqa: E731
        x_local = mine(batch.hidden).clone().requires_grad_()
        out, _ = layer(x_local)
        (out * mine(batch.upstream)).sum().backward()
    finally:
        context_parallel.RingTransfer, context_parallel.all_gather_rows = transfer, gather
    c = config
    width = (c.mla_num_query_groups * (c.mla_qk_head_dim + c.qk_pos_emb_head_dim + c.v_head_dim) if injected
             else c.mla_kv_lora_rank + c.qk_pos_emb_head_dim)
    # p2p: the rows go round in forward and again in backward (cp − 1 steps each), their gradient sums once
    # per backward step (cp); all_gather: one gather (its backward reduce-scatters)
    assert widths == ([width] * (3 * world - 2) if comm == "p2p" else [width]), widths
    tag = f"M {comm} injected={injected} rank={rank}"
    close(out, mine(ref_out), f"{tag} output")
    close(x_local.grad, mine(x.grad), f"{tag} input grad")
    for name, grad, expected in cp_summed_grads(layer, ref, state.cp_group):
        close(grad, expected, f"{tag} grad of {name}")


def test_m_ring_carries_the_latent_unless_the_up_projection_is_injected():
    run_distributed(m_ring_rows_body, 2, timeout_s=120)


def cp_summed_grads(layer: HybridAttention, ref: HybridAttention, group, dtype=None):
    """`(name, this rank's gradient summed over the CP group, the CP-1 layer's gradient)` per parameter (in
    `dtype`, if given): every rank's share of a replicated parameter's gradient adds up to CP-1's."""
    expected = dict(ref.named_parameters())
    for name, param in layer.named_parameters():
        grad = param.grad.to(dtype or param.grad.dtype, copy=True)
        dist.all_reduce(grad, group=group)
        yield name, grad, expected[name].grad


def m_autocast_body(rank: int, world: int) -> None:
    """fp32 parameters under bf16 autocast (the training job's mixed precision): the ring expands K/V in
    backward as autocast did in forward, and CP-2 agrees with the fp64 CP-1 layer to bf16 accuracy."""
    state = initialize_parallel_state(cp_size=world)
    for comm in ("p2p", "all_gather"):
        check_m_autocast(rank, world, state, comm)


def check_m_autocast(rank: int, world: int, state, comm: str) -> None:
    config = cp_config("M", "zigzag", comm)
    torch.manual_seed(6)
    batch = make_batch(config, 2 * world, packed=False)
    ref, x, ref_out = reference(config, "M", batch)
    layer = HybridAttention(config, kind="M", parallel_state=state)
    layer.load_state_dict(ref.state_dict())
    mine = lambda t: shard_sequence(t, world, rank, "zigzag")  # noqa: E731
    x_local = mine(batch.hidden).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x_local)
    (out.double() * mine(batch.upstream)).sum().backward()
    pairs = [("output", out, mine(ref_out)), ("input grad", x_local.grad, mine(x.grad))]
    pairs += [(f"grad {name}", grad, expected) for name, grad, expected in cp_summed_grads(layer, ref, state.cp_group)]
    assert_bf16_parity(pairs, f"M {comm} autocast rank={rank}")


def test_m_ring_under_autocast_matches_fp64():
    run_distributed(m_autocast_body, 2, timeout_s=120)


def wrong_section_body(rank: int, world: int) -> None:
    """A6.3 negative control: a ring that treats the diagonal block as fully visible leaks the
    future, and the parity check catches it (so the CP tests have power)."""
    import megatron_dsa.layers.context_parallel as context_parallel

    original = context_parallel.block_relation
    context_parallel.block_relation = lambda q, k: "full" if original(q, k) == "causal" else original(q, k)
    try:
        cp_parity_body(rank, world, "zigzag", "p2p", False, "M")
    except AssertionError as error:
        assert "output" in str(error)
    else:
        raise AssertionError("the wrong-section ring passed the parity check")
    finally:
        context_parallel.block_relation = original


def test_wrong_ring_section_is_caught():
    run_distributed(wrong_section_body, 2)


def unshard_body(rank: int, world: int) -> None:
    full = torch.arange(48.0).view(48, 1)
    for partition in ("zigzag", "contiguous"):
        part = shard_sequence(full, world, rank, partition)
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part)
        assert torch.equal(unshard_sequence(parts, partition), full)


def test_shard_unshard_round_trip():
    run_distributed(unshard_body, 2)


@pytest.mark.parametrize("partition,expected", [
    ("zigzag", [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]),
    ("contiguous", [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
])
def test_partition_rows(partition, expected):
    full = torch.arange(12)
    assert [shard_sequence(full, 2, r, partition).tolist() for r in range(2)] == expected


def test_non_divisible_length_names_the_multiple():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        shard_sequence(torch.zeros(30), 4, 0, "zigzag")



def nccl_bf16_parity(rank: int, world: int, state, config: HybridAttentionConfig, kind: str, seqlen: int,
                     batch: int, seed: int, tag: str) -> None:
    """bf16 CP-`world` layer (NCCL) vs the bf16 single-GPU layer with the same weights, zigzag SBHD:
    outputs, input grads and CP-summed parameter grads (tolerances: `assert_bf16_parity`)."""
    device = torch.device("cuda", rank)
    torch.manual_seed(seed)
    ref = HybridAttention(config, kind=kind).to(device)
    if hasattr(ref, "core_attention"):
        with torch.no_grad():
            ref.core_attention.attn_sink.normal_()
    ref = ref.bfloat16()
    x = torch.randn(seqlen, batch, config.hidden_size, device=device).bfloat16().requires_grad_()
    upstream = torch.randn(seqlen, batch, config.hidden_size, device=device)
    ref_out, _ = ref(x)
    (ref_out.float() * upstream).sum().backward()
    layer = HybridAttention(config, kind=kind, parallel_state=state).to(device).bfloat16()
    layer.load_state_dict(ref.state_dict())
    mine = lambda t: shard_sequence(t, world, rank, "zigzag")  # noqa: E731
    x_local = mine(x.detach()).clone().requires_grad_()
    out, _ = layer(x_local)
    (out.float() * mine(upstream)).sum().backward()
    pairs = [("output", out, mine(ref_out)), ("input grad", x_local.grad, mine(x.grad))]
    pairs += [(f"grad {name}", grad, expected)
              for name, grad, expected in cp_summed_grads(layer, ref, state.cp_group, torch.float32)]
    assert_bf16_parity(pairs, f"{tag} rank={rank}")


def nccl_bf16_body(rank: int, world: int) -> None:
    """Every kind, both comm types, S=512, B=2. The C layer keeps every visible entry so that bf16
    near-ties cannot change the selection."""
    state = initialize_parallel_state(cp_size=world)
    for kind in "WCHM":
        for comm in ("p2p", "all_gather"):
            config = cp_config(kind, "zigzag", comm, dsa_indexer_topk=128)
            nccl_bf16_parity(rank, world, state, config, kind, 512, 2, 3, f"{kind}/{comm}")
    # Indexer head dim 128: where the cuDNN frontend is installed its fused indexer backward runs
    # under CP (halo rows weighted 0, ids into the all-gathered keys), and must have run.
    reset_call_counts()
    config = cp_config("C", "zigzag", "p2p", dsa_indexer_topk=128, dsa_indexer_head_dim=128)
    nccl_bf16_parity(rank, world, state, config, "C", 512, 2, 3, "C/p2p indexer 128")
    if importlib.util.find_spec("cudnn") is not None:
        assert call_counts()[("cudnn", "indexer_kl_bwd")] > 0, call_counts()
    # 64 indexer heads of 128: where the cuDNN frontend is installed its indexer forward scores the rank's
    # extended pieces as row segments (SBHD batch), over keys gathered in sequence order, and must have run.
    reset_call_counts()
    config = cp_config("C", "zigzag", "p2p", dsa_indexer_topk=128, dsa_indexer_head_dim=128, dsa_indexer_n_heads=64)
    nccl_bf16_parity(rank, world, state, config, "C", 512, 2, 3, "C/p2p cuDNN indexer on row segments")
    if importlib.util.find_spec("cudnn") is not None:
        assert call_counts()[("cudnn", "indexer_scores")] > 0, call_counts()


@pytest.mark.multigpu
def test_context_parallel_nccl_bf16_matches_single_gpu():
    run_distributed(nccl_bf16_body, 2, backend="nccl", timeout_s=300)


def nccl_large_ring_body(rank: int, world: int) -> None:
    """M kind, p2p ring, messages far beyond NCCL's internal buffers (the latent rows of 4096 local rows ×
    (kv_lora_rank 4096 + RoPE 64) in bf16 ≈ 33 MiB per step, and their gradient sums): catches a ring whose
    sends and receives are not paired group by group (that deadlocks only at this size; tiny tests pass)."""
    state = initialize_parallel_state(cp_size=world)
    config = cp_config("M", "zigzag", "p2p", hidden_size=1024, num_attention_heads=16,
                       num_query_groups=16, qk_head_dim=128, v_head_dim=128, qk_pos_emb_head_dim=64,
                       kv_lora_rank=4096, dsa_indexer_head_dim=64)
    nccl_bf16_parity(rank, world, state, config, "M", 4096 * world, 1, 5, "M/p2p large")


@pytest.mark.multigpu
def test_context_parallel_nccl_large_messages_ring():
    run_distributed(nccl_large_ring_body, 2, backend="nccl", timeout_s=180)


# M kind dims for the ring's fused blocks: (heads = KV groups, qk head dim without RoPE, v head dim, tokens).
DENSE_BLOCK_DIMS = {"fused": (16, 128, 128, 2048),  # what FlashAttention, cuDNN and torch SDPA take (qk 128 + 64)
                    "dsv4": (8, 512, 512, 1024)}  # qk 512 + 64 / v 512: what only our Triton kernels take


def nccl_dense_blocks_body(rank: int, world: int, dims: str) -> None:
    """M kind, p2p ring: CP-2 equals one GPU, and the ring's blocks ran a fused backend under `auto`: at the
    `fused` dims whichever is installed first (FlashAttention, our Triton kernels, torch's efficient kernel), at
    dsv4's only our Triton kernels (and the one-GPU layer's dense attention too)."""
    heads, qk, v, tokens = DENSE_BLOCK_DIMS[dims]
    state = initialize_parallel_state(cp_size=world)
    config = cp_config("M", "zigzag", "p2p", hidden_size=1024, num_attention_heads=heads, num_query_groups=heads,
                       qk_head_dim=qk, v_head_dim=v, qk_pos_emb_head_dim=64, dsa_indexer_head_dim=64)
    reset_call_counts()
    nccl_bf16_parity(rank, world, state, config, "M", tokens, 1, 7, f"M/p2p {dims} blocks")
    if dims == "dsv4":
        assert {backend for (backend, op) in call_counts() if op.startswith("dense_attention")} == {"triton"}, \
            call_counts()
    else:
        ran = {backend for (backend, op) in call_counts() if op.startswith("dense_attention_block")}
        assert ran and "unfused" not in ran, call_counts()


@pytest.mark.multigpu
@pytest.mark.parametrize("dims", list(DENSE_BLOCK_DIMS))
def test_context_parallel_nccl_fused_dense_blocks(dims):
    run_distributed(nccl_dense_blocks_body, 2, dims, backend="nccl", timeout_s=300)


# ------------------------------------------------------------------ the M ring's blocks
def _positions(plan: ContextParallelPlan, rank: int) -> list[tuple[int, int]]:
    """`(sequence, position)` of every local row of `rank`, in row order."""
    return [(piece.sequence, piece.start + offset) for piece in plan.pieces(rank) for offset in range(piece.length)]


@pytest.mark.parametrize("cp,partition,key_rows", [(2, "zigzag", 1), (2, "zigzag", 3), (4, "zigzag", 5),
                                                   (2, "contiguous", 4), (4, "contiguous", 7), (4, "zigzag", 10**6)])
def test_ring_schedule_meets_every_visible_pair_once(cp, partition, key_rows):
    """Key chunks of at most `key_rows` rows: the blocks of every rank, over every visiting rank, meet each
    (query, key) pair of a sequence with the key at or before the query exactly once, and no other pair; a
    causal block is a square whose rows and keys sit at the same positions."""
    plan = ContextParallelPlan.build([24, 40], cp, partition)
    for rank in range(cp):
        schedule = context_parallel._RingSchedule(plan, rank, key_rows=key_rows)
        queries_at, met = _positions(plan, rank), Counter()
        for source in range(cp):
            keys_at = _positions(plan, source)
            for keys, blocks in schedule.blocks(source):
                assert 0 < keys.stop - keys.start <= key_rows
                for rows, causal in blocks:
                    if causal:
                        assert [queries_at[i] for i in range(rows.start, rows.stop)] == keys_at[keys]
                    for i in range(rows.start, rows.stop):
                        for j in range(keys.start, keys.stop):
                            if not causal or j - keys.start <= i - rows.start:
                                met[queries_at[i], keys_at[j]] += 1
        every_key = [at for source in range(cp) for at in _positions(plan, source)]
        visible = {(query, key) for query in queries_at for key in every_key
                   if key[0] == query[0] and key[1] <= query[1]}
        assert set(met) == visible and set(met.values()) == {1}, f"rank {rank}"


@pytest.mark.parametrize("key_rows", [1, 4, 64])
def test_ring_blocks_in_key_chunks_equal_causal_attention(key_rows):
    """One rank holding two sequences (CP-1, rows already all here): the block-by-block attention with key
    chunks of `key_rows` rows equals the reference causal attention, output and the gradients of q and of
    the packed K/V rows, float64."""
    from megatron_dsa.ops.dense_attention import causal_attention
    from megatron_dsa.ops.layout import TokenLayout

    torch.manual_seed(0)
    plan = ContextParallelPlan.build([12, 20], 1, "contiguous")
    q = torch.randn(32, 4, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(32, 2, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(32, 2, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(32, 4, 5, dtype=torch.float64)
    keys = context_parallel.PackedKeyValues.ring_keys(k, v)
    schedule = context_parallel._RingSchedule(plan, 0, key_rows=key_rows)
    out = context_parallel.BlockAttentionFunction.apply(q, keys.rows, None, keys.expansion, schedule, None, 0.4,
                                                        "unfused", False)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    layout = TokenLayout.packed(torch.tensor([0, 12, 32], dtype=torch.int32), 32, torch.device("cpu"))
    expected_out, _ = causal_attention(q, k, v, layout, 0.4)
    expected = (expected_out, *torch.autograd.grad(expected_out, (q, k, v), grad))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
