"""The main job's checkpoints (`megatron_dsa.checkpointing`): resharding, atomic commits.

Resharding is checked against the saving run's own tensors gathered to TP = 1 (model and AdamW
moments, exactly); atomicity by a process that dies while its save is in flight.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megatron_dsa import HybridAttentionConfig
from megatron_dsa.checkpointing import CheckpointWriter, latest_checkpoint, load_checkpoint
from megatron_dsa.model import HybridLM, ModelConfig
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.sharding import gather_full_state_dict, partition_dims

REPO = Path(__file__).resolve().parents[1]
ATTENTION = HybridAttentionConfig.from_preset("tiny", num_layers=2, layer_pattern="CM")
MODEL = ModelConfig(ffn_hidden_size=64, max_seq_len=32)


def trained(state, seed: int) -> tuple[HybridLM, torch.optim.Optimizer]:
    """A model after one AdamW step (so the moments are not zero)."""
    torch.manual_seed(seed)
    model = HybridLM(ATTENTION, MODEL, parallel_state=state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    return model, optimizer


def full_moments(model: HybridLM, optimizer: torch.optim.Optimizer, state) -> dict[str, torch.Tensor]:
    """`{name.exp_avg / name.exp_avg_sq: TP = 1 tensor}` (collective over TP)."""
    moments = {}
    for name, param in model.named_parameters():
        dim = partition_dims(model)[name]
        for key in ("exp_avg", "exp_avg_sq"):
            value = optimizer.state[param][key]
            if dim is not None and state.tp_size > 1:
                parts = [torch.empty_like(value) for _ in range(state.tp_size)]
                dist.all_gather(parts, value, group=state.tp_group)
                value = torch.cat(parts, dim)
            moments[f"{name}.{key}"] = value.clone()
    return moments


def reshard_body(rank: int, world: int, root: str) -> None:
    root = Path(root)
    for saved_tp, loaded_tp in ((world, 1), (1, world)):
        out = root / f"tp{saved_tp}-to-tp{loaded_tp}"
        state = initialize_parallel_state(tp_size=saved_tp)
        model, optimizer = trained(state, seed=3)
        expected, moments = gather_full_state_dict(model, state), full_moments(model, optimizer, state)
        writer = CheckpointWriter(out, state)
        writer.save(1, model, optimizer, {"step": 1, "note": [1, 2]})
        assert writer.wait() == out / "checkpoints" / "step-000001"

        state = initialize_parallel_state(tp_size=loaded_tp)
        model, optimizer = trained(state, seed=4)  # other weights and moments, to be overwritten
        extra = load_checkpoint(latest_checkpoint(out), model, optimizer, state)
        assert extra["note"] == [1, 2]
        got = gather_full_state_dict(model, state)
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"TP {saved_tp} -> {loaded_tp}: {key}"
        for key, value in full_moments(model, optimizer, state).items():
            assert torch.equal(value, moments[key]), f"TP {saved_tp} -> {loaded_tp}: {key}"


def test_checkpoint_reshards_between_tp_sizes(tmp_path) -> None:
    run_distributed(reshard_body, 2, str(tmp_path))


CRASH = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from test_checkpointing import trained
    from megatron_dsa.checkpointing import CheckpointWriter
    model, optimizer = trained(None, seed=3)
    writer = CheckpointWriter({out!r}, None)
    writer.save(1, model, optimizer, {{"step": 1}})
    writer.wait()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    writer.save(2, model, optimizer, {{"step": 2}})
    os._exit(9)  # dies with the second save in flight: never committed
""")


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", CRASH.format(tests=str(REPO / "tests"), out=str(out))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr[-2000:]
    latest = latest_checkpoint(out)
    assert latest == out / "checkpoints" / "step-000001"
    assert not (out / "checkpoints" / "step-000002").exists()
    model, optimizer = trained(None, seed=5)
    assert load_checkpoint(latest, model, optimizer, None)["step"] == 1
    expected, _ = trained(None, seed=3)
    for (name, value), reference in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(value, reference), name


def test_an_incomplete_checkpoint_directory_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "step-000007.partial").mkdir()
    model, optimizer = trained(None, seed=3)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "step-000007.partial", model, optimizer, None)
