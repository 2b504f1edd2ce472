"""Invariants of the paper scaling model (`benchmarks/scaling_model.py`), not its numbers: counts against
brute force and against a real layer, conservation over CP ranks, monotone scaling, the documented
calibration errors, and the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scaling_model as model  # noqa: E402
from megatron_dsa import HybridAttention, HybridAttentionConfig  # noqa: E402

FLASH = model.Dims.from_preset("dsv4-flash")
FITTED = model.calibrate(FLASH)
H200, H100 = model.GPUS["H200"], model.GPUS["H100"]

# The largest calibration errors docs/performance.md ("Scaling model") states, as fractions.
ONE_GPU_TIME_ERROR = 0.13
ONE_GPU_PEAK_ERROR = 0.25
CP_TIME_RATIO_ERROR = 0.08
CP_MEMORY_RATIO_ERROR = 0.06
# The TP-2 × CP-2 checks (not fitted): the model expects far more from TP than was measured.
TP_CP_TIME_RATIO_ERROR = 0.28
TP_CP_MEMORY_RATIO_ERROR = 0.26
# The CUDA-graph replay ratios (one number fitted on two points).
GRAPH_CP_TIME_RATIO_ERROR = 0.02


def brute_force_rows(dims: model.Dims, kind: str, positions: range) -> model.Rows:
    """The per-query counts one query at a time."""
    ratio, total = dims.ratios[kind], model.Rows()
    for t in positions:
        visible = (t + 1) // ratio if ratio else 0
        selected = visible if kind == "H" else min(dims.topk, visible)
        total += model.Rows(1, min(t + 1, dims.window), visible, selected)
    return total


@pytest.mark.parametrize("kind", model.KINDS)
@pytest.mark.parametrize("seq_len, cp", [(1024, 1), (1024, 2), (3072, 4), (4096, 8)])
def test_closed_form_counts_equal_brute_force_and_add_up_over_cp_ranks(kind: str, seq_len: int, cp: int) -> None:
    whole = model.rank_rows(FLASH, kind, seq_len, 1, 0)
    assert whole == brute_force_rows(FLASH, kind, range(seq_len))
    per_rank = [model.rank_rows(FLASH, kind, seq_len, cp, rank) for rank in range(cp)]
    assert sum(per_rank, model.Rows()) == whole  # every query row is some rank's, exactly once
    chunk = seq_len // (2 * cp)
    assert per_rank[0] == brute_force_rows(FLASH, kind, range(chunk)) + brute_force_rows(
        FLASH, kind, range((2 * cp - 1) * chunk, seq_len))


@pytest.mark.parametrize("kind", model.KINDS)
@pytest.mark.parametrize("tp", [1, 8])
def test_flop_is_conserved_over_cp_ranks_and_balanced_by_zigzag(kind: str, tp: int) -> None:
    seq_len, cp = 1 << 20, 64
    ranks = [model.essential_flop(FLASH, kind, model.rank_rows(FLASH, kind, seq_len, cp, rank), tp=tp)
             for rank in range(cp)]
    assert sum(ranks) == pytest.approx(model.essential_flop(FLASH, kind, model.rank_rows(FLASH, kind, seq_len, 1, 0),
                                                            tp=tp), rel=1e-12)
    # Zigzag balances the work exactly, but rank 0's first chunk starts the sequence: its first queries see
    # less than a full window and top-k.
    assert all(flop == pytest.approx(ranks[1], rel=1e-12) for flop in ranks[1:]) and ranks[0] < ranks[1]
    slowest = model.predict(model.Setup(H200, kind, seq_len, cp, tp), FLASH, FITTED)
    halo = model.essential_flop(FLASH, kind, model.Rows(), FLASH.halo(kind), tp)  # halo rows are extra work
    assert min(ranks) + halo <= slowest.flop <= max(ranks) + halo


@pytest.mark.parametrize("kind", model.KINDS)
def test_parameter_counts_match_the_layer(kind: str) -> None:
    config = HybridAttentionConfig.from_preset("dsv4-flash")
    with torch.device("meta"):
        layer = HybridAttention(config, kind=kind)
    weights = model.layer_weights(FLASH, kind)
    matrices = {name: p.numel() for name, p in layer.named_parameters() if p.dim() == 2 and not name.endswith("ape")}
    split = sum(n for name, n in matrices.items() if hasattr(layer.get_parameter(name), "tensor_parallel_dim"))
    assert weights.total == sum(p.numel() for p in layer.parameters())
    assert (weights.split, weights.replicated) == (split, sum(matrices.values()) - split)


@pytest.mark.parametrize("kind", model.KINDS)
def test_attended_pairs_match_a_real_layers_selection(kind: str) -> None:
    """The counts the model prices (window + selected entries per query) are the pairs the layer attends."""
    config = HybridAttentionConfig.from_preset("tiny")
    dims = model.Dims.from_preset("tiny")
    seq_len = 96
    torch.manual_seed(0)
    layer = HybridAttention(config, kind=kind).double()
    with torch.no_grad():
        layer(torch.randn(seq_len, 1, config.hidden_size, dtype=torch.float64))
    attended = int((layer.core_attention.last_selection.all() >= 0).sum())
    assert model.rank_rows(dims, kind, seq_len, 1, 0).attended_pairs == attended


@pytest.mark.parametrize("gpu", [H200, H100])
@pytest.mark.parametrize("kind", model.KINDS)
@pytest.mark.parametrize("seq_len", [131072, 1 << 20])
def test_time_and_memory_fall_with_cp_until_communication_bound(gpu: model.Gpu, kind: str, seq_len: int) -> None:
    previous = model.predict(model.Setup(gpu, kind, seq_len), FLASH, FITTED)
    for cp in (2, 4, 8, 16, 32, 64):
        current = model.predict(model.Setup(gpu, kind, seq_len, cp), FLASH, FITTED)
        assert current.memory_mib < previous.memory_mib
        waiting = (current.comm_exposed_ms + current.host_ms) / current.step_ms
        if waiting < 0.5:  # compute-bound: more ranks, less time
            assert current.step_ms < previous.step_ms, (cp, current.step_ms, previous.step_ms)
            assert current.compute_ms < previous.compute_ms
        previous = current


def test_tp_splits_head_work_but_not_the_replicated_indexer() -> None:
    one, eight = (model.predict(model.Setup(H200, "C", 131072, 1, tp), FLASH, FITTED) for tp in (1, 8))
    assert eight.work["sparse attention"] == pytest.approx(one.work["sparse attention"] / 8)
    assert eight.work["indexer scores"] == one.work["indexer scores"]
    assert eight.memory_mib < one.memory_mib and eight.comm_exposed_ms > one.comm_exposed_ms == 0


def test_c_gathers_stop_hiding_below_a_few_thousand_rows_per_rank() -> None:
    limit = model.hiding_limit(FLASH, FITTED, H200, "C", 8)
    assert limit is not None
    assert model.predict(model.Setup(H200, "C", 2 * limit * 8, 8), FLASH, FITTED).hidden
    assert not model.predict(model.Setup(H200, "C", limit * 8 // 2, 8), FLASH, FITTED).hidden
    assert model.hiding_limit(FLASH, FITTED, H200, "C", 64) > limit  # across nodes: a slower link


def test_calibration_points_within_the_documented_errors() -> None:
    for point in model.STEP_MS:
        predicted = model.predict(model.Setup(model.GPUS[point.gpu], point.kind, point.seq_len), FLASH, FITTED)
        assert predicted.step_ms == pytest.approx(point.value, rel=1e-9 if point.fit else ONE_GPU_TIME_ERROR)
    for point in model.PEAK_MIB:
        predicted = model.predict(model.Setup(model.GPUS[point.gpu], point.kind, point.seq_len), FLASH, FITTED)
        assert model.single_gpu_peak_mib(predicted) == pytest.approx(point.value, rel=ONE_GPU_PEAK_ERROR)
    for point in model.CP_RATIOS:
        time_ratio, memory_ratio = model.cp_ratios(point, FLASH, FITTED)
        assert time_ratio == pytest.approx(point.time_ratio, rel=CP_TIME_RATIO_ERROR)
        assert memory_ratio == pytest.approx(point.memory_ratio, rel=CP_MEMORY_RATIO_ERROR)
    for point in model.TP_CP_CHECKS:
        time_ratio, memory_ratio = model.cp_ratios(point, FLASH, FITTED)
        assert time_ratio == pytest.approx(point.time_ratio, rel=TP_CP_TIME_RATIO_ERROR)
        assert memory_ratio == pytest.approx(point.memory_ratio, rel=TP_CP_MEMORY_RATIO_ERROR)


def test_graph_replays_keep_a_fraction_of_the_fixed_cp_cost_and_fit_their_points() -> None:
    """Replayed as CUDA graphs, a CP step's fixed cost is what the host no longer adds: positive (collective
    latency, waits) and well under the eager one; the graph points follow within the documented error, and
    nothing but the CP steps changes."""
    graphed = model.fit_graph_host(FITTED, FLASH)
    assert 0 < graphed.cp_host_ms < FITTED.cp_host_ms / 2
    for point in model.GRAPH_CP_RATIOS:
        assert model.cp_ratios(point, FLASH, graphed)[0] == pytest.approx(point.time_ratio,
                                                                        rel=GRAPH_CP_TIME_RATIO_ERROR)
        assert model.cp_ratios(point, FLASH, graphed)[0] < model.cp_ratios(point, FLASH, FITTED)[0]
    one = model.Setup(H200, "C", 32768)
    assert model.predict(one, FLASH, graphed).step_ms == model.predict(one, FLASH, FITTED).step_ms


def test_command_line_prints_predictions_calibration_and_hiding(capsys: pytest.CaptureFixture) -> None:
    assert model.main(["--kind", "HC", "--layers", "4", "--seq-len", "65536", "--cp", "1", "8", "--tp", "1", "2",
                       "--gpu", "H100", "--recompute"]) == 0
    table = capsys.readouterr().out
    assert "H100, 4 layer(s) HCHC" in table and sum(line.startswith("| 65536 |") for line in table.splitlines()) == 4
    assert model.main(["--calibration"]) == 0
    assert "| H200 | C | 16384 | 39.34 ms |" in capsys.readouterr().out
    assert model.main(["--hiding"]) == 0
    assert "never hidden" in capsys.readouterr().out
    assert model.main(["--seq-len", "131072", "--cp", "8", "--cuda-graph"]) == 0
    assert "CUDA-graph replays (CP fixed cost 0.65 ms per layer)" in capsys.readouterr().out


def test_command_line_rejects_bad_input(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        model.main(["--kind", "M"])
    assert stop.value.code != 0 and "error: --kind must be made of W, C, H" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        model.main(["--cp", "0"])
    assert model.main(["--seq-len", "1000", "--cp", "3"]) == 0  # a row that cannot be built says why
    assert "must be a multiple of 2·cp = 6" in capsys.readouterr().out
