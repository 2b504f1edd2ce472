"""Context-parallel regression tests for bug classes A6.2, A6.4–A6.8 and A9.3.

`test_context_parallel.py` checks that CP-N equals CP-1 on a few shapes. The tests here aim at
specific failure modes instead:

* partitions and reorders (A6.2): round trips, zigzag chunk ownership, equal causal work;
* the log-sum-exp merge (A6.4): union equality, empty blocks, all-empty rows (forward and backward),
  dtype of the merged LSE;
* gradient routing (A6.5): parameter grads summed exactly once (with a negative control), halo
  gradients sent back to the rank that owns the rows;
* chunk edges that are not multiples of the compression ratio, and pieces shorter than the halo
  (A6.6/A6.8);
* a rank that holds only padding, and a wrong local row count (A6.7);
* RoPE positions of every rank's rows (A9.3).

Everything runs in float64 on the CPU; multi-rank bodies use real gloo process groups through
`run_distributed`. fp64 CP-N vs CP-1 differs only in the order of reductions, so 1e-12 absolute
is the tolerance; exact (T0) checks are used for index and position bookkeeping.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.layers.context_parallel import ContextParallelRows, context_halo
from megatron_dsa.ops.dense_attention import accumulate_attention, attention_block, merge_attention
from megatron_dsa.ops.rope import plain_inv_freq, rope
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.context import (ContextParallelPlan, rank_chunks, shard_packed, shard_sequence,
                                           unshard_sequence)

ATOL = 1e-12  # fp64: only the summation order differs between CP-N and CP-1
CSA_RATIO = 4


# ---------------------------------------------------------------- helpers
def tiny_config(kind: str, partition: str = "zigzag", comm: str = "p2p", **overrides) -> HybridAttentionConfig:
    values = dict(num_layers=1, layer_pattern=kind, csa_window_size=8, hca_compress_ratio=8,
                  dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.5, o_groups=2,
                  cp_partition=partition, cp_comm_type=comm)
    return HybridAttentionConfig.from_preset("tiny", **{**values, **overrides})


def padded_cu(lengths: list[int]) -> list[int]:
    return torch.tensor([0] + list(lengths)).cumsum(0).tolist()


def positions_in_sequence(cu: list[int]) -> torch.Tensor:
    """`[T]` position of every packed row within its (padded) sequence."""
    return torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual - expected).abs().max().item() if actual.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = max_err(actual, expected)
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.0e}"


def reference_layer(config: HybridAttentionConfig, kind: str, hidden: torch.Tensor, upstream: torch.Tensor,
                    packed=None):
    """The single-process (CP-1) layer, run forward and backward: `(layer, input with grad, output)`."""
    layer = HybridAttention(config, kind=kind).double()
    if hasattr(layer, "core_attention"):
        with torch.no_grad():  # a zero sink would hide a missing sink term
            layer.core_attention.attn_sink.normal_()
    x = hidden.clone().requires_grad_()
    out, _ = layer(x, packed_seq_params=packed)
    (out * upstream).sum().backward()
    return layer, x, out


def cp_layer(config: HybridAttentionConfig, kind: str, state, ref: HybridAttention, hidden: torch.Tensor,
             upstream: torch.Tensor, packed=None):
    """The same layer under CP with the reference weights, on this rank's rows: `(layer, x, out)`."""
    layer = HybridAttention(config, kind=kind, parallel_state=state).double()
    layer.load_state_dict(ref.state_dict())
    x = hidden.clone().requires_grad_()
    out, _ = layer(x, packed_seq_params=packed)
    (out * upstream).sum().backward()
    return layer, x, out


def summed_grads(layer: HybridAttention, group) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in layer.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        grads[name] = grad
    return grads


def packed_params(real: list[int], padded: list[int]) -> PackedSeqParams:
    return PackedSeqParams(cu_seqlens_q=torch.tensor(padded_cu(real), dtype=torch.int32),
                           cu_seqlens_q_padded=torch.tensor(padded_cu(padded), dtype=torch.int32),
                           max_seqlen_q=max(padded))


# ---------------------------------------------------------------- A6.2 partitions and reorder
@pytest.mark.parametrize("partition", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_sbhd_shard_unshard_round_trip(cp, partition):
    """A6.2: unshard(shard(x)) is the identity (exact), along dim 0 and along another dim."""
    x = torch.randn(8 * cp, 3, 5, dtype=torch.float64)
    parts = [shard_sequence(x, cp, rank, partition) for rank in range(cp)]
    assert torch.equal(unshard_sequence(parts, partition), x)
    y = x.transpose(0, 1).contiguous()  # [B, S, d]: sequence along dim 1
    parts = [shard_sequence(y, cp, rank, partition, dim=1) for rank in range(cp)]
    assert torch.equal(unshard_sequence(parts, partition, dim=1), y)


@pytest.mark.parametrize("partition", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_packed_shard_reassembles_through_global_rows(cp, partition):
    """A6.2 (THD): ragged sequences padded to a multiple of the chunk count; every rank's
    `shard_packed` rows put back at the plan's `global_rows` rebuild the pack exactly, each row
    owned by exactly one rank, and each rank holds its own chunks of *every* sequence."""
    chunks = 2 * cp if partition == "zigzag" else cp
    real = [5, 27, 3, 13]
    padded = [-(-n // chunks) * chunks for n in real]
    cu = padded_cu(padded)
    x = torch.randn(cu[-1], 4, dtype=torch.float64)
    plan = ContextParallelPlan.build(padded, cp, partition, real)
    rebuilt, owners = torch.zeros_like(x), torch.zeros(cu[-1], dtype=torch.long)
    for rank in range(cp):
        rows = plan.global_rows(rank, cu[:-1])
        part = shard_packed(x, cu, cp, rank, partition)
        assert part.shape[0] == plan.local_rows(rank) == len(rows)
        rebuilt[rows] = part
        owners[rows] += 1
        positions = shard_packed(positions_in_sequence(cu), cu, cp, rank, partition)
        expected = torch.cat([torch.arange(c * (n // chunks), (c + 1) * (n // chunks))
                              for n in padded for c in rank_chunks(cp, rank, partition)])
        assert torch.equal(positions, expected), f"rank {rank} holds the wrong chunks"
    assert torch.equal(owners, torch.ones_like(owners)), "a row is owned by no rank or by two"
    assert torch.equal(rebuilt, x)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_rank_holds_chunks_r_and_mirror(cp):
    """A6.2: rank r holds chunks r and 2cp−1−r, in that local order (exact)."""
    size = 3
    seq = torch.arange(2 * cp * size)
    for rank in range(cp):
        expected = torch.cat((seq[rank * size:(rank + 1) * size],
                              seq[(2 * cp - 1 - rank) * size:(2 * cp - rank) * size]))
        assert torch.equal(shard_sequence(seq, cp, rank, "zigzag"), expected)
        pieces = ContextParallelPlan.build([len(seq)], cp).pieces(rank)
        assert [p.chunk for p in pieces] == [rank, 2 * cp - 1 - rank]


def causal_pairs(positions: torch.Tensor) -> int:
    """(query, key) pairs of causal attention for queries at these positions: Σ (p + 1)."""
    return int((positions + 1).sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_causal_work(cp):
    """A6.2: the zigzag ranks do the same number of causal (q, k) pairs; contiguous ranks do not
    (negative control: the count can tell a balanced partition from an unbalanced one)."""
    seq = torch.arange(16 * cp)
    zigzag = {causal_pairs(shard_sequence(seq, cp, r, "zigzag")) for r in range(cp)}
    contiguous = [causal_pairs(shard_sequence(seq, cp, r, "contiguous")) for r in range(cp)]
    assert len(zigzag) == 1, f"zigzag causal work per rank differs: {zigzag}"
    assert sum(contiguous) == zigzag.pop() * cp
    assert len(set(contiguous)) == cp


# ---------------------------------------------------------------- A6.4 LSE merge
def union_attention(q, k, v, scale, allowed=None):
    """One softmax over all keys (fp64): `out [n, H, Dv]`, `lse [n, H]`."""
    logits = torch.einsum("nhd,mhd->nhm", q, k) * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.einsum("nhm,mhd->nhd", torch.softmax(logits, -1), v), lse


@pytest.mark.parametrize("logit_scale", [1.0, 1e4])
def test_merge_equals_one_softmax_over_the_union(logit_scale):
    """A6.4(a): merging per-block results over disjoint key sets (one of them the causal diagonal
    block) equals one softmax over the union. fp64, 1e-12 (relative for lse at logits ~1e4)."""
    n, heads, d = 6, 2, 8
    q = torch.randn(n, heads, d, dtype=torch.float64)
    k = torch.randn(3 * n, heads, d, dtype=torch.float64)
    v = torch.randn(3 * n, heads, d, dtype=torch.float64)
    scale = logit_scale / d ** 0.5
    blocks = [slice(0, n), slice(n, 2 * n), slice(2 * n, 3 * n)]  # two past blocks, then the diagonal
    parts = [attention_block(q, k[b], v[b], scale, causal=i == 2) for i, b in enumerate(blocks)]
    out, lse = merge_attention(parts)
    allowed = torch.ones(n, 3 * n, dtype=torch.bool)
    allowed[:, 2 * n:] = torch.ones(n, n, dtype=torch.bool).tril()
    ref_out, ref_lse = union_attention(q, k, v, scale, allowed)
    assert_close(out, ref_out, "merged out")
    assert_close(lse / logit_scale, ref_lse / logit_scale, "merged lse")


def test_block_with_minus_inf_lse_contributes_nothing():
    """A6.4(a): a block with lse = −inf has weight exactly 0, whatever its (finite) output holds;
    an empty key block from `attention_block` gives lse = −inf and changes nothing. Exact."""
    n, heads, d = 5, 2, 4
    q, k, v = (torch.randn(n, heads, d, dtype=torch.float64) for _ in range(3))
    part = attention_block(q, k, v, 0.5, causal=True)
    garbage = (torch.randn(n, heads, d, dtype=torch.float64) * 1e6,
               torch.full((n, heads), float("-inf"), dtype=torch.float64))
    empty = attention_block(q, k[:0], v[:0], 0.5, causal=False)
    assert torch.isneginf(empty[1]).all() and torch.equal(empty[0], torch.zeros_like(empty[0]))
    out, lse = merge_attention([part])
    for extra in (garbage, empty):
        out2, lse2 = merge_attention([extra, part, extra])
        assert torch.equal(lse2, lse) and torch.allclose(out2, out, rtol=0, atol=ATOL)


def test_accumulating_in_place_equals_merging():
    """The ring's in-place accumulation (`accumulate_attention`, block after block into one running result)
    equals `merge_attention` of all blocks at once: rows that see no key yet (lse −inf: out stays 0), rows a
    block does not reach, a NaN block (its rows NaN in both), logits up to ~1e4. fp64, 1e-12."""
    torch.manual_seed(5)
    n, heads, d = 7, 3, 4
    parts = []
    for index in range(4):
        lse = torch.randn(n, heads, dtype=torch.float64) * (1e4 if index == 2 else 3.0)
        lse[index] = float("-inf")  # a row this block does not reach
        lse[6, 0] = float("-inf")  # row 6, head 0: no block reaches it
        out = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, torch.randn(n, heads, d, dtype=torch.float64))
        parts.append((out, lse))
    parts[3][0][5, 1], parts[3][1][5, 1] = float("nan"), float("nan")
    out = torch.zeros(n, heads, d, dtype=torch.float64)
    lse = torch.full((n, heads), float("-inf"), dtype=torch.float64)
    for part in parts:
        accumulate_attention(out, lse, part)
    expected_out, expected_lse = merge_attention(parts)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert torch.equal(out[6, 0], torch.zeros(d, dtype=torch.float64)) and torch.isneginf(lse[6, 0])
    assert torch.isnan(out[5, 1]).all() and torch.isnan(lse[5, 1])


def test_all_empty_row_gives_zero_without_nan_forward_and_backward():
    """A6.4/A3.2: a row where every block has lse = −inf merges to out = 0, lse = −inf; the gradient
    of a finite downstream use (out, and lse with −inf masked) is finite and 0 for every input —
    the partial outputs *and* the partial lses, which are differentiable inputs of the merge."""
    n, heads, d = 3, 2, 4
    outs = [torch.randn(n, heads, d, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    lses = [torch.full((n, heads), float("-inf"), dtype=torch.float64, requires_grad=True) for _ in range(2)]
    # Row 0 of a third block is real, so the merge mixes an all-empty row (1, 2) with a normal one.
    live_out = torch.randn(n, heads, d, dtype=torch.float64, requires_grad=True)
    live_lse = torch.tensor([[0.3, -0.2], [float("-inf")] * 2, [float("-inf")] * 2],
                            dtype=torch.float64, requires_grad=True)
    out, lse = merge_attention(list(zip(outs, lses)) + [(live_out, live_lse)])
    assert torch.equal(out[1:], torch.zeros_like(out[1:])) and torch.isneginf(lse[1:]).all()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    g = torch.randn_like(out)
    ((out * g).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for i, tensor in enumerate(outs + [live_out]):
        assert torch.isfinite(tensor.grad).all(), f"partial out {i}: non-finite gradient"
    for i, tensor in enumerate(lses + [live_lse]):
        assert torch.isfinite(tensor.grad).all(), (
            f"partial lse {i}: non-finite gradient {tensor.grad.tolist()} (rows with no visible key)")
        assert torch.equal(tensor.grad[1:], torch.zeros_like(tensor.grad[1:]))


def test_all_empty_row_through_attention_blocks_has_finite_qkv_grads():
    """A6.4: the same all-empty row produced by real (empty) key blocks: q/k/v grads finite."""
    n, heads, d = 3, 2, 4
    q = torch.randn(n, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(0, 1, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(0, 1, d, dtype=torch.float64, requires_grad=True)
    out, lse = merge_attention([attention_block(q, k, v, 0.5, False)] * 2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad, torch.zeros_like(q.grad))


def test_bf16_blocks_merge_in_high_precision():
    """A6.4: bf16 q/k/v still give per-block out/lse and a merged lse in float32, never bf16 (a
    bf16 lse carries ~3 significant digits, and the merge error would grow with the ring)."""
    n, heads, d = 4, 2, 8
    q, k, v = (torch.randn(n, heads, d).bfloat16() for _ in range(3))
    parts = [attention_block(q, k, v, d ** -0.5, causal=True), attention_block(q, k, v, d ** -0.5, causal=False)]
    for out, lse in parts:
        assert lse.dtype == torch.float32 and out.dtype == torch.float32
    out, lse = merge_attention(parts)
    assert lse.dtype in (torch.float32, torch.float64) and out.dtype in (torch.float32, torch.float64)
    # Same bf16 values, fp64 compute: the float32 merge agrees to float32 rounding.
    ref = merge_attention([attention_block(q.double(), k.double(), v.double(), d ** -0.5, causal=c)
                           for c in (True, False)])
    assert_close(lse.double(), ref[1], "bf16-input merged lse", atol=1e-5)
    assert_close(out.double(), ref[0], "bf16-input merged out", atol=1e-5)


# ---------------------------------------------------------------- A6.5 gradient routing
ROUTING_S, ROUTING_B = 32, 2  # CP=2 zigzag chunks of 8: rank 0 holds positions 0–7, 24–31


def check_summed_parameter_grads(rank: int, world: int, state) -> None:
    seqlen, batch = ROUTING_S, ROUTING_B
    mine = lambda t: shard_sequence(t, world, rank)  # noqa: E731
    for kind in "WCM":
        config = tiny_config(kind)
        torch.manual_seed(5)
        hidden = torch.randn(seqlen, batch, config.hidden_size, dtype=torch.float64)
        upstream = torch.randn_like(hidden)
        ref, _, _ = reference_layer(config, kind, hidden, upstream)
        layer, _, _ = cp_layer(config, kind, state, ref, mine(hidden), mine(upstream))
        summed = summed_grads(layer, state.cp_group)
        for name, expected in ref.named_parameters():
            expected = expected.grad
            assert_close(summed[name], expected, f"{kind} summed grad of {name}")
            if expected.abs().max() > 1e-8:  # negative control: an averaging (÷cp) reduction is caught
                wrong = max_err(summed[name] / world, expected) / expected.abs().max().item()
                assert wrong > 0.1, f"{kind} {name}: grad/cp is indistinguishable from CP-1 ({wrong:.2e})"
        ratio = (torch.cat([g.flatten() for g in summed.values()]).norm()
                 / torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()).item()
        assert abs(ratio - 1) < 1e-9, f"{kind}: summed grad norm is {ratio:.6f}× the CP-1 norm"


def check_halo_grads_return_home(rank: int, world: int, state) -> None:
    """Only query (position 9, batch 0) on rank 1 has an upstream gradient. Its window of 8 reads
    positions 2–9; positions 2–7 belong to rank 0 (its local rows 2–7)."""
    seqlen, batch = ROUTING_S, ROUTING_B
    mine = lambda t: shard_sequence(t, world, rank)  # noqa: E731
    for comm in ("p2p", "all_gather"):
        config = tiny_config("W", comm=comm)
        torch.manual_seed(6)
        hidden = torch.randn(seqlen, batch, config.hidden_size, dtype=torch.float64)
        upstream = torch.zeros_like(hidden)
        upstream[9, 0] = torch.randn(config.hidden_size, dtype=torch.float64)
        ref, x_ref, _ = reference_layer(config, "W", hidden, upstream)
        _, x, _ = cp_layer(config, "W", state, ref, mine(hidden), mine(upstream))
        expected = mine(x_ref.grad)
        assert_close(x.grad, expected, f"{comm} input grad (one upstream row)")
        if rank == 0:
            assert (expected[2:8, 0].abs().amax(-1) > 0).all(), "CP-1 grad at the halo rows should be non-zero"
            assert (x.grad[2:8, 0].abs().amax(-1) > 0).all(), f"{comm}: halo gradient never reached rank 0"
            assert torch.equal(x.grad[:2], torch.zeros_like(x.grad[:2])), "rows outside the window got grad"
            assert torch.equal(x.grad[8:], torch.zeros_like(x.grad[8:])), "future rows got grad"


def grad_routing_body(rank: int, world: int) -> None:
    state = initialize_parallel_state(cp_size=world)
    check_summed_parameter_grads(rank, world, state)
    check_halo_grads_return_home(rank, world, state)


def test_cp_grads_summed_once_and_halo_grads_return_to_owner():
    """A6.5: the parameter gradients summed over CP equal CP-1 (1e-12, fp64) and are not cp× too
    large (the ÷cp version is far off, so the check has power); a halo row's gradient is computed on
    the reading rank and must travel back to the owning rank (rank 0) exactly."""
    run_distributed(grad_routing_body, 2)


# ---------------------------------------------------------------- A6.6 / A6.8 ratio-misaligned edges
def selection_rule_violations(entries: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> list[str]:
    """Row-wise checks of the ratio-causal rule in GLOBAL positions: every selected entry j has
    j < floor((p+1)/r), entries are distinct, and min(topk, visible) of them are selected."""
    problems = []
    for row, (picks, pos) in enumerate(zip(entries.tolist(), positions.tolist())):
        visible = (pos + 1) // ratio
        chosen = [j for j in picks if j >= 0]
        if any(j >= visible for j in chosen):
            problems.append(f"row {row} (pos {pos}) selected future entries {chosen} (visible {visible})")
        if len(set(chosen)) != len(chosen) or len(chosen) != min(topk, visible):
            problems.append(f"row {row} (pos {pos}) selected {chosen}, visible {visible}")
    return problems


def misaligned_edges_body(rank: int, world: int) -> None:
    state = initialize_parallel_state(cp_size=world)
    batch = 2
    cases = [("C", 40),   # zigzag chunks of 10 with r = 4: edges at 10, 20, 30 cut compressor groups
             ("H", 24)]   # chunks of 6 < window 8 and < group 8: halos span two pieces
    for kind, seqlen in cases:
        for comm in ("p2p", "all_gather"):
            config = tiny_config(kind, comm=comm)
            torch.manual_seed(11)
            hidden = torch.randn(seqlen, batch, config.hidden_size, dtype=torch.float64)
            upstream = torch.randn_like(hidden)
            mine = lambda t: shard_sequence(t, world, rank)  # noqa: E731
            ref, x_ref, out_ref = reference_layer(config, kind, hidden, upstream)
            layer, x, out = cp_layer(config, kind, state, ref, mine(hidden), mine(upstream))
            tag = f"{kind} S={seqlen} {comm} rank={rank}"
            # A6.8: token level, so a wrong boundary row cannot hide in an average.
            per_row = (out - mine(out_ref)).abs().amax(-1).amax(-1)
            bad = (per_row > ATOL).nonzero().flatten().tolist()
            assert not bad, f"{tag}: output wrong at local rows {bad} (max {per_row.max():.2e})"
            assert_close(x.grad, mine(x_ref.grad), f"{tag} input grad")
            summed = summed_grads(layer, state.cp_group)
            for name, param in ref.named_parameters():
                assert_close(summed[name], param.grad, f"{tag} summed grad of {name}")
            if kind == "C":
                plan = ContextParallelPlan.build([seqlen] * batch, world)
                positions = plan.global_rows(rank, [0] * batch)  # position within each sequence
                entries = layer.core_attention.last_selection.entries
                problems = selection_rule_violations(entries, positions, CSA_RATIO, config.dsa_indexer_topk)
                assert not problems, f"{tag}: " + "; ".join(problems[:5])
                ref_entries = ref.core_attention.last_selection.entries.view(batch, seqlen, -1).transpose(0, 1)
                ref_entries = mine(ref_entries).transpose(0, 1).reshape(entries.shape)
                assert torch.equal(entries.sort(1).values, ref_entries.sort(1).values), f"{tag}: top-k sets differ"
                loss = layer.last_indexer_loss.clone()
                dist.all_reduce(loss, group=state.cp_group)
                assert_close(loss, ref.last_indexer_loss, f"{tag} indexer loss")


def test_chunk_edges_not_multiples_of_ratio_and_pieces_shorter_than_halo():
    """A6.6/A6.8: C with S=40 on CP=2 zigzag (chunks of 10, ratio 4) and H with S=24 (chunks of 6,
    ratio 8, window 8), both comm types: every output row, the input and parameter grads equal
    CP-1 (1e-12, fp64); the indexer picks obey the ratio-causal rule in global positions and
    equal the CP-1 sets (exact)."""
    run_distributed(misaligned_edges_body, 2)


@pytest.mark.parametrize("lengths,real,cp,partition,ratio", [
    ([40], [40], 2, "zigzag", 4),
    ([24, 24], [24, 19], 2, "zigzag", 8),
    ([48, 16, 32], [45, 3, 32], 4, "zigzag", 4),
    ([48, 16], [45, 3], 4, "contiguous", 8),
])
def test_every_compressed_entry_is_pooled_exactly_once(lengths, real, cp, partition, ratio):
    """A6.8: over all ranks, the owned entries of each sequence tile `[0, real // r)` exactly once
    (none lost at a chunk edge that cuts a group, none pooled twice), and the entry table maps
    every entry to a distinct gathered row. Exact (host bookkeeping)."""
    plan = ContextParallelPlan.build(lengths, cp, partition, real)
    halo = context_halo(8, ratio)
    counts = [torch.zeros(n // ratio, dtype=torch.long) for n in real]
    tables = []
    for rank in range(cp):
        rows = ContextParallelRows(plan, rank, None, halo, torch.device("cpu"))
        for piece in rows.pieces:
            first, stop = rows.owned_entries(piece, ratio)
            counts[piece.sequence][first:stop] += 1
            assert all((j + 1) * ratio - 1 in range(piece.start, piece.start + piece.length)
                       for j in range(first, stop)), "an entry is pooled by a rank without its last token"
        tables.append(rows.entry_table(ratio))
    for seq, count in enumerate(counts):
        assert torch.equal(count, torch.ones_like(count)), f"sequence {seq}: entry pool counts {count.tolist()}"
    assert all(torch.equal(t, tables[0]) for t in tables), "ranks disagree on the entry table"
    valid = tables[0][tables[0] >= 0]
    assert valid.numel() == sum(n // ratio for n in real) and valid.unique().numel() == valid.numel()


# ---------------------------------------------------------------- A6.7 padding-only rank
PADDING_CASES = [([3], [16]),          # rank 1 (chunks 1 and 2 of 4) holds only padding
                 ([3, 13], [16, 16])]  # rank 1: padding of sequence 0, real rows of sequence 1


def padding_rank_body(rank: int, world: int) -> None:
    state = initialize_parallel_state(cp_size=world)
    for real, padded in PADDING_CASES:
        packed = packed_params(real, padded)
        cu = padded_cu(padded)
        mine = lambda t: shard_packed(t, cu, world, rank)  # noqa: E731
        valid = mine(positions_in_sequence(cu) < torch.repeat_interleave(torch.tensor(real),
                                                                         torch.tensor(padded)))
        for kind in "WCHM":
            config = tiny_config(kind)
            torch.manual_seed(13)
            hidden = torch.randn(cu[-1], 1, config.hidden_size, dtype=torch.float64)
            upstream = torch.randn_like(hidden)
            ref, x_ref, out_ref = reference_layer(config, kind, hidden, upstream, packed)
            layer, x, out = cp_layer(config, kind, state, ref, mine(hidden), mine(upstream), packed)
            tag = f"{kind} real={real} rank={rank}"
            assert torch.isfinite(out).all() and torch.isfinite(x.grad).all(), f"{tag}: non-finite"
            assert torch.equal(out[~valid], torch.zeros_like(out[~valid])), f"{tag}: padding output != 0"
            assert torch.equal(x.grad[~valid], torch.zeros_like(x.grad[~valid])), f"{tag}: padding grad != 0"
            assert_close(out, mine(out_ref), f"{tag} output")
            assert_close(x.grad, mine(x_ref.grad), f"{tag} input grad")
            summed = summed_grads(layer, state.cp_group)
            for name, param in ref.named_parameters():
                assert torch.isfinite(param.grad).all()
                assert_close(summed[name], param.grad, f"{tag} summed grad of {name}")
            if kind == "C":
                loss = layer.last_indexer_loss.clone()
                dist.all_reduce(loss, group=state.cp_group)
                assert_close(loss, ref.last_indexer_loss, f"{tag} indexer loss")
    # A local row count that does not match the plan is refused before any communication.
    packed = packed_params([3], [16])
    layer = HybridAttention(tiny_config("W"), kind="W", parallel_state=state).double()
    with pytest.raises(ValueError, match=r"has 7 rows but this CP rank holds 8"):
        layer(torch.randn(7, 1, layer.config.hidden_size, dtype=torch.float64), packed_seq_params=packed)


def test_padding_only_rank_and_wrong_local_rows():
    """A6.7: CP=2 zigzag, real length 3 padded to 16 (chunks of 4): rank 1 holds only padding.
    Every kind finishes; outputs and input grads are exactly 0 on padding rows and finite; outputs,
    input grads, summed parameter grads and the indexer loss equal CP-1 (1e-12, fp64). A wrong local
    row count raises a ValueError naming the expected count."""
    run_distributed(padding_rank_body, 2)


# ---------------------------------------------------------------- A9.3 RoPE positions under CP
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_rope_positions_of_cp_rows_are_global(cp, packed):
    """A9.3: the positions a rank rotates its (halo-extended) rows with are global: query rows equal
    the plan's global positions (from `shard_sequence` / `shard_packed` of the position map), halo
    rows are the positions just before each piece, and the rotated query rows equal the CP-1
    rotation of the same rows (exact)."""
    chunks = 2 * cp
    if packed:
        real = [5, 27, 3]
        padded = [-(-n // chunks) * chunks for n in real]
    else:
        padded = real = [6 * chunks, 6 * chunks]  # SBHD, batch 2: the same plan with equal lengths
    cu = padded_cu(padded)
    plan = ContextParallelPlan.build(padded, cp, "zigzag", real)
    halo = context_halo(8, CSA_RATIO)
    global_positions = positions_in_sequence(cu)
    inv_freq = plain_inv_freq(8, 10000.0)
    x = torch.randn(cu[-1], 2, 16, dtype=torch.float64)
    for rank in range(cp):
        rows = ContextParallelRows(plan, rank, None, halo, torch.device("cpu"))
        positions = rows.layout.positions
        expected = shard_packed(global_positions, cu, cp, rank)
        assert torch.equal(rows.outputs(positions), expected), f"rank {rank}: query positions not global"
        if not packed:
            sbhd = torch.stack([shard_sequence(torch.arange(padded[0]), cp, rank)] * len(padded)).flatten()
            assert torch.equal(rows.outputs(positions), sbhd)
        segments = rows.layout.cu_seqlens.tolist()
        for (a, b), piece, h in zip(zip(segments[:-1], segments[1:]), rows.pieces, rows.halo_lengths):
            assert torch.equal(positions[a:b], torch.arange(piece.start - h, piece.start + piece.length))
        query_rows = rows.outputs(torch.arange(rows.layout.num_rows))
        assert rows.layout.query_valid[query_rows].sum() == sum(
            max(0, min(p.length, p.real_length - p.start)) for p in rows.pieces)
        local = shard_packed(x, cu, cp, rank)
        rotated = rope(local, rows.outputs(positions), inv_freq)
        assert torch.equal(rotated, shard_packed(rope(x, global_positions, inv_freq), cu, cp, rank))


@pytest.mark.parametrize("lengths,cp,partition", [([16, 32, 8], 2, "zigzag"), ([40, 8, 24], 4, "zigzag"),
                                                  ([64, 16], 4, "contiguous"), ([8, 8, 8, 8], 4, "zigzag")])
def test_halo_owners_match_a_walk_over_every_position(lengths, cp, partition):
    """The bisection lookup of halo-row owners equals the plain definition: the piece (of any rank)
    whose positions contain the row — including halos longer than a piece (several owners)."""
    from megatron_dsa.layers.context_parallel import _halo_owners

    plan = ContextParallelPlan.build(lengths, cp, partition, lengths)
    for rank in range(cp):
        for halo in (1, 3, 7, 20):
            needed = {(p.sequence, pos) for p in plan.pieces(rank)
                      for pos in range(p.start - min(halo, p.start), p.start)}
            expected = {(piece.sequence, pos): (owner, slot, piece)
                        for owner, pieces in enumerate(plan.all_pieces) for slot, piece in enumerate(pieces)
                        for pos in range(piece.start, piece.start + piece.length)
                        if (piece.sequence, pos) in needed}
            assert _halo_owners(plan, rank, halo) == expected, (rank, halo)
