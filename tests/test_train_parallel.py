"""The main job under torchrun: TP 2 (+SP) and CP 2 follow the single-process loss curve, and
their checkpoints resume at another layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_dsa.train import read_history

STEPS = 3
TOLERANCE = 1e-4  # fp32; the parallel runs reorder sums (all-reduce, split GEMMs): ~1e-6 seen


def small_job(tmp_path: Path) -> Path:
    job = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    job["train"].update(batch_size=2, seq_len=128, retrieval_pairs=2, eval_batches=1, eval_interval=STEPS,
                        checkpoint_interval=2, log_interval=1, corpus_max_bytes=200_000)
    job["model"]["max_seq_len"] = 128
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def losses(run_dir: Path) -> list[float]:
    return [step.loss for step in read_history(run_dir).steps]


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
    return job, losses(tmp / "run")


@pytest.mark.parametrize("flags,resume_flags", [
    (["--tp", "2", "--sp"], []),  # saved sharded over TP, resumed at TP = 1
    (["--cp", "2"], ["--tp", "2"]),  # saved by CP replicas, resumed sharded over TP
])
def test_parallel_job_follows_single_process_losses_and_reshards(reference, tmp_path, flags, resume_flags):
    """The first leg runs the parallel layout for 2 steps; the second resumes its checkpoint at
    another layout (resharded on load) and finishes: every loss follows the TP = 1 run."""
    job, expected = reference
    out = tmp_path / "run"
    launch(["--config", str(job), "--steps", "2", "--out", str(out)] + flags, 2)
    launch(["--config", str(job), "--steps", str(STEPS), "--out", str(out), "--resume"] + resume_flags,
           2 if resume_flags else 1)
    got = losses(out)
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected)) < TOLERANCE, (got, expected)
