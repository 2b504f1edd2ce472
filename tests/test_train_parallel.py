"""The main job under torchrun: TP 2 (+SP) and CP 2 follow the single-process loss curve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

STEPS = 3
TOLERANCE = 1e-4  # fp32; the parallel runs reorder sums (all-reduce, split GEMMs): ~1e-6 seen


def small_job(tmp_path: Path) -> Path:
    job = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    job["train"].update(batch_size=2, seq_len=128, retrieval_pairs=2, eval_batches=1, eval_interval=STEPS,
                        checkpoint_interval=STEPS, log_interval=1, corpus_max_bytes=200_000)
    job["model"]["max_seq_len"] = 128
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def losses(run_dir: Path, checkpoint: str) -> list[float]:
    state = torch.load(run_dir / checkpoint, map_location="cpu", weights_only=True)
    return [step["loss"] for step in state["history"]["steps"]]


def launch(args: list[str], nproc: int) -> None:
    command = ([sys.executable, "-m", "megatron_dsa.train"] if nproc == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--standalone", "-m", "megatron_dsa.train"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command + args, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp1")
    job = small_job(tmp)
    launch(["--config", str(job), "--steps", str(STEPS), "--out", str(tmp / "run")], 1)
    return job, losses(tmp / "run", "checkpoint.pt")


@pytest.mark.parametrize("flags,checkpoint", [
    (["--tp", "2", "--sp"], "checkpoint-tp2-cp1-rank0.pt"),
    (["--cp", "2"], "checkpoint-tp1-cp2-rank0.pt"),
])
def test_parallel_job_follows_single_process_losses(reference, tmp_path, flags, checkpoint):
    job, expected = reference
    launch(["--config", str(job), "--steps", str(STEPS), "--out", str(tmp_path / "run")] + flags, 2)
    got = losses(tmp_path / "run", checkpoint)
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected)) < TOLERANCE, (got, expected)
    assert (tmp_path / "run" / "model-tp1.pt").is_file()


def test_parallel_flags_without_torchrun_are_a_clear_error(tmp_path):
    job = small_job(tmp_path)
    command = [sys.executable, "-m", "megatron_dsa.train", "--config", str(job), "--tp", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "torchrun --nproc-per-node 2" in done.stderr
