"""Train `HybridLM` on the built-in corpus (bytes) plus the long-range retrieval task.

    megatron-dsa train --preset tiny [--steps N] [--out DIR] [--device cuda] [--resume [CKPT]]
    megatron-dsa train --config my_job.yaml [--seed S] [--dtype fp32|bf16] ...

`python -m megatron_dsa.train` is the same command. `--preset NAME` reads a packaged job config
(the list is in `--help`); a `--config` path that does not exist but names a packaged config
(`configs/tiny.yaml`, `tiny.yaml`) reads the packaged copy, so both work from any directory.
The YAML file has three sections: `attention:` (`HybridAttentionConfig`), `model:` (`ModelConfig`)
and `train:` (`TrainConfig`); CLI flags override it. The output directory receives
`checkpoints/step-N/` (sharded model and optimizer, step, config, history and per-rank RNG states,
written asynchronously and atomically; see `megatron_dsa.checkpointing`), `history.json`,
`config.yaml` and `loss_curve.png`. Batches are pure functions of (seed, step), so `--resume`
continues exactly: the resumed run's losses equal those of an uninterrupted one (at another
--tp / --cp / --dp the checkpoint is resharded and the losses follow to rounding).

Under torchrun the processes form a DP × CP × TP grid (TP fastest): `--tp`, `--cp`, and DP =
WORLD_SIZE / (tp · cp). `train.batch_size` is the global batch; each DP rank runs its rows in
micro-batches of `train.micro_batch_size` (gradient accumulation), replicated or, with `--dp-shard`,
FSDP2-sharded over DP (see `megatron_dsa.data_parallel`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
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
from megatron_dsa.checkpointing import (CHECKPOINTS_DIR, CheckpointError, CheckpointWriter, latest_checkpoint,
                                        load_checkpoint, read_manifest)
from megatron_dsa.config import HybridAttentionConfig, check_field_types
from megatron_dsa.data_parallel import (DATA_PARALLEL_MODES, data_parallel_size, is_sharded, local_grad,
                                        reduce_data_parallel_grads, reshard_after_evaluation,
                                        shard_over_data_parallel)
from megatron_dsa.data import (BUILTIN, KEY_ALPHABET, Batch, CorpusError, CorpusSplit, RetrievalTask,
                               load_corpus_bytes, make_batch, pack_documents, seeded_generator, split_corpus,
                               window_reach)
from megatron_dsa.model import SEQUENCE_PARALLEL_GRAD, HybridLM, ModelConfig
from megatron_dsa.packaged_configs import packaged_configs, preset_config, resolve_config
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel import ParallelState, initialize_parallel_state
from megatron_dsa.parallel.consistency import (MissingRanksError, RankMismatchError, check_same_on_all_ranks,
                                               naming_stalled_ranks, wait_for_all_ranks)
from megatron_dsa.parallel.context import shard_sequence
from megatron_dsa.parallel.sharding import partition_dim

HISTORY_NAME = "history.json"
PLOT_NAME = "loss_curve.png"
DTYPES = ("fp32", "bf16")
DIST_TIMEOUT_S = 600.0  # Megatron-LM's default distributed timeout (10 minutes)
STALL_PROBE_S = 60.0  # after a collective timed out: how long the ranks that answer wait for the others


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
    # Rows one DP rank runs per forward/backward; None = batch_size / DP size (no accumulation).
    # batch_size stays the global batch: accumulation steps = batch_size / (micro_batch_size × DP).
    micro_batch_size: Optional[int] = None
    data_parallel: str = "replicate"  # replicate (all-reduced gradients) or shard (FSDP2 over DP)

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("steps", "batch_size", "seq_len", "retrieval_pairs", "retrieval_queries", "corpus_max_bytes",
                     "log_interval", "eval_interval", "eval_batches", "checkpoint_interval"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("warmup_steps", self.warmup_steps, minimum=0)
        _require_int("seed", self.seed, minimum=0)
        if self.lr_decay_steps is not None:
            _require_int("lr_decay_steps", self.lr_decay_steps, minimum=1)
        if self.micro_batch_size is not None:
            _require_int("micro_batch_size", self.micro_batch_size, minimum=1)
            if self.batch_size % self.micro_batch_size:
                raise ValueError(f"train.micro_batch_size ({self.micro_batch_size}) must divide train.batch_size "
                                 f"({self.batch_size}, the global batch)")
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(f"train.data_parallel must be one of {DATA_PARALLEL_MODES}, got {self.data_parallel!r}")
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

    def accumulation_steps(self, dp_size: int) -> int:
        """Micro-batches per optimizer step on each of `dp_size` DP ranks."""
        micro = self.micro_batch_size
        if micro is None:
            if self.batch_size % dp_size:
                raise ValueError(f"train.batch_size ({self.batch_size}, the global batch) must be divisible by "
                                 f"the DP size {dp_size} (or set train.micro_batch_size)")
            return 1
        if self.batch_size % (micro * dp_size):
            raise ValueError(f"train.batch_size ({self.batch_size}) must be divisible by train.micro_batch_size "
                             f"({micro}) × DP size ({dp_size}) = {micro * dp_size}: the global batch is "
                             f"micro-batch × DP size × accumulation steps")
        return self.batch_size // (micro * dp_size)

    def micro_batch_rows(self, dp_size: int, dp_rank: int) -> list[slice]:
        """The rows of the global batch DP rank `dp_rank` runs, one slice per micro-batch: rank r
        takes the r-th contiguous block of `batch_size / dp_size` rows."""
        accumulation = self.accumulation_steps(dp_size)
        micro = self.batch_size // (dp_size * accumulation)
        first = dp_rank * micro * accumulation
        return [slice(first + i * micro, first + (i + 1) * micro) for i in range(accumulation)]


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
    """`total` (scalar) carries the gradient. `row_losses` `[2]` (detached) sums the per-row losses of
    the LM rows and of the retrieval rows, `row_counts` `[2]` counts those rows: both add up over
    micro-batches and DP ranks (`row_losses` over CP ranks too) to the global batch's."""

    total: torch.Tensor
    row_losses: torch.Tensor
    row_counts: torch.Tensor


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
    kinds = torch.stack((~batch.is_retrieval, batch.is_retrieval)).to(per_row.dtype)  # [2, B]
    return LossParts(per_row.mean(), kinds @ per_row.detach(), kinds.sum(1))


def row_mean(row_losses: torch.Tensor, row_counts: torch.Tensor) -> Optional[float]:
    """Mean per-row loss of a kind of rows (None when the batch has none of them)."""
    return float(row_losses / row_counts) if float(row_counts) > 0 else None


def autocast(device: torch.device, dtype: str) -> torch.autocast:
    """bf16 runs matmuls in bfloat16 with float32 master weights; fp32 disables autocast."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def train_step(model: HybridLM, optimizer: torch.optim.Optimizer, batch: Batch, step: int,
               train: TrainConfig, device: torch.device,
               packed: Optional[PackedSeqParams] = None) -> StepStats:
    """One optimizer step on the global `batch` (the same `[B, S]` rows on every rank; with
    `packed`, its documents' host `cu_seqlens`): this DP rank's rows in micro-batches, gradients
    accumulated and made the global batch's, clipped, applied. The indexer KL joins the backward
    inside the C layers. The statistics are the global batch's, identical on every rank."""
    started = time.perf_counter()
    state = model.parallel_state
    lr = learning_rate(step, train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    micro_batches = train.micro_batch_rows(state.dp_size, state.dp_rank)
    optimizer.zero_grad(set_to_none=True)
    # Summed over micro-batches: the loss, the LM and retrieval rows' losses, then each C layer's KL.
    losses, counts, indexer = torch.zeros(3, device=device, dtype=torch.float64), 0, {}
    for rows in micro_batches:
        part, part_packed = batch_rows(batch, packed, rows, device)
        local = shard_for_context_parallel(part, model)
        with autocast(device, train.dtype):
            logits = model(local.inputs, part_packed)
        # A packed batch is one [1, B·S] sequence: view its logits as the [B, S] rows it was made of.
        parts = compute_loss(logits.reshape(*local.targets.shape, -1), local,
                             state.cp_group if state.cp_size > 1 else None)
        parts.total.backward()
        losses += torch.cat((parts.total.detach().reshape(1), parts.row_losses)).double()
        counts = counts + parts.row_counts.double()
        for layer, value in model.indexer_losses().items():
            indexer[layer] = indexer.get(layer, 0.0) + value
    finalize_grads(model, len(micro_batches))
    grad_norm = clip_grad_norm(model, train.grad_clip or float("inf"))
    # The norm is global (summed over TP, after the CP and DP reductions): every rank stops together.
    if not math.isfinite(float(grad_norm)):
        raise NonFiniteTrainingError(
            f"step {step + 1}: the gradient norm is {float(grad_norm)} (loss {float(losses[0]) / len(micro_batches):.4g} "
            f"on this rank); stopped before the update, so the parameters and the last checkpoint stay finite. Lower "
            f"train.lr ({lr:.3g} at this step) or set train.grad_clip, then --resume or --overwrite")
    optimizer.step()
    elapsed = time.perf_counter() - started
    layers = sorted(indexer)
    sums = torch.cat((losses, torch.tensor([indexer[n] for n in layers], dtype=torch.float64, device=device)))
    if state.cp_size > 1:  # each CP rank holds part of every row: the pieces add up
        dist.all_reduce(sums, group=state.cp_group)
    totals = torch.cat((sums, counts))
    if state.dp_size > 1:
        dist.all_reduce(totals, group=state.dp_group)
    # Every micro-batch of every DP rank has the same number of rows: the global mean is the mean of means.
    summands = state.dp_size * len(micro_batches)
    return StepStats(step=step, loss=float(totals[0]) / summands, lm_loss=row_mean(totals[1], totals[-2]),
                     retrieval_loss=row_mean(totals[2], totals[-1]),
                     indexer_losses={n: float(totals[3 + i]) / summands for i, n in enumerate(layers)},
                     grad_norm=float(grad_norm), lr=lr,
                     tokens_per_s=batch.inputs.numel() / elapsed)


class JobStopped(Exception):
    """The job cannot go on for a reason the user can act on; the CLI prints it as one line."""


class NonFiniteTrainingError(JobStopped):
    """A step produced a non-finite loss or gradient; the job stops before applying it."""


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


def batch_rows(batch: Batch, packed: Optional[PackedSeqParams], rows: slice, device: torch.device
               ) -> tuple[Batch, Optional[PackedSeqParams]]:
    """Rows `rows` of the `[B, S]` batch, on `device`. Of a packed batch (`inputs [1, B·S]`): those
    rows' documents, with `cu_seqlens` rebased to them (documents never cross rows)."""
    count, seq_len = batch.targets.shape
    inputs = batch.inputs.reshape(count, seq_len)[rows]
    part = Batch(inputs if packed is None else inputs.reshape(1, -1), batch.targets[rows], batch.loss_mask[rows],
                 batch.is_retrieval[rows]).to(device)
    if packed is None:
        return part, None
    boundaries = packed.cu_seqlens_q.cpu()
    first, last = rows.start * seq_len, rows.stop * seq_len
    cu_seqlens = boundaries[(boundaries >= first) & (boundaries <= last)] - first
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu_seqlens = cu_seqlens.to(device)
    return part, PackedSeqParams(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)


def finalize_grads(model: HybridLM, accumulation_steps: int = 1) -> None:
    """Make every rank's gradients the global batch's gradients of its parameters (of its DP shard
    of them under FSDP2), from the gradients summed over `accumulation_steps` micro-batches.

    CP: each rank saw part of every sequence, so gradients are summed over CP. SP: norm weights saw
    only this rank's rows, so their gradients are summed over TP (the rest is already complete).
    DP: see `data_parallel.reduce_data_parallel_grads`.
    """
    state = model.parallel_state
    for param in model.parameters():
        grad = local_grad(param)
        if grad is None:
            continue
        if state.cp_size > 1:
            dist.all_reduce(grad, group=state.cp_group)
        if state.tp_size > 1 and getattr(param, SEQUENCE_PARALLEL_GRAD, False):
            dist.all_reduce(grad, group=state.tp_group)
    reduce_data_parallel_grads(model, state, accumulation_steps)


def clip_grad_norm(model: HybridLM, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole (unsharded) gradient: TP-split parameters contribute their
    squares summed over TP, replicated ones once; under FSDP2 every DP shard adds its squares."""
    state = model.parallel_state
    grads = [(local_grad(p), partition_dim(p) is not None) for p in model.parameters()
             if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0][0].device
    dtype = torch.promote_types(grads[0][0].dtype, torch.float32)  # bf16 gradients add up in fp32
    zero = torch.zeros((), device=device, dtype=dtype)
    split = sum((g.to(dtype).pow(2).sum() for g, is_split in grads if is_split), zero)
    whole = sum((g.to(dtype).pow(2).sum() for g, is_split in grads if not is_split), zero)
    if state.tp_size > 1:
        dist.all_reduce(split, group=state.tp_group)
    squares = split + whole
    if is_sharded(model):
        dist.all_reduce(squares, group=state.dp_group)
    norm = squares.sqrt()
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
    """Validation LM loss and retrieval answer accuracy on fixed (seed-derived) batches of
    `batch_size` rows; each DP rank evaluates its rows of every batch, in micro-batches."""
    train, task = job.train, job.retrieval_task()
    state = model.parallel_state
    cp_group = state.cp_group if state.cp_size > 1 else None
    model.eval()
    # Sums of the LM rows' losses, answer bytes right and answer bytes, on the model's device (NCCL
    # groups reduce only CUDA tensors); each CP rank holds part of every row, so all three add up.
    totals = torch.zeros(3, device=device, dtype=torch.float64)
    for index in range(train.eval_batches):
        lm_batch = make_batch(validation_text, task, train.batch_size, 0, seeded_generator(train.seed, "val-lm", index))
        retrieval_batch = make_batch(validation_text, task, train.batch_size, train.batch_size,
                                     seeded_generator(train.seed, "val-retrieval", index))
        for rows in train.micro_batch_rows(state.dp_size, state.dp_rank):
            lm = shard_for_context_parallel(batch_rows(lm_batch, None, rows, device)[0], model)
            with autocast(device, train.dtype):
                totals[0] += compute_loss(model(lm.inputs), lm, cp_group).row_losses[0].double()
            retrieval = shard_for_context_parallel(batch_rows(retrieval_batch, None, rows, device)[0], model)
            with autocast(device, train.dtype):
                hits, asked = answer_hits(model(retrieval.inputs), retrieval)
            totals[1] += hits
            totals[2] += asked
    for group in (cp_group, state.dp_group if state.dp_size > 1 else None):
        if group is not None:
            dist.all_reduce(totals, group=group)
    model.train()
    reshard_after_evaluation(model)
    return EvalStats(step=completed_steps, val_lm_loss=float(totals[0]) / (train.eval_batches * train.batch_size),
                     retrieval_accuracy=float(totals[1] / totals[2]))


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
    saved_config = read_manifest(path)["config"]  # compared before any tensor is read
    for section in ("attention", "model"):
        saved, wanted = dict(saved_config[section]), job.to_dict()[section]
        if section == "attention":
            saved.update({key: wanted[key] for key in LAYOUT_FIELDS})
        if saved != wanted:
            changed = sorted(key for key in wanted if saved.get(key) != wanted[key])
            raise CheckpointError(f"checkpoint {path} was trained with a different `{section}:` section "
                                  f"(fields {changed}); resume it with its own config ({path.parent.parent}/config.yaml)")
    extra = load_checkpoint(path, model, optimizer, state)
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
    width = max(map(len, by_op), default=0)
    return "\n".join(f"  {op:<{width}}  {', '.join(uses)}" for op, uses in by_op.items())


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
    checks = None  # a gloo group for the checks that name ranks
    if state is not None:  # every rank is here and runs the same job, or the error names who is not
        checks = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=dist_timeout_s))
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
        start, history, saved_train = resume_from(resume, model, optimizer, job, state)
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

    checkpoints = CheckpointWriter(out_dir, state)
    reset_call_counts()
    began = time.perf_counter()
    progress = tqdm(range(start, train.steps), initial=start, total=train.steps, desc="train",
                    dynamic_ncols=True, disable=not (leader and progress_bar and sys.stderr.isatty()))
    write = tqdm.write if leader else (lambda *args, **kwargs: None)
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


def parse_args(argv: Optional[Sequence[str]], prog: str = "python -m megatron_dsa.train"
               ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    job = parser.add_mutually_exclusive_group(required=True)
    job.add_argument("--config", type=Path, help="job YAML (attention/model/train), or a packaged one by name")
    job.add_argument("--preset", help=f"a packaged job config: {', '.join(packaged_configs())}")
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
    parser.add_argument("--dp", type=int, help="data-parallel size (default and check: WORLD_SIZE / (tp · cp))")
    parser.add_argument("--dp-shard", action="store_true", default=None,
                        help="shard parameters, gradients and optimizer over DP with FSDP2 (sets "
                             "train.data_parallel: shard; default replicate)")
    parser.add_argument("--micro-batch-size", type=int,
                        help="rows per forward/backward on one DP rank (overrides train.micro_batch_size; "
                             "train.batch_size stays the global batch, the rest is gradient accumulation)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an output directory that holds a run (deletes its checkpoints)")
    parser.add_argument("--lr-decay-steps", type=int,
                        help="cosine horizon (overrides train.lr_decay_steps; a resumed run keeps the saved one)")
    parser.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_S, metavar="SECONDS",
                        help=f"how long a collective waits for a failed or stalled rank before the job ends "
                             f"(default {DIST_TIMEOUT_S:g})")
    parser.add_argument("--no-progress", action="store_true",
                        help="plain log lines, no progress bar (the default when stderr is not a terminal)")
    return parser, parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m megatron_dsa.train") -> History:
    parser, args = parse_args(argv, prog)
    try:  # configuration mistakes become a usage message, not a traceback
        config = preset_config(args.preset) if args.preset else resolve_config(args.config)
        job = JobConfig.from_yaml(config, steps=args.steps, out_dir=args.out_dir, device=args.device,
                                  seed=args.seed, dtype=args.dtype, pack=args.pack,
                                  lr_decay_steps=args.lr_decay_steps, micro_batch_size=args.micro_batch_size,
                                  data_parallel="shard" if args.dp_shard else None)
        parallel = {"sequence_parallel": args.sp or job.attention.sequence_parallel}
        if args.cp_comm_type:
            parallel["cp_comm_type"] = args.cp_comm_type
        job = dataclasses.replace(job, attention=job.attention.replace(**parallel))
        if job.attention.sequence_parallel and args.tp == 1:
            raise ValueError("--sp needs --tp > 1 (sequence parallelism splits over the TP group)")
        resolve_device(job.train.device)
        dp = check_launch(args.tp, args.cp, args.dp) // (args.tp * args.cp)  # a wrong launch is a usage error
        job.train.accumulation_steps(dp)  # the global batch must split into DP ranks' micro-batches
        if args.out_dir is None:  # the layout names the default directory: layouts never share one
            job = dataclasses.replace(job, train=dataclasses.replace(
                job.train, out_dir=job.train.out_dir + layout_suffix(args.tp, job.attention.sequence_parallel, args.cp,
                                                                     dp, job.train.data_parallel == "shard")))
        resume = resume_point(args, Path(job.train.out_dir))
    except (ValueError, TypeError, FileNotFoundError, yaml.YAMLError) as error:
        parser.error(str(error))
    try:
        return run(job, resume, tp=args.tp, cp=args.cp, overwrite=args.overwrite, progress_bar=not args.no_progress,
                   dp=args.dp, dist_timeout_s=args.dist_timeout)
    except (JobStopped, CheckpointError, RankMismatchError, MissingRanksError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")


def layout_suffix(tp: int, sequence_parallel: bool, cp: int, dp: int = 1, dp_shard: bool = False) -> str:
    """`-tp2-sp-cp2-dp2` style suffix of a parallel layout ('' for one process); `-dp2-shard` under FSDP2."""
    return ((f"-tp{tp}" if tp > 1 else "") + ("-sp" if sequence_parallel else "") + (f"-cp{cp}" if cp > 1 else "")
            + (f"-dp{dp}" if dp > 1 else "") + ("-shard" if dp > 1 and dp_shard else ""))


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
