"""The main job's checkpoints (`megatron_dsa.checkpointing`): resharding, atomic commits, verified loads.

Resharding is checked against the saving run's own tensors gathered to TP = 1 (model and AdamW
moments, exactly); atomicity by a process that dies while its save is in flight.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megatron_dsa import HybridAttentionConfig
from megatron_dsa.checkpointing import CheckpointError, CheckpointWriter, fingerprint, latest_checkpoint, load_checkpoint
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


def saved_run(out: Path, seed: int = 3, step: int = 1) -> Path:
    model, optimizer = trained(None, seed=seed)
    writer = CheckpointWriter(out, None)
    writer.save(step, model, optimizer, {"step": step, "config": {"seed": seed}})
    return writer.wait()


def test_the_manifest_names_step_config_layout_and_every_file(tmp_path) -> None:
    path = saved_run(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["config_fingerprint"] == fingerprint({"seed": 3})
    assert (manifest["world_size"], manifest["tp_size"], manifest["cp_size"]) == (1, 1, 1)
    assert manifest["ranks"] == [{"rank": 0, "tp_rank": 0, "cp_rank": 0}]
    on_disk = {p.name for p in path.iterdir() if p.name != "manifest.json"}
    assert set(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (path / name).stat().st_size
        assert entry["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 200] = bytes(255 - b for b in data[middle:middle + 200])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    (lambda path: flip_bytes(path / "__0_0.distcp"), "__0_0.distcp does not match its SHA-256"),
    (lambda path: os.truncate(path / "__0_0.distcp", 100), "__0_0.distcp has 100 bytes"),
    (lambda path: (path / "rng-rank0.pt").unlink(), "rng-rank0.pt is missing"),
    (lambda path: (path / "manifest.json").unlink(), "manifest.json is missing or damaged"),
    (lambda path: (path / "manifest.json").write_text("{"), "manifest.json is missing or damaged"),
], ids=["200-bytes-flipped", "truncated", "rng-missing", "no-manifest", "manifest-garbage"])
def test_a_damaged_checkpoint_is_refused_before_loading(tmp_path, damage, words) -> None:
    path = saved_run(tmp_path)
    damage(path)
    model, optimizer = trained(None, seed=5)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=re.escape(words)):
        load_checkpoint(path, model, optimizer, None)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a refused load"


def test_a_shard_from_another_step_is_refused(tmp_path) -> None:
    first, second = saved_run(tmp_path / "a", seed=3, step=1), saved_run(tmp_path / "b", seed=4, step=2)
    shutil.copy(first / "__0_0.distcp", second / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="__0_0.distcp"):
        load_checkpoint(second, *trained(None, seed=5), None)


def test_non_finite_state_is_never_checkpointed(tmp_path) -> None:
    model, optimizer = trained(None, seed=3)
    writer = CheckpointWriter(tmp_path, None)
    writer.save(1, model, optimizer, {"step": 1})
    writer.wait()
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[3] = float("nan")
    with pytest.raises(CheckpointError, match=f"non-finite values in .*model/{re.escape(name)}"):
        writer.save(2, model, optimizer, {"step": 2})
    assert latest_checkpoint(tmp_path).name == "step-000001"


def different_checkpoints_body(rank: int, world: int, root: str) -> None:
    path = Path(root) / f"rank{rank}" / "checkpoints" / "step-000001"
    with pytest.raises(CheckpointError, match="the ranks resume from different checkpoints: rank 0: .*rank0.*rank 1: .*rank1"):
        load_checkpoint(path, *trained(None, seed=5), None)


def test_ranks_resuming_from_different_checkpoints_are_refused(tmp_path) -> None:
    for rank in range(2):
        saved_run(tmp_path / f"rank{rank}")
    run_distributed(different_checkpoints_body, 2, str(tmp_path))


STALL_TIMEOUT = datetime.timedelta(seconds=2)


def stalled_rank_body(rank: int, world: int, root: str) -> None:
    """Rank 1 joins the creation of the save's and the load's groups (collective) and then stalls:
    rank 0 gives up after their `timeout`, not after torch's 30 minutes for new groups."""
    model, optimizer = trained(None, seed=3)
    writer = CheckpointWriter(Path(root) / "stalled", None, STALL_TIMEOUT)
    if rank == 0:
        began = time.perf_counter()
        with pytest.raises(RuntimeError, match="(?i)timed out"):
            writer.save(1, model, optimizer, {"step": 1})
        assert time.perf_counter() - began < 30
        began = time.perf_counter()
        with pytest.raises(RuntimeError, match="(?i)timed out"):
            load_checkpoint(Path(root) / "saved" / "checkpoints" / "step-000001", model, optimizer, None, STALL_TIMEOUT)
        assert time.perf_counter() - began < 30
    else:
        dist.new_group(backend="gloo")  # the load's group; its collectives never come
    dist.barrier()  # the default group: rank 1 waits here for rank 0's two timeouts


def test_checkpoint_groups_give_up_on_a_stalled_rank_after_their_timeout(tmp_path) -> None:
    saved_run(tmp_path / "saved")
    run_distributed(stalled_rank_body, 2, str(tmp_path), timeout_s=90)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path) -> None:
    """`save` returns with the copy to host still running on a side stream; the next updates must
    not reach the checkpoint (they wait for the copy), and the buffers are reused by the next save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.randn(64, 2048, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    writer = CheckpointWriter(tmp_path, None)
    writer.prepare(model, optimizer)  # pinned buffers allocated in the background
    for saved_step in (1, 2):
        expected = {key: value.clone() for key, value in model.state_dict().items()}
        moments = {name: optimizer.state[param]["exp_avg"].clone() for name, param in model.named_parameters()}
        writer.save(saved_step, model, optimizer, {"step": saved_step})
        for _ in range(3):  # updates issued right away, while the copy runs
            step()
        assert writer.wait().name == f"step-00000{saved_step}"
        fresh = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh(torch.randn(1, 2048, device="cuda")).sum().backward()
        fresh_optimizer.step()
        load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_optimizer, None)
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, expected[key]), f"save {saved_step}: {key}"
        for name, param in fresh.named_parameters():
            assert torch.equal(fresh_optimizer.state[param]["exp_avg"], moments[name]), f"save {saved_step}: {name}"
    assert all(buffer.is_pinned() for buffer in writer.staging.buffers.values() if buffer.numel() > 1)


def test_prepared_host_buffers_are_the_ones_the_saves_fill(tmp_path) -> None:
    model, optimizer = trained(None, seed=3)
    writer = CheckpointWriter(tmp_path, None)
    writer.prepare(model, optimizer)
    writer.save(1, model, optimizer, {"step": 1})
    writer.wait()
    buffers = {path: buffer.data_ptr() for path, buffer in writer.staging.buffers.items()}
    assert len(buffers) == len(model.state_dict()) + 3 * len(list(model.parameters()))  # AdamW: step, 2 moments
    writer.save(2, model, optimizer, {"step": 2})
    writer.wait()
    assert {path: buffer.data_ptr() for path, buffer in writer.staging.buffers.items()} == buffers


def test_a_save_commits_itself_without_waiting_for_the_next_one(tmp_path) -> None:
    """The newest complete save becomes `latest` while training goes on, not at the next save."""
    model, optimizer = trained(None, seed=3)
    writer = CheckpointWriter(tmp_path, None)
    writer.save(1, model, optimizer, {"step": 1})
    deadline = time.monotonic() + 60
    while latest_checkpoint(tmp_path) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000001"
    assert (latest_checkpoint(tmp_path) / "manifest.json").is_file()
    assert writer.wait() == latest_checkpoint(tmp_path)
