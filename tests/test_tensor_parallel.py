"""TP-N (± sequence parallelism) == TP-1 on real gloo process groups, fp64, every layer kind.

Compared per rank against a single-process layer with the same weights: the output (this rank's
sequence slice under SP), the input gradient, every parameter gradient gathered to the TP = 1
layout, the indexer loss and the selected top-k rows (exactly). fp64 end to end, so the only
differences are summation order: tolerance 1e-12 absolute on O(1) values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import assert_bf16_parity, run_distributed
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.mappings import scatter_to_sequence_parallel_region
from megatron_dsa.parallel.sharding import (gather_full_state_dict, load_full_state_dict, merge_tp_shards,
                                            partition_dims, split_for_tp)

ATOL = 1e-12
SEQ, BATCH = 32, 2


def small_config(kind: str, **overrides) -> HybridAttentionConfig:
    values = dict(num_layers=1, layer_pattern=kind, csa_window_size=8, hca_compress_ratio=8,
                  dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.5, o_groups=4, num_query_groups=4)
    return HybridAttentionConfig.from_preset("tiny", **{**values, **overrides})


def reference_run(config: HybridAttentionConfig, kind: str, seed: int):
    torch.manual_seed(seed)
    layer = HybridAttention(config.replace(sequence_parallel=False), kind=kind).double()
    if hasattr(layer, "core_attention"):
        with torch.no_grad():
            layer.core_attention.attn_sink.normal_()  # a zero sink would hide sharding mistakes
    x = torch.randn(SEQ, BATCH, config.hidden_size, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(SEQ, BATCH, config.hidden_size, dtype=torch.float64)
    out, _ = layer(x)
    (out * upstream).sum().backward()
    return layer, x, upstream, out


def gathered_grads(layer, state, world: int) -> dict:
    grads = {}
    for name, dim in partition_dims(layer).items():
        grad = dict(layer.named_parameters())[name].grad
        if dim is None:
            grads[name] = grad
            continue
        parts = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(parts, grad.contiguous(), group=state.tp_group)
        grads[name] = torch.cat(parts, dim=dim)
    return grads


def assert_close(actual, expected, what):
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= ATOL, f"{what}: max abs error {err:.3e} > {ATOL}"


def tp_parity_body(rank: int, world: int, sequence_parallel: bool) -> None:
    state = initialize_parallel_state(tp_size=world)
    for kind in "WCHM":
        for sparse in (True, False):
            if kind != "C" and not sparse:
                continue
            config = small_config(kind, sequence_parallel=sequence_parallel,
                                  dsa_indexer_use_sparse_loss=sparse)
            ref, x, upstream, ref_out = reference_run(config, kind, seed=7)
            layer = HybridAttention(config, kind=kind, parallel_state=state).double()
            load_full_state_dict(layer, ref.state_dict(), state)
            x_local = x.detach().clone().requires_grad_()
            x_in = scatter_to_sequence_parallel_region(x_local, state.tp_group) if sequence_parallel else x_local
            mine = (lambda t: t.chunk(world)[rank]) if sequence_parallel else (lambda t: t)
            out, _ = layer(x_in)
            (out * mine(upstream)).sum().backward()
            tag = f"kind={kind} sparse={sparse} sp={sequence_parallel} rank={rank}"
            assert_close(out, mine(ref_out), f"{tag} output")
            assert_close(x_local.grad, x.grad, f"{tag} input grad")
            grads = gathered_grads(layer, state, world)
            for name, param in ref.named_parameters():
                assert_close(grads[name], param.grad, f"{tag} grad of {name}")
            if kind == "C":
                assert_close(layer.last_indexer_loss, ref.last_indexer_loss, f"{tag} indexer loss")
                assert torch.equal(layer.core_attention.last_selection.compressed,
                                   ref.core_attention.last_selection.compressed), f"{tag} top-k"


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_tensor_parallel_matches_single_process(tp, sp):
    run_distributed(tp_parity_body, tp, sp)


def teacher_head_sum_body(rank: int, world: int) -> None:
    """A7.2 negative control: without the TP reduction of the teacher's head sum the loss changes."""
    import megatron_dsa.ops.indexer_loss as indexer_loss

    state = initialize_parallel_state(tp_size=world)
    config = small_config("C")
    ref, *_ = reference_run(config, "C", seed=3)
    layer = HybridAttention(config, kind="C", parallel_state=state).double()
    load_full_state_dict(layer, ref.state_dict(), state)
    x = torch.randn(SEQ, BATCH, config.hidden_size, dtype=torch.float64)
    torch.manual_seed(3)
    original = indexer_loss.all_reduce_no_grad
    indexer_loss.all_reduce_no_grad = lambda t, group: t  # drop the head-sum reduction
    try:
        layer(x)
        local_only = layer.last_indexer_loss
    finally:
        indexer_loss.all_reduce_no_grad = original
    layer(x)
    ref(x)
    assert_close(layer.last_indexer_loss, ref.last_indexer_loss, "reduced teacher")
    assert (local_only - ref.last_indexer_loss).abs() > 1e-6, "the negative control has no power"


def test_teacher_sums_heads_across_tp():
    run_distributed(teacher_head_sum_body, 2)


def state_dict_round_trip_body(rank: int, world: int) -> None:
    state = initialize_parallel_state(tp_size=world)
    for kind in "WCHM":
        config = small_config(kind)
        torch.manual_seed(11)
        full = HybridAttention(config, kind=kind).state_dict()
        layer = HybridAttention(config, kind=kind, parallel_state=state)
        load_full_state_dict(layer, full, state)
        gathered = gather_full_state_dict(layer, state)
        assert gathered.keys() == full.keys()
        for key in full:
            assert torch.equal(gathered[key], full[key]), f"{kind}: {key} changed in the round trip"


def test_tp_state_dict_gathers_to_tp1_names():
    run_distributed(state_dict_round_trip_body, 2)


@pytest.mark.parametrize("kind", list("WCHM"))
def test_offline_split_merge_round_trip(kind):
    config = small_config(kind)
    layer = HybridAttention(config, kind=kind)
    full = layer.state_dict()
    dims = partition_dims(layer)
    shards = split_for_tp(full, dims, 4)
    assert shards[0]["linear_proj.weight"].shape[1] * 4 == full["linear_proj.weight"].shape[1]
    merged = merge_tp_shards(shards, dims)
    assert all(torch.equal(merged[k], full[k]) for k in full)
    shards[1]["linear_q_down_proj.weight"] = shards[1]["linear_q_down_proj.weight"] + 1
    with pytest.raises(ValueError, match="replicated parameter 'linear_q_down_proj.weight' differs"):
        merge_tp_shards(shards, dims)


def divisibility_body(rank: int, world: int) -> None:
    state = initialize_parallel_state(tp_size=world)
    try:
        HybridAttention(small_config("C", o_groups=1), kind="C", parallel_state=state)
    except ValueError as err:
        assert "o_groups (1) must be divisible by the tensor-parallel size (2)" in str(err)
    else:
        raise AssertionError("o_groups=1 with tp=2 was accepted")
    try:
        scatter_to_sequence_parallel_region(torch.zeros(31, 1, 4), state.tp_group)
    except ValueError as err:
        assert "sequence length (31)" in str(err)
    else:
        raise AssertionError("a sequence of 31 rows was split over tp=2")


def test_divisibility_errors():
    run_distributed(divisibility_body, 2)


def one_rank_fails_body(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    # Rank 0 succeeds and reaches the failure-flag exchange, where it learns of rank 1's failure.


def test_harness_reports_a_failing_rank_without_hanging():
    with pytest.raises(AssertionError, match="deliberate failure on rank 1"):
        run_distributed(one_rank_fails_body, 2, timeout_s=20)



def nccl_bf16_parity_body(rank: int, world: int) -> None:
    """bf16 TP-2 on GPUs (NCCL) vs the bf16 single-GPU layer with the same weights and inputs.

    Tolerances: `assert_bf16_parity`. C layers keep every visible entry (top-k ≥ entries) so that a
    bf16 near-tie cannot flip a selection between the two runs.
    """
    device = torch.device("cuda", rank)
    state = initialize_parallel_state(tp_size=world)
    for kind in "WCHM":
        for sequence_parallel in (False, True):
            config = small_config(kind, sequence_parallel=sequence_parallel, dsa_indexer_topk=128)
            torch.manual_seed(5)
            ref = HybridAttention(config.replace(sequence_parallel=False), kind=kind).to(device)
            if hasattr(ref, "core_attention"):
                with torch.no_grad():
                    ref.core_attention.attn_sink.normal_()
            ref = ref.bfloat16()
            x = torch.randn(256, 2, config.hidden_size, device=device).bfloat16().requires_grad_()
            upstream = torch.randn(256, 2, config.hidden_size, device=device)
            out_ref, _ = ref(x)
            (out_ref.float() * upstream).sum().backward()
            layer = HybridAttention(config, kind=kind, parallel_state=state).to(device)
            layer = layer.bfloat16()
            load_full_state_dict(layer, ref.state_dict(), state)
            x_local = x.detach().bfloat16().requires_grad_()
            x_in = scatter_to_sequence_parallel_region(x_local, state.tp_group) if sequence_parallel else x_local
            mine = (lambda t: t.chunk(world)[rank]) if sequence_parallel else (lambda t: t)
            out, _ = layer(x_in)
            (out.float() * mine(upstream)).sum().backward()
            tag = f"kind={kind} sp={sequence_parallel} rank={rank}"
            pairs = [("output", out, mine(out_ref)), ("input grad", x_local.grad, x.grad)]
            grads = gathered_grads(layer, state, world)
            pairs += [(f"grad {n}", grads[n], p.grad) for n, p in ref.named_parameters()]
            assert_bf16_parity(pairs, tag)


@pytest.mark.multigpu
def test_tensor_parallel_nccl_bf16_matches_single_gpu():
    run_distributed(nccl_bf16_parity_body, 2, backend="nccl", timeout_s=300)
