"""Train `HybridLM` on the built-in corpus (bytes) plus the long-range retrieval task.

    python -m megatron_dsa.train --config configs/tiny.yaml [--steps N] [--out DIR] [--device cuda]
                                 [--resume [CKPT]] [--seed S] [--dtype fp32|bf16]

The YAML file has three sections: `attention:` (`HybridAttentionConfig`), `model:` (`ModelConfig`)
and `train:` (`TrainConfig`); CLI flags override it. The output directory receives
`checkpoints/step-N/` (sharded model and optimizer, step, config, history and per-rank RNG states,
written asynchronously and atomically; see `megatron_dsa.checkpointing`), `history.json`,
`config.yaml` and `loss_curve.png`. Batches are pure functions of (seed, step), so `--resume`
continues exactly: the resumed run's losses equal those of an uninterrupted one (at another
--tp / --cp the checkpoint is resharded and the losses follow to rounding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

import torch.distributed as dist

from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.checkpointing import CHECKPOINTS_DIR, CheckpointWriter, latest_checkpoint, load_checkpoint
from megatron_dsa.config import HybridAttentionConfig, check_field_types
from megatron_dsa.data import (BUILTIN, KEY_ALPHABET, Batch, CorpusError, CorpusSplit, RetrievalTask,
                               load_corpus_bytes, make_batch, pack_documents, seeded_generator, split_corpus,
                               window_reach)
from megatron_dsa.model import SEQUENCE_PARALLEL_GRAD, HybridLM, ModelConfig
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel import ParallelState, initialize_parallel_state
from megatron_dsa.parallel.context import shard_sequence
from megatron_dsa.parallel.sharding import partition_dim

HISTORY_NAME = "history.json"
PLOT_NAME = "loss_curve.png"
DTYPES = ("fp32", "bf16")


# ---------------------------------------------------------------- configuration
@dataclass
class TrainConfig:
    """The `train:` section. Steps are optimizer steps; intervals count completed steps."""

    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    lr_decay_steps: Optional[int] = None  # cosine horizon, None = `steps` (Megatron --lr-decay-iters)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    retrieval_fraction: float = 0.25  # share of each batch's rows that are retrieval sequences
    retrieval_pairs: int = 8  # key/value pairs at the start of a retrieval sequence (<= 26)
    retrieval_queries: int = 4  # keys asked at its end (<= retrieval_pairs), one answer byte each
    corpus: str = BUILTIN  # LM text: the built-in corpus (pinned by SHA-256) or a text file's path
    corpus_max_bytes: int = 4_000_000
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 4
    checkpoint_interval: int = 100
    out_dir: str = "runs/tiny"
    device: str = "cpu"
    dtype: str = "fp32"
    pack: bool = False  # pack documents into one THD sequence per batch (cu_seqlens)

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("steps", "batch_size", "seq_len", "retrieval_pairs", "retrieval_queries", "corpus_max_bytes",
                     "log_interval", "eval_interval", "eval_batches", "checkpoint_interval"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("warmup_steps", self.warmup_steps, minimum=0)
        _require_int("seed", self.seed, minimum=0)
        if self.lr_decay_steps is not None:
            _require_int("lr_decay_steps", self.lr_decay_steps, minimum=1)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"train.{name} must be a number >= 0, got {value!r}")
        if self.lr == 0 or self.min_lr > self.lr:
            raise ValueError(f"train.lr must be > 0 and train.min_lr <= train.lr, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        for name in ("adam_beta1", "adam_beta2", "retrieval_fraction"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"train.{name} must be in [0, 1], got {value!r}")
        if self.retrieval_pairs > len(KEY_ALPHABET) or self.retrieval_queries > self.retrieval_pairs:
            raise ValueError(f"train.retrieval_queries ({self.retrieval_queries}) must be <= train.retrieval_pairs "
                             f"({self.retrieval_pairs}) <= {len(KEY_ALPHABET)} (each query asks a different "
                             f"one-letter key)")
        if self.corpus != BUILTIN and not Path(self.corpus).is_file():
            raise ValueError(f"train.corpus must be {BUILTIN!r} or the path of a text file, got {self.corpus!r} "
                             f"(no such file)")
        if self.dtype not in DTYPES:
            raise ValueError(f"train.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"train.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @property
    def retrieval_rows(self) -> int:
        return round(self.retrieval_fraction * self.batch_size)

    @property
    def decay_horizon(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.steps


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"train.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class JobConfig:
    """A whole training job: the three YAML sections."""

    attention: HybridAttentionConfig
    model: ModelConfig
    train: TrainConfig

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len ({self.train.seq_len}) exceeds model.max_seq_len "
                             f"({self.model.max_seq_len})")
        self.retrieval_task()  # fail at load time if the task does not fit the sequence

    def retrieval_task(self) -> RetrievalTask:
        """Every value lies beyond one sliding window of its query; `describe_retrieval` says whether
        it also lies beyond the reach of a window-only stack of this depth (it does for tiny.yaml)."""
        return RetrievalTask(seq_len=self.train.seq_len, num_pairs=self.train.retrieval_pairs,
                             num_queries=self.train.retrieval_queries, min_distance=self.attention.csa_window_size)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "JobConfig":
        if not isinstance(values, dict):
            raise TypeError(f"a job config is a mapping with sections attention, model and train; got a "
                            f"{type(values).__name__}")
        unknown = sorted(set(values) - {"attention", "model", "train"})
        if unknown:
            raise ValueError(f"unknown config section(s): {unknown}; expected attention, model, train")
        train_values = values.get("train") or {}
        if not isinstance(train_values, dict):
            raise TypeError(f"the train: section must be a mapping of field: value, got a "
                            f"{type(train_values).__name__}")
        train_values = dict(train_values)
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        if set(train_values) - known:
            raise ValueError(f"unknown TrainConfig field(s): {sorted(set(train_values) - known)}")
        return cls(attention=HybridAttentionConfig.from_dict(values.get("attention") or {}),
                   model=ModelConfig.from_dict(values.get("model") or {}),
                   train=TrainConfig(**train_values))

    @classmethod
    def from_yaml(cls, path: Path | str, **train_overrides: Any) -> "JobConfig":
        """Load `path`; `train_overrides` (None values skipped) replace `train:` fields."""
        values = yaml.safe_load(Path(path).read_text()) or {}
        overrides = {k: v for k, v in train_overrides.items() if v is not None}
        if isinstance(values, dict) and isinstance(values.get("train") or {}, dict):
            values["train"] = {**(values.get("train") or {}), **overrides}
        return cls.from_dict(values)  # it names what is not a mapping

    def to_dict(self) -> dict[str, Any]:
        return {"attention": self.attention.to_dict(), "model": self.model.to_dict(),
                "train": dataclasses.asdict(self.train)}


# ---------------------------------------------------------------- records
@dataclass
class StepStats:
    step: int  # 0-based index of the optimizer step
    loss: float  # the optimised loss: mean over rows of each row's masked mean
    lm_loss: Optional[float]  # LM rows only
    retrieval_loss: Optional[float]  # retrieval rows only (answer bytes)
    indexer_losses: dict[int, float]  # layer_number -> coefficient-scaled KL
    grad_norm: float
    lr: float
    tokens_per_s: float


@dataclass
class EvalStats:
    step: int  # completed steps when evaluated
    val_lm_loss: float
    retrieval_accuracy: float  # answer digits predicted exactly (chance 0.1)


@dataclass
class History:
    steps: list[StepStats] = field(default_factory=list)
    evals: list[EvalStats] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": [dataclasses.asdict(s) for s in self.steps],
                "evals": [dataclasses.asdict(e) for e in self.evals]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "History":
        # JSON (history.json) keeps dict keys as strings: layer numbers come back as ints.
        return cls(steps=[StepStats(**{**s, "indexer_losses": {int(k): v for k, v in s["indexer_losses"].items()}})
                          for s in values["steps"]],
                   evals=[EvalStats(**e) for e in values["evals"]])


# ---------------------------------------------------------------- building blocks
def resolve_device(name: str) -> torch.device:
    """`cpu` or a CUDA device; a CUDA request on a machine without CUDA is a clear error."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} requested but CUDA is not available on this machine "
                         f"(torch {torch.__version__}, torch.cuda.is_available() is False)")
    return torch.device(name)


def build_model(job: JobConfig, device: torch.device, state: Optional[ParallelState] = None) -> HybridLM:
    """A freshly initialised model; the init is a function of `train.seed` only, whatever the
    parallel layout: each rank's tensor-parallel shards are the slices of the TP = 1 model built
    with the same seed (`parallel.sharding.tensor_parallel_parameter`)."""
    torch.manual_seed(job.train.seed)
    return HybridLM(job.attention, job.model, parallel_state=state).to(device)


def build_optimizer(model: HybridLM, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm gains and attention sinks are not shrunk)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2))


def learning_rate(step: int, train: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine to `min_lr` at `decay_horizon`, constant after."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    decay_steps = max(1, train.decay_horizon - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LossParts:
    total: torch.Tensor  # scalar, carries gradient
    lm: Optional[float]
    retrieval: Optional[float]


def compute_loss(logits: torch.Tensor, batch: Batch, cp_group: Optional[dist.ProcessGroup] = None
                 ) -> LossParts:
    """Cross entropy averaged per row over its masked targets, then over rows.

    Per-row averaging gives a retrieval row (a couple of answer bytes) the weight of an LM row.
    Under context parallelism `logits`/`batch` hold this rank's part of every row: the per-row
    target counts are summed over CP, so the CP ranks' losses add up to the full-sequence loss.
    """
    token_loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
    mask = batch.loss_mask.to(token_loss.dtype)
    sums, counts = (token_loss.view_as(mask) * mask).sum(1), mask.sum(1)
    if cp_group is not None:
        dist.all_reduce(counts, group=cp_group)
    per_row = sums / counts.clamp_min(1)

    def mean_over(rows: torch.Tensor) -> Optional[float]:
        if not bool(rows.any()):
            return None
        value = per_row[rows].detach().mean().clone()
        if cp_group is not None:
            dist.all_reduce(value, group=cp_group)
        return float(value)

    return LossParts(per_row.mean(), mean_over(~batch.is_retrieval), mean_over(batch.is_retrieval))


def autocast(device: torch.device, dtype: str) -> torch.autocast:
    """bf16 runs matmuls in bfloat16 with float32 master weights; fp32 disables autocast."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def train_step(model: HybridLM, optimizer: torch.optim.Optimizer, batch: Batch, step: int,
               train: TrainConfig, device: torch.device,
               packed: Optional[PackedSeqParams] = None) -> StepStats:
    """One optimizer step on `batch`; the indexer KL joins the backward inside the C layers."""
    started = time.perf_counter()
    state = model.parallel_state
    lr = learning_rate(step, train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    local = shard_for_context_parallel(batch, model)
    with autocast(device, train.dtype):
        logits = model(local.inputs, packed)
    # A packed batch is one [1, B·S] sequence: view its logits as the [B, S] rows it was made of.
    parts = compute_loss(logits.reshape(*local.targets.shape, -1), local,
                         state.cp_group if state.cp_size > 1 else None)
    optimizer.zero_grad(set_to_none=True)
    parts.total.backward()
    finalize_grads(model)
    grad_norm = clip_grad_norm(model, train.grad_clip or float("inf"))
    # The norm is global (summed over TP, after the CP reduction): every rank stops together.
    if not math.isfinite(float(grad_norm)):
        raise NonFiniteTrainingError(
            f"step {step + 1}: the gradient norm is {float(grad_norm)} (loss {float(parts.total.detach()):.4g} on this rank); "
            f"stopped before the update, so the parameters and the last checkpoint stay finite. Lower train.lr "
            f"({lr:.3g} at this step) or set train.grad_clip, then --resume or --overwrite")
    optimizer.step()
    elapsed = time.perf_counter() - started
    loss = parts.total.detach().clone()
    indexer = model.indexer_losses()
    if state.cp_size > 1:  # each CP rank holds part of every row: the pieces add up
        dist.all_reduce(loss, group=state.cp_group)
        indexer = {k: float(all_reduced(torch.tensor(v, device=device), state.cp_group)) for k, v in indexer.items()}
    return StepStats(step=step, loss=float(loss), lm_loss=parts.lm,
                     retrieval_loss=parts.retrieval, indexer_losses=indexer,
                     grad_norm=float(grad_norm), lr=lr,
                     tokens_per_s=batch.inputs.numel() / elapsed)


class JobStopped(Exception):
    """The job cannot go on for a reason the user can act on; the CLI prints it as one line."""


class NonFiniteTrainingError(JobStopped):
    """A step produced a non-finite loss or gradient; the job stops before applying it."""


def all_reduced(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value


def shard_for_context_parallel(batch: Batch, model: HybridLM) -> Batch:
    """This CP rank's part of every row (the model's partition); the whole batch without CP."""
    state = model.parallel_state
    return context_parallel_batch(batch, state.cp_size, state.cp_rank, model.attention_config.cp_partition)


def context_parallel_batch(batch: Batch, cp_size: int, cp_rank: int, partition: str) -> Batch:
    """CP rank `cp_rank`'s part of every row `[B, S]` → `[B, S/cp]` in `partition` (the batch itself
    for one rank)."""
    if cp_size == 1:
        return batch
    shard = lambda t: shard_sequence(t, cp_size, cp_rank, partition, dim=1)  # noqa: E731
    return Batch(shard(batch.inputs), shard(batch.targets), shard(batch.loss_mask), batch.is_retrieval)


def finalize_grads(model: HybridLM) -> None:
    """Make every rank's gradients the full-batch gradients of its parameters.

    CP: each rank saw part of every sequence, so gradients are summed over CP. SP: norm weights saw
    only this rank's rows, so their gradients are summed over TP (the rest is already complete).
    """
    state = model.parallel_state
    for param in model.parameters():
        if param.grad is None:
            continue
        if state.cp_size > 1:
            dist.all_reduce(param.grad, group=state.cp_group)
        if state.tp_size > 1 and getattr(param, SEQUENCE_PARALLEL_GRAD, False):
            dist.all_reduce(param.grad, group=state.tp_group)


def clip_grad_norm(model: HybridLM, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole (unsharded) gradient: TP-split parameters contribute their
    squares summed over TP, replicated ones once."""
    state = model.parallel_state
    grads = [(p.grad, partition_dim(p) is not None) for p in model.parameters()
             if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0][0].device
    split = sum((g.float().pow(2).sum() for g, is_split in grads if is_split), torch.zeros((), device=device))
    whole = sum((g.float().pow(2).sum() for g, is_split in grads if not is_split), torch.zeros((), device=device))
    if state.tp_size > 1:
        dist.all_reduce(split, group=state.tp_group)
    norm = (split + whole).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad, _ in grads:
        grad.mul_(scale)
    return norm


def train_batch(job: JobConfig, text: torch.Tensor, step: int) -> tuple[Batch, Optional[PackedSeqParams]]:
    """The step's batch; with `train.pack` also the documents' boundaries in the packed stream."""
    train = job.train
    generator = seeded_generator(train.seed, "train", step)
    batch = make_batch(text, job.retrieval_task(), train.batch_size, train.retrieval_rows, generator)
    if not train.pack:
        return batch, None
    batch, cu_seqlens = pack_documents(batch, generator)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    packed = PackedSeqParams(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))
    return Batch(batch.inputs.reshape(1, -1), batch.targets, batch.loss_mask, batch.is_retrieval), packed


def answer_hits(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """`(correct, counted)`: how many masked targets the arg-max of `logits [B, S, V]` predicts
    exactly, and how many masked targets there are (for a retrieval batch: the answer bytes)."""
    correct = ((logits.argmax(-1) == batch.targets) & batch.loss_mask).sum()
    return correct, batch.loss_mask.sum()


@torch.no_grad()
def evaluate(model: HybridLM, job: JobConfig, validation_text: torch.Tensor, device: torch.device,
             completed_steps: int) -> EvalStats:
    """Validation LM loss and retrieval answer accuracy on fixed (seed-derived) batches."""
    train, task = job.train, job.retrieval_task()
    state = model.parallel_state
    cp_group = state.cp_group if state.cp_size > 1 else None
    model.eval()
    # Counts stay on the model's device: NCCL groups reduce only CUDA tensors.
    lm_losses, correct, answered = [], torch.zeros((), device=device), torch.zeros((), device=device)
    for index in range(train.eval_batches):
        lm = make_batch(validation_text, task, train.batch_size, 0,
                        seeded_generator(train.seed, "val-lm", index)).to(device)
        lm = shard_for_context_parallel(lm, model)
        with autocast(device, train.dtype):
            loss = compute_loss(model(lm.inputs), lm, cp_group).total.detach()
        lm_losses.append(float(all_reduced(loss, cp_group) if cp_group is not None else loss))
        retrieval = make_batch(validation_text, task, train.batch_size, train.batch_size,
                               seeded_generator(train.seed, "val-retrieval", index)).to(device)
        retrieval = shard_for_context_parallel(retrieval, model)
        with autocast(device, train.dtype):
            hits, asked = answer_hits(model(retrieval.inputs), retrieval)
        correct, answered = correct + hits, answered + asked
    if cp_group is not None:
        correct, answered = all_reduced(correct, cp_group), all_reduced(answered, cp_group)
    model.train()
    return EvalStats(step=completed_steps, val_lm_loss=sum(lm_losses) / len(lm_losses),
                     retrieval_accuracy=float(correct / answered))


# ---------------------------------------------------------------- checkpoints and plots
# Attention fields that describe the parallel layout or the kernels, not the weights: a checkpoint
# resumes under other values of them (e.g. saved with --tp 2 --sp, resumed with --tp 1).
LAYOUT_FIELDS = ("sequence_parallel", "cp_comm_type", "cp_partition", "attention_backend",
                 "attention_backend_overrides")


def job_extra(next_step: int, job: JobConfig, history: History) -> dict[str, Any]:
    """What a checkpoint holds besides the model and optimizer (identical on every rank)."""
    return {"step": next_step, "config": job.to_dict(), "history": history.to_dict(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1}


def resume_from(path: Path, model: HybridLM, optimizer: torch.optim.Optimizer, job: JobConfig,
                state: Optional[ParallelState]) -> tuple[int, History, dict[str, Any]]:
    """Restore model, optimizer (and, at the same world size, RNG) states from the checkpoint
    directory `path`, resharded to this run's layout; returns `(next_step, history, the saved
    train: section)`."""
    extra = load_checkpoint(path, model, optimizer, state)
    for section in ("attention", "model"):
        saved, wanted = dict(extra["config"][section]), job.to_dict()[section]
        if section == "attention":
            saved.update({key: wanted[key] for key in LAYOUT_FIELDS})
        if saved != wanted:
            changed = sorted(key for key in wanted if saved.get(key) != wanted[key])
            raise ValueError(f"checkpoint {path} was trained with a different `{section}:` section "
                             f"(fields {changed})")
    return extra["step"], History.from_dict(extra["history"]), extra["config"]["train"]


def keep_saved_schedule(train: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    """A resumed run follows the saved run's cosine horizon (its `lr_decay_steps`, else its `steps`)
    unless this run sets `lr_decay_steps`: `--steps 720` after a 700-step run adds 20 steps at the
    final learning rate instead of re-stretching the schedule under the trained model."""
    if train.lr_decay_steps is not None:
        return train
    return dataclasses.replace(train, lr_decay_steps=saved["lr_decay_steps"] or saved["steps"])


def write_history(history: History, out_dir: Path) -> None:
    """`history.json`: every step's and evaluation's statistics, replaced atomically."""
    path = out_dir / HISTORY_NAME
    staged = path.with_suffix(".partial")
    staged.write_text(json.dumps(history.to_dict()))
    os.replace(staged, path)


def read_history(out_dir: Path) -> History:
    return History.from_dict(json.loads((Path(out_dir) / HISTORY_NAME).read_text()))


def plot_history(history: History, path: Path) -> None:
    """Training / validation loss per step and retrieval accuracy, as a PNG (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    loss_axis = figure.add_subplot()
    steps = [s.step + 1 for s in history.steps]
    loss_axis.plot(steps, [s.loss for s in history.steps], lw=0.8, alpha=0.6, label="train loss")
    lm_points = [(s.step + 1, s.lm_loss) for s in history.steps if s.lm_loss is not None]
    if lm_points:
        loss_axis.plot(*zip(*lm_points), lw=1.0, label="train LM loss")
    if history.evals:
        loss_axis.plot([e.step for e in history.evals], [e.val_lm_loss for e in history.evals],
                       "o-", label="validation LM loss")
        accuracy_axis = loss_axis.twinx()
        accuracy_axis.plot([e.step for e in history.evals],
                           [e.retrieval_accuracy for e in history.evals], "s--", color="tab:red",
                           label="retrieval accuracy")
        accuracy_axis.set_ylim(0, 1)
        accuracy_axis.set_ylabel("retrieval answer-byte accuracy")
        accuracy_axis.legend(loc="upper center")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("cross entropy (nats / byte)")
    loss_axis.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ---------------------------------------------------------------- reporting
def format_backends(counts: dict[tuple[str, str], int]) -> str:
    """One line per op: which backend ran it and how often (from `call_counts()`)."""
    by_op: dict[str, list[str]] = {}
    for (backend, op), calls in sorted(counts.items()):
        by_op.setdefault(op, []).append(f"{backend} ({calls} calls)")
    return "\n".join(f"  {op:<18} {', '.join(uses)}" for op, uses in by_op.items())


def format_step(stats: StepStats) -> str:
    parts = [f"step {stats.step + 1:5d}", f"loss {stats.loss:.4f}"]
    if stats.lm_loss is not None:
        parts.append(f"lm {stats.lm_loss:.4f}")
    if stats.retrieval_loss is not None:
        parts.append(f"retrieval {stats.retrieval_loss:.4f}")
    parts.append("indexer " + " ".join(f"L{n}={v:.2e}" for n, v in sorted(stats.indexer_losses.items())))
    parts += [f"gnorm {stats.grad_norm:.2f}", f"lr {stats.lr:.2e}", f"{stats.tokens_per_s:,.0f} tok/s"]
    return " | ".join(parts)


def format_eval(stats: EvalStats) -> str:
    return (f"eval @ step {stats.step}: validation LM loss {stats.val_lm_loss:.4f} | "
            f"retrieval accuracy {stats.retrieval_accuracy:.3f} (chance 0.100)")


# ---------------------------------------------------------------- the job
def load_corpus(train: TrainConfig) -> CorpusSplit:
    """`train.corpus` (at most `corpus_max_bytes`) split into train / validation text."""
    try:
        return split_corpus(load_corpus_bytes(train.corpus, train.corpus_max_bytes))
    except CorpusError as error:
        raise JobStopped(str(error)) from error


def describe_retrieval(job: JobConfig) -> str:
    """One line: how far each retrieval answer lies from its value, against the reach of a
    window-only (all `W`) stack of the same depth and window."""
    task, attention = job.retrieval_task(), job.attention
    reach = window_reach(attention.num_layers, attention.csa_window_size)
    verdict = ("beyond it: only C, H or M layers can reach the values" if task.closest_distance > reach
               else "within it: a window-only model could solve the task too")
    return (f"retrieval: {task.num_pairs} key/value pair(s), {task.num_queries} query(ies) per sequence; every "
            f"answer is predicted >= {task.closest_distance} tokens after its value, a window-only stack of "
            f"{attention.num_layers} layers sees {reach} back ({verdict})")


def setup_parallel(tp: int, cp: int, device: torch.device) -> Optional[ParallelState]:
    """Process groups for a torchrun launch (WORLD_SIZE > 1): gloo on CPU, NCCL on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if tp * cp != 1:
            raise ValueError(f"--tp {tp} --cp {cp} needs {tp * cp} processes: launch with "
                             f"torchrun --nproc-per-node {tp * cp} -m megatron_dsa.train ...")
        return None
    if world != tp * cp:
        raise ValueError(f"WORLD_SIZE={world} but --tp {tp} × --cp {cp} = {tp * cp} (no data parallelism "
                         f"in this job)")
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return initialize_parallel_state(tp_size=tp, cp_size=cp)


def run(job: JobConfig, resume: Optional[Path] = None, tp: int = 1, cp: int = 1, overwrite: bool = False,
        progress_bar: bool = True) -> History:
    """Train to `job.train.steps` (continuing from the checkpoint directory `resume` if given);
    returns the full history. `overwrite` first deletes the output directory's checkpoints and
    history; `progress_bar` shows tqdm's bar on a terminal (plain log lines otherwise).

    Under torchrun with `tp`/`cp` > 1 every rank trains its shard; rank 0 prints and plots.
    """
    train = job.train
    device = resolve_device(train.device)
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    state = setup_parallel(tp, cp, device)
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
    optimizer = build_optimizer(model, train)
    start, history = 0, History()
    if resume is not None:
        start, history, saved_train = resume_from(resume, model, optimizer, job, state)
        if start >= train.steps:
            raise JobStopped(f"the checkpoint {resume} is at step {start}: --steps {train.steps} leaves nothing "
                             f"to train (give --steps > {start})")
        train = keep_saved_schedule(train, saved_train)
        job = dataclasses.replace(job, train=train)
    layout = "" if state is None else f" | tp {state.tp_size}{' + sp' if job.attention.sequence_parallel else ''}, cp {state.cp_size} ({job.attention.cp_comm_type})"
    say(f"HybridLM: {sum(p.numel() for p in model.parameters()):,} parameters"
        f"{' on this rank' if state is not None else ''}, pattern "
        f"{job.attention.layer_pattern}, window {job.attention.csa_window_size} | device {device}, "
        f"{train.dtype}{layout} | corpus {corpus.train.numel():,} train / {validation_text.numel():,} "
        f"validation bytes | batch {train.batch_size}x{train.seq_len} "
        f"({train.retrieval_rows} retrieval rows{', packed documents' if train.pack else ''})"
        + (f" | resumed at step {start}" if start else ""))
    say(describe_retrieval(job))
    if not history.evals:
        history.evals.append(evaluate(model, job, validation_text, device, start))
        say(format_eval(history.evals[-1]))

    checkpoints = CheckpointWriter(out_dir, state)
    reset_call_counts()
    began = time.perf_counter()
    progress = tqdm(range(start, train.steps), initial=start, total=train.steps, desc="train",
                    dynamic_ncols=True, disable=not (leader and progress_bar and sys.stderr.isatty()))
    write = tqdm.write if leader else (lambda *args, **kwargs: None)
    for step in progress:
        batch, packed = train_batch(job, corpus.train, step)
        packed = packed if packed is None else dataclasses.replace(
            packed, cu_seqlens_q=packed.cu_seqlens_q.to(device), cu_seqlens_kv=packed.cu_seqlens_kv.to(device))
        stats = train_step(model, optimizer, batch.to(device), step, train, device, packed)
        history.steps.append(stats)
        progress.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{stats.tokens_per_s:,.0f}")
        if step == start:
            write("backend per op (first step):\n" + format_backends(call_counts()))
        completed = step + 1
        if completed % train.log_interval == 0 or step == start:
            write(format_step(stats))
        if completed % train.eval_interval == 0 or completed == train.steps:
            history.evals.append(evaluate(model, job, validation_text, device, completed))
            write(format_eval(history.evals[-1]))
        if completed % train.checkpoint_interval == 0 or completed == train.steps:
            staging = time.perf_counter()
            checkpoints.save(completed, model, optimizer, job_extra(completed, job, history))
            write(f"checkpoint of step {completed}: state staged in {time.perf_counter() - staging:.2f} s, "
                  f"writing in the background")
            if leader:
                write_history(history, out_dir)
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


def parse_args(argv: Optional[Sequence[str]]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m megatron_dsa.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path, help="job YAML (attention/model/train)")
    parser.add_argument("--steps", type=int, help="total optimizer steps (overrides train.steps)")
    parser.add_argument("--out", dest="out_dir", help="output directory (overrides train.out_dir)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (overrides train.device)")
    parser.add_argument("--seed", type=int, help="overrides train.seed")
    parser.add_argument("--dtype", choices=DTYPES, help="fp32, or bf16 autocast (overrides train.dtype)")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="CHECKPOINT",
                        help="continue from the checkpoint directory CHECKPOINT (default: the newest in "
                             "<out>/checkpoints); it loads at any --tp / --cp")
    parser.add_argument("--pack", action="store_true", default=None,
                        help="pack each batch's documents into one THD sequence (overrides train.pack)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (under torchrun)")
    parser.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), help="context-parallel communication")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an output directory that holds a run (deletes its checkpoints)")
    parser.add_argument("--lr-decay-steps", type=int,
                        help="cosine horizon (overrides train.lr_decay_steps; a resumed run keeps the saved one)")
    parser.add_argument("--no-progress", action="store_true",
                        help="plain log lines, no progress bar (the default when stderr is not a terminal)")
    return parser, parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> History:
    parser, args = parse_args(argv)
    try:  # configuration mistakes become a usage message, not a traceback
        job = JobConfig.from_yaml(args.config, steps=args.steps, out_dir=args.out_dir, device=args.device,
                                  seed=args.seed, dtype=args.dtype, pack=args.pack,
                                  lr_decay_steps=args.lr_decay_steps)
        parallel = {"sequence_parallel": args.sp or job.attention.sequence_parallel}
        if args.cp_comm_type:
            parallel["cp_comm_type"] = args.cp_comm_type
        job = dataclasses.replace(job, attention=job.attention.replace(**parallel))
        if job.attention.sequence_parallel and args.tp == 1:
            raise ValueError("--sp needs --tp > 1 (sequence parallelism splits over the TP group)")
        resolve_device(job.train.device)
        if args.out_dir is None:  # the layout names the default directory: layouts never share one
            job = dataclasses.replace(job, train=dataclasses.replace(
                job.train, out_dir=job.train.out_dir + layout_suffix(args.tp, job.attention.sequence_parallel, args.cp)))
        resume = resume_point(args, Path(job.train.out_dir))
    except (ValueError, TypeError, FileNotFoundError, yaml.YAMLError) as error:
        parser.error(str(error))
    try:
        return run(job, resume, tp=args.tp, cp=args.cp, overwrite=args.overwrite, progress_bar=not args.no_progress)
    except JobStopped as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")


def layout_suffix(tp: int, sequence_parallel: bool, cp: int) -> str:
    """`-tp2-sp-cp2` style suffix of a parallel layout ('' for one process)."""
    return (f"-tp{tp}" if tp > 1 else "") + ("-sp" if sequence_parallel else "") + (f"-cp{cp}" if cp > 1 else "")


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


if __name__ == "__main__":
    main()
