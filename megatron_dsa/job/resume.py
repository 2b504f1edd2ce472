"""Checkpointing glue: what a checkpoint holds besides the model and optimizer, which checkpoint a run
resumes from, and resuming from it."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dsa.checkpointing import (CHECKPOINTS_DIR, CheckpointError, latest_checkpoint, load_checkpoint,
                                        read_manifest)
from megatron_dsa.job.config import JobConfig, TrainConfig
from megatron_dsa.job.records import History
from megatron_dsa.model import HybridLM
from megatron_dsa.parallel import ParallelState


# Attention fields that describe the parallel layout or the kernels, not the weights: a checkpoint
# resumes under other values of them (e.g. saved with --tp 2 --sp, resumed with --tp 1).
LAYOUT_FIELDS = ("sequence_parallel", "cp_comm_type", "cp_partition", "attention_backend",
                 "attention_backend_overrides")


def job_extra(next_step: int, job: JobConfig, history: History) -> dict[str, Any]:
    """What a checkpoint holds besides the model and optimizer (identical on every rank)."""
    return {"step": next_step, "config": job.to_dict(), "history": history.to_dict(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1}


def resume_from(path: Path, model: HybridLM, optimizer: torch.optim.Optimizer, job: JobConfig,
                state: Optional[ParallelState], timeout: Optional[datetime.timedelta] = None
                ) -> tuple[int, History, dict[str, Any]]:
    """Restore model, optimizer (and, at the same world size, RNG) states from the checkpoint
    directory `path`, resharded to this run's layout; returns `(next_step, history, the saved
    train: section)`; `timeout`: how long the load's collectives wait for a stalled rank."""
    saved_config = read_manifest(path)["config"]  # compared before any tensor is read
    for section in ("attention", "model"):
        saved, wanted = dict(saved_config[section]), job.to_dict()[section]
        if section == "attention":
            saved.update({key: wanted[key] for key in LAYOUT_FIELDS})
        if saved != wanted:
            changed = sorted(key for key in wanted if saved.get(key) != wanted[key])
            raise CheckpointError(f"checkpoint {path} was trained with a different `{section}:` section "
                                  f"(fields {changed}); resume it with its own config ({path.parent.parent}/config.yaml)")
    extra = load_checkpoint(path, model, optimizer, state, timeout)
    return extra["step"], History.from_dict(extra["history"]), extra["config"]["train"]


def keep_saved_schedule(train: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    """A resumed run follows the saved run's cosine horizon (its `lr_decay_steps`, else its `steps`)
    unless this run sets `lr_decay_steps`: `--steps 720` after a 700-step run adds 20 steps at the
    final learning rate instead of re-stretching the schedule under the trained model."""
    if train.lr_decay_steps is not None:
        return train
    return dataclasses.replace(train, lr_decay_steps=saved["lr_decay_steps"] or saved["steps"])


def resume_point(args: argparse.Namespace, out_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from, or None for a fresh run; a fresh run into a directory that
    holds one is refused unless `--overwrite` (runs never overwrite each other by accident)."""
    latest = latest_checkpoint(out_dir)
    if args.resume is not None:
        if args.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        resume = Path(args.resume) if args.resume else latest
        if resume is None:
            raise ValueError(f"--resume: no checkpoint in {out_dir / CHECKPOINTS_DIR}")
        return resume
    if latest is not None and not args.overwrite:
        raise ValueError(f"{out_dir} already holds a run (newest checkpoint {latest.name}): --resume continues it, "
                         f"--out DIR starts a new one elsewhere, --overwrite starts over here (deleting its "
                         f"checkpoints)")
    return None
