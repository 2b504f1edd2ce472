"""The job itself: the launch check, process groups and the training loop."""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.checkpointing import CHECKPOINTS_DIR, CheckpointError, CheckpointWriter
from megatron_dsa.data_parallel import data_parallel_size, shard_over_data_parallel
from megatron_dsa.job.batches import load_corpus, train_batch
from megatron_dsa.job.config import JobConfig
from megatron_dsa.job.errors import JobStopped
from megatron_dsa.job.evaluation import evaluate
from megatron_dsa.job.plots import PLOT_NAME, plot_history
from megatron_dsa.job.records import HISTORY_NAME, History, write_history
from megatron_dsa.job.report import describe_retrieval, format_backends, format_eval, format_step
from megatron_dsa.job.resume import job_extra, keep_saved_schedule, resume_from
from megatron_dsa.job.steps import build_model, build_optimizer, train_step
from megatron_dsa.parallel import ParallelState, initialize_parallel_state
from megatron_dsa.parallel.consistency import check_same_on_all_ranks, naming_stalled_ranks, wait_for_all_ranks

DIST_TIMEOUT_S = 600.0  # Megatron-LM's default distributed timeout (10 minutes)
STALL_PROBE_S = 60.0  # after a collective timed out: how long the ranks that answer wait for the others


def resolve_device(name: str) -> torch.device:
    """`cpu` or a CUDA device; a CUDA request on a machine without CUDA is a clear error."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} requested but CUDA is not available on this machine "
                         f"(torch {torch.__version__}, torch.cuda.is_available() is False)")
    return torch.device(name)


def check_launch(tp: int, cp: int, dp: Optional[int] = None) -> int:
    """The world size (WORLD_SIZE, 1 without torchrun) after checking that it is a DP × CP × TP grid
    (DP = WORLD_SIZE / (tp · cp), or `dp`, checked against it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and tp * cp != 1:
        raise ValueError(f"--tp {tp} --cp {cp} needs {tp * cp} processes: launch with "
                         f"torchrun --nproc-per-node {tp * cp} -m megatron_dsa.train ...")
    data_parallel_size(world, tp, cp, dp)
    return world


def setup_parallel(tp: int, cp: int, device: torch.device, dp: Optional[int] = None,
                   timeout_s: float = DIST_TIMEOUT_S) -> Optional[ParallelState]:
    """Process groups for a torchrun launch (WORLD_SIZE > 1): gloo on CPU, NCCL on CUDA; a
    collective that waits longer than `timeout_s` for a failed or stalled rank ends the job."""
    if check_launch(tp, cp, dp) == 1:
        return None
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return initialize_parallel_state(tp_size=tp, cp_size=cp, timeout=datetime.timedelta(seconds=timeout_s))


def run(job: JobConfig, resume: Optional[Path] = None, tp: int = 1, cp: int = 1, overwrite: bool = False,
        progress_bar: bool = True, dp: Optional[int] = None, dist_timeout_s: float = DIST_TIMEOUT_S) -> History:
    """Train to `job.train.steps` (continuing from the checkpoint directory `resume` if given);
    returns the full history. `overwrite` first deletes the output directory's checkpoints and
    history; `progress_bar` shows tqdm's bar on a terminal (plain log lines otherwise).

    Under torchrun every rank trains its shard of the DP × CP × TP grid (DP = WORLD_SIZE / (tp · cp),
    `dp` if given is checked); rank 0 prints and plots.
    """
    train = job.train
    device = resolve_device(train.device)
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    state = setup_parallel(tp, cp, device, dp, dist_timeout_s)
    dist_timeout = datetime.timedelta(seconds=dist_timeout_s)  # for every group the job creates
    checks = None  # a gloo group for the checks that name ranks
    if state is not None:  # every rank is here and runs the same job, or the error names who is not
        checks = dist.new_group(backend="gloo", timeout=dist_timeout)
        wait_for_all_ranks(checks, dist_timeout_s, "job start")
        check_same_on_all_ranks("the job's configuration", job.to_dict(), checks)
    dp_size = 1 if state is None else state.dp_size
    accumulation = train.accumulation_steps(dp_size)
    if train.pack and cp > 1:
        raise ValueError("--pack with --cp is not supported by the training job yet "
                         "(the layer supports it: pass global PackedSeqParams with host cu_seqlens)")
    leader = state is None or dist.get_rank() == 0
    say = print if leader else (lambda *args, **kwargs: None)
    out_dir = Path(train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if overwrite:
        if leader:
            shutil.rmtree(out_dir / CHECKPOINTS_DIR, ignore_errors=True)
            (out_dir / HISTORY_NAME).unlink(missing_ok=True)
        if state is not None:
            dist.barrier()  # nobody goes on while the leader clears the directory
    if leader:
        (out_dir / "config.yaml").write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
    corpus = load_corpus(train)
    validation_text = corpus.validation

    model = build_model(job, device, state)
    if train.data_parallel == "shard" and dp_size > 1:
        shard_over_data_parallel(model, state)
    optimizer = build_optimizer(model, train)
    start, history = 0, History()
    if resume is not None:
        start, history, saved_train = resume_from(resume, model, optimizer, job, state, dist_timeout)
        if start >= train.steps:
            raise JobStopped(f"the checkpoint {resume} is at step {start}: --steps {train.steps} leaves nothing "
                             f"to train (give --steps > {start})")
        train = keep_saved_schedule(train, saved_train)
        job = dataclasses.replace(job, train=train)
    layout = "" if state is None else (f" | tp {state.tp_size}{' + sp' if job.attention.sequence_parallel else ''}, "
                                       f"cp {state.cp_size} ({job.attention.cp_comm_type}), dp {dp_size}"
                                       f"{' (' + train.data_parallel + ')' if dp_size > 1 else ''}")
    say(f"HybridLM: {sum(p.numel() for p in model.parameters()):,} parameters"
        f"{' on this rank' if state is not None else ''}, pattern "
        f"{job.attention.layer_pattern}, window {job.attention.csa_window_size} | device {device}, "
        f"{train.dtype}{layout} | corpus {corpus.train.numel():,} train / {validation_text.numel():,} "
        f"validation bytes | batch {train.batch_size}x{train.seq_len} = {train.batch_size // (dp_size * accumulation)} "
        f"rows x {accumulation} micro-batches x dp {dp_size} "
        f"({train.retrieval_rows} retrieval rows{', packed documents' if train.pack else ''})"
        + (f" | resumed at step {start}" if start else ""))
    say(describe_retrieval(job))
    if not history.evals:
        history.evals.append(evaluate(model, job, validation_text, device, start))
        say(format_eval(history.evals[-1]))

    checkpoints = CheckpointWriter(out_dir, state, dist_timeout)
    reset_call_counts()
    began = time.perf_counter()
    progress = tqdm(range(start, train.steps), initial=start, total=train.steps, desc="train",
                    dynamic_ncols=True, disable=not (leader and progress_bar and sys.stderr.isatty()))
    write = tqdm.write if leader else (lambda *args, **kwargs: None)
    try:
        for step in progress:
            with naming_stalled_ranks(checks, f"step {step + 1}", min(dist_timeout_s, STALL_PROBE_S)):
                batch, packed = train_batch(job, corpus.train, step)  # the global batch; train_step takes this rank's rows
                stats = train_step(model, optimizer, batch, step, train, device, packed)
            history.steps.append(stats)
            progress.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{stats.tokens_per_s:,.0f}")
            if step == start:
                write("backend per op (first step):\n" + format_backends(call_counts()))
                checkpoints.prepare(model, optimizer)  # the optimizer has its state now
            completed = step + 1
            if completed % train.log_interval == 0 or step == start:
                write(format_step(stats))
            if completed % train.eval_interval == 0 or completed == train.steps:
                history.evals.append(evaluate(model, job, validation_text, device, completed))
                write(format_eval(history.evals[-1]))
            if completed % train.checkpoint_interval == 0 or completed == train.steps:
                checkpoints.save(completed, model, optimizer, job_extra(completed, job, history))
                write(f"checkpoint of step {completed}: the save took {checkpoints.last_staging_seconds:.2f} s of "
                      f"this step (host buffers: {checkpoints.staging.allocated_bytes / 2**30:.2f} GiB, allocated "
                      f"in the background after the first step); copying and writing go on in the background")
                if leader:
                    write_history(history, out_dir)
    except (JobStopped, CheckpointError):  # every rank stops here together
        checkpoints.wait()  # the save in flight commits (or fails) before the job ends
        raise
    progress.close()
    committed = checkpoints.wait()
    if leader:
        write_history(history, out_dir)
        plot_history(history, out_dir / PLOT_NAME)
    saved = "" if committed is None else (f" | checkpoint {committed} (last save took "
                                          f"{checkpoints.last_save_seconds:.1f} s)")
    say(f"done: {train.steps} steps ({len(history.steps) - start} this run) in {time.perf_counter() - began:.1f} s"
        f"{saved} | plot {out_dir / PLOT_NAME}")
    return history
