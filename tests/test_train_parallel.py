"""The main job under torchrun: TP 2 (+SP), CP 2 and DP 2 (replicated and sharded) follow the
single-process loss curve, and their checkpoints resume at another layout."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_dsa.train import read_history
from distributed import run_distributed

STEPS = 3
LAUNCH_TIMEOUT_S = 600
TOLERANCE = 1e-4  # fp32; the parallel runs reorder sums (all-reduce, split GEMMs): ~1e-6 seen


def small_job(tmp_path: Path) -> Path:
    job = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    job["train"].update(batch_size=2, seq_len=128, retrieval_pairs=2, retrieval_queries=2, eval_batches=1,
                        eval_interval=STEPS, checkpoint_interval=2, log_interval=1, corpus_max_bytes=200_000)
    job["model"]["max_seq_len"] = 128
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def losses(run_dir: Path) -> list[float]:
    return [step.loss for step in read_history(run_dir).steps]


def launch(args: list[str], nproc: int, program: tuple[str, ...] = ("-m", "megatron_dsa.train")) -> None:
    """Run the main job (or another `program`: a script path) on `nproc` processes (torchrun for more than one)."""
    command = ([sys.executable, *program] if nproc == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                *program])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Generous: on a CPU shared with other jobs two ranks plus the launcher can take minutes, and a
    # tight limit failed a correct run now and then.
    try:
        done = subprocess.run(command + args, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"")[-3000:], (error.stderr or b"")[-3000:]
        raise AssertionError(f"{' '.join(args)} did not finish within {LAUNCH_TIMEOUT_S} s: {output}") from None
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
    (["--dp-shard"], []),  # saved FSDP2-sharded over DP 2, resumed in one process
    (["--dp", "2"], ["--dp-shard"]),  # saved by DP replicas, resumed FSDP2-sharded over DP 2
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


def sequence_parallel_training_body(rank: int, world: int, cp: int) -> None:
    """Two optimizer steps of the main job's model at TP 2 + SP (± CP 2) and at TP 1, on the same
    batches: after each step every gradient, gathered to TP = 1, equals TP 1's (the SP norms' partial
    gradients summed over TP, the CP parts over CP), and every replicated parameter is identical on
    all ranks. fp64, so the only differences are summation order."""
    import torch.distributed as dist

    from megatron_dsa import train as job_module
    from megatron_dsa.config import HybridAttentionConfig
    from megatron_dsa.data import RetrievalTask, make_batch, seeded_generator
    from megatron_dsa.model import ModelConfig
    from megatron_dsa.parallel import initialize_parallel_state
    from megatron_dsa.parallel.sharding import partition_dims

    state = initialize_parallel_state(tp_size=world // cp, cp_size=cp)
    attention = HybridAttentionConfig.from_preset("tiny", num_layers=2, layer_pattern="CW", csa_window_size=8,
                                                  dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.1)
    job = job_module.JobConfig(attention.replace(sequence_parallel=True), ModelConfig(ffn_hidden_size=64, max_seq_len=32),
                               job_module.TrainConfig(seq_len=32, batch_size=2, retrieval_pairs=2, retrieval_queries=2,
                                                      warmup_steps=1, seed=5))
    text = torch.randint(32, 127, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    task = RetrievalTask(seq_len=32, num_pairs=2, num_queries=2, min_distance=8)
    models = {"parallel": job_module.build_model(job, torch.device("cpu"), state).double(),
              "single": job_module.build_model(dataclasses.replace(job, attention=attention), torch.device("cpu")).double()}
    optimizers = {name: job_module.build_optimizer(model, job.train) for name, model in models.items()}
    for step in range(2):
        batch = make_batch(text, task, 2, 0, seeded_generator(5, "sp-test", step))
        grads = {}
        for name, model in models.items():
            job_module.train_step(model, optimizers[name], batch, step, job.train, torch.device("cpu"))
            grads[name] = {n: p.grad for n, p in model.named_parameters()}
        dims = partition_dims(models["parallel"])
        for name, param in models["parallel"].named_parameters():
            grad, dim = grads["parallel"][name], dims[name]
            if dim is not None:
                parts = [torch.empty_like(grad) for _ in range(state.tp_size)]
                dist.all_gather(parts, grad.contiguous(), group=state.tp_group)
                grad = torch.cat(parts, dim)
            else:
                copies = [torch.empty_like(param) for _ in range(world)]
                dist.all_gather(copies, param.detach().contiguous())
                worst = max((copies[0] - c).abs().max().item() for c in copies)
                assert worst == 0, f"step {step}: {name} differs between ranks by {worst:.3e}"
            torch.testing.assert_close(grad, grads["single"][name], rtol=1e-9, atol=1e-12, msg=f"step {step}: {name}")


@pytest.mark.parametrize("cp", [1, 2])
def test_sequence_parallel_training_keeps_every_gradient_and_replica(cp: int) -> None:
    run_distributed(sequence_parallel_training_body, 2 * cp, cp)


# The main job as torchrun runs it, then a check on the process's state after it returned.
LEFT_BEHIND_CHECK = """import sys
import torch.distributed as dist
from megatron_dsa.train import main
main(sys.argv[1:])
assert not dist.is_initialized(), "the job returned with its process group still alive"
"""


def test_the_job_destroys_the_process_group_it_made(tmp_path):
    """Under torchrun the job makes the process group, so it destroys it once its last save committed: NCCL
    warns at exit about a group left behind (gloo, here, does not; the state after `main` says it)."""
    script = tmp_path / "job_then_check.py"
    script.write_text(LEFT_BEHIND_CHECK)
    launch(["--config", str(small_job(tmp_path)), "--steps", "1", "--out", str(tmp_path / "run"), "--cp", "2"], 2,
           program=(str(script),))


def callers_group_body(rank: int, world: int, job: str, out: str) -> None:
    from megatron_dsa.train import main

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))  # as torchrun sets them
    main(["--config", job, "--steps", "1", "--out", out, "--cp", "2", "--no-progress"])
    assert torch.distributed.is_initialized(), "the job destroyed a process group its caller made"


def test_the_job_leaves_a_process_group_its_caller_made(tmp_path):
    run_distributed(callers_group_body, 2, str(small_job(tmp_path)), str(tmp_path / "run"), timeout_s=300)
