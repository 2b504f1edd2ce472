"""Train `HybridLM` on stdlib bytes plus the long-range retrieval task.

    python -m megatron_dsa.train --config configs/tiny.yaml [--steps N] [--out DIR] [--device cuda]
                                 [--resume [CKPT]] [--seed S] [--dtype fp32|bf16]

The YAML file has three sections: `attention:` (`HybridAttentionConfig`), `model:` (`ModelConfig`)
and `train:` (`TrainConfig`); CLI flags override it. The output directory receives
`checkpoint.pt` (model, optimizer, step, RNG states, config, history), `config.yaml` and
`loss_curve.png`. Batches are pure functions of (seed, step), so `--resume` continues exactly:
the resumed run's losses equal those of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.data import (Batch, CorpusSplit, RetrievalTask, load_stdlib_corpus, make_batch,
                               seeded_generator, split_corpus)
from megatron_dsa.model import HybridLM, ModelConfig

CHECKPOINT_NAME = "checkpoint.pt"
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
    retrieval_pairs: int = 8
    corpus_max_bytes: int = 4_000_000
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 4
    checkpoint_interval: int = 100
    out_dir: str = "runs/tiny"
    device: str = "cpu"
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "retrieval_pairs", "corpus_max_bytes",
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
        return RetrievalTask(seq_len=self.train.seq_len, num_pairs=self.train.retrieval_pairs,
                             min_distance=self.attention.csa_window_size)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "JobConfig":
        unknown = sorted(set(values) - {"attention", "model", "train"})
        if unknown:
            raise ValueError(f"unknown config section(s): {unknown}; expected attention, model, train")
        train_values = dict(values.get("train") or {})
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
        values["train"] = {**(values.get("train") or {}), **overrides}
        return cls.from_dict(values)

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
    retrieval_accuracy: float  # answer bytes predicted exactly (chance 0.1)


@dataclass
class History:
    steps: list[StepStats] = field(default_factory=list)
    evals: list[EvalStats] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": [dataclasses.asdict(s) for s in self.steps],
                "evals": [dataclasses.asdict(e) for e in self.evals]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "History":
        return cls(steps=[StepStats(**s) for s in values["steps"]],
                   evals=[EvalStats(**e) for e in values["evals"]])


# ---------------------------------------------------------------- building blocks
def resolve_device(name: str) -> torch.device:
    """`cpu` or a CUDA device; a CUDA request on a machine without CUDA is a clear error."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} requested but CUDA is not available on this machine "
                         f"(torch {torch.__version__}, torch.cuda.is_available() is False)")
    return torch.device(name)


def build_model(job: JobConfig, device: torch.device) -> HybridLM:
    """A freshly initialised model; the init is a function of `train.seed` only."""
    torch.manual_seed(job.train.seed)
    return HybridLM(job.attention, job.model).to(device)


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


def compute_loss(logits: torch.Tensor, batch: Batch) -> LossParts:
    """Cross entropy averaged per row over its masked targets, then over rows.

    Per-row averaging gives a retrieval row (a couple of answer bytes) the weight of an LM row.
    """
    token_loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
    mask = batch.loss_mask.to(token_loss.dtype)
    per_row = (token_loss.view_as(mask) * mask).sum(1) / mask.sum(1)

    def mean_over(rows: torch.Tensor) -> Optional[float]:
        return float(per_row[rows].detach().mean()) if bool(rows.any()) else None

    return LossParts(per_row.mean(), mean_over(~batch.is_retrieval), mean_over(batch.is_retrieval))


def autocast(device: torch.device, dtype: str) -> torch.autocast:
    """bf16 runs matmuls in bfloat16 with float32 master weights; fp32 disables autocast."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def train_step(model: HybridLM, optimizer: torch.optim.Optimizer, batch: Batch, step: int,
               train: TrainConfig, device: torch.device) -> StepStats:
    """One optimizer step on `batch`; the indexer KL joins the backward inside the C layers."""
    started = time.perf_counter()
    lr = learning_rate(step, train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    with autocast(device, train.dtype):
        logits = model(batch.inputs)
    parts = compute_loss(logits, batch)
    optimizer.zero_grad(set_to_none=True)
    parts.total.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip or float("inf"))
    optimizer.step()
    elapsed = time.perf_counter() - started
    return StepStats(step=step, loss=float(parts.total.detach()), lm_loss=parts.lm,
                     retrieval_loss=parts.retrieval, indexer_losses=model.indexer_losses(),
                     grad_norm=float(grad_norm), lr=lr, tokens_per_s=batch.inputs.numel() / elapsed)


def train_batch(job: JobConfig, text: torch.Tensor, step: int) -> Batch:
    train = job.train
    return make_batch(text, job.retrieval_task(), train.batch_size, train.retrieval_rows,
                      seeded_generator(train.seed, "train", step))


@torch.no_grad()
def evaluate(model: HybridLM, job: JobConfig, validation_text: torch.Tensor, device: torch.device,
             completed_steps: int) -> EvalStats:
    """Validation LM loss and retrieval answer accuracy on fixed (seed-derived) batches."""
    train, task = job.train, job.retrieval_task()
    model.eval()
    lm_losses, correct, answered = [], 0, 0
    for index in range(train.eval_batches):
        lm = make_batch(validation_text, task, train.batch_size, 0,
                        seeded_generator(train.seed, "val-lm", index)).to(device)
        with autocast(device, train.dtype):
            lm_losses.append(compute_loss(model(lm.inputs), lm).total.item())
        retrieval = make_batch(validation_text, task, train.batch_size, train.batch_size,
                               seeded_generator(train.seed, "val-retrieval", index)).to(device)
        with autocast(device, train.dtype):
            predicted = model(retrieval.inputs).argmax(-1)
        correct += int((predicted == retrieval.targets)[retrieval.loss_mask].sum())
        answered += int(retrieval.loss_mask.sum())
    model.train()
    return EvalStats(step=completed_steps, val_lm_loss=sum(lm_losses) / len(lm_losses),
                     retrieval_accuracy=correct / answered)


# ---------------------------------------------------------------- checkpoints and plots
def save_checkpoint(path: Path, model: HybridLM, optimizer: torch.optim.Optimizer, next_step: int,
                    job: JobConfig, history: History) -> None:
    """Everything needed to continue bit-exactly; written atomically (no torn file on interrupt)."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": next_step,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "config": job.to_dict(),
        "history": history.to_dict(),
    }
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(path: Path, model: HybridLM, optimizer: torch.optim.Optimizer,
                    job: JobConfig) -> tuple[int, History]:
    """Restore model, optimizer and RNG states from `path`; returns `(next_step, history)`."""
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = state["config"]
    for section in ("attention", "model"):
        if saved[section] != job.to_dict()[section]:
            raise ValueError(f"checkpoint {path} was trained with a different `{section}:` section")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"], History.from_dict(state["history"])


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
    return split_corpus(load_stdlib_corpus(train.corpus_max_bytes))


def run(job: JobConfig, resume: Optional[Path] = None) -> History:
    """Train to `job.train.steps` (continuing from `resume` if given); returns the full history."""
    train = job.train
    device = resolve_device(train.device)
    out_dir = Path(train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
    corpus = load_corpus(train)
    validation_text = corpus.validation

    model = build_model(job, device)
    optimizer = build_optimizer(model, train)
    start, history = (load_checkpoint(resume, model, optimizer, job) if resume is not None
                      else (0, History()))
    print(f"HybridLM: {sum(p.numel() for p in model.parameters()):,} parameters, pattern "
          f"{job.attention.layer_pattern}, window {job.attention.csa_window_size} | device {device}, "
          f"{train.dtype} | corpus {corpus.train.numel():,} train / {validation_text.numel():,} "
          f"validation bytes | batch {train.batch_size}x{train.seq_len} "
          f"({train.retrieval_rows} retrieval rows)" + (f" | resumed at step {start}" if start else ""))
    if not history.evals:
        history.evals.append(evaluate(model, job, validation_text, device, start))
        print(format_eval(history.evals[-1]))

    reset_call_counts()
    began = time.perf_counter()
    progress = tqdm(range(start, train.steps), initial=start, total=train.steps, desc="train",
                    dynamic_ncols=True)
    for step in progress:
        stats = train_step(model, optimizer, train_batch(job, corpus.train, step).to(device), step,
                           train, device)
        history.steps.append(stats)
        progress.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{stats.tokens_per_s:,.0f}")
        if step == start:
            tqdm.write("backend per op (first step):\n" + format_backends(call_counts()))
        completed = step + 1
        if completed % train.log_interval == 0 or step == start:
            tqdm.write(format_step(stats))
        if completed % train.eval_interval == 0 or completed == train.steps:
            history.evals.append(evaluate(model, job, validation_text, device, completed))
            tqdm.write(format_eval(history.evals[-1]))
        if completed % train.checkpoint_interval == 0 or completed == train.steps:
            save_checkpoint(out_dir / CHECKPOINT_NAME, model, optimizer, completed, job, history)
    progress.close()

    plot_history(history, out_dir / PLOT_NAME)
    print(f"done: {train.steps} steps ({len(history.steps) - start} this run) in {time.perf_counter() - began:.1f} s | "
          f"checkpoint {out_dir / CHECKPOINT_NAME} | plot {out_dir / PLOT_NAME}")
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
                        help=f"continue from CHECKPOINT (default: <out>/{CHECKPOINT_NAME})")
    return parser, parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> History:
    parser, args = parse_args(argv)
    try:  # configuration mistakes become a usage message, not a traceback
        job = JobConfig.from_yaml(args.config, steps=args.steps, out_dir=args.out_dir,
                                  device=args.device, seed=args.seed, dtype=args.dtype)
        resolve_device(job.train.device)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    resume = None
    if args.resume is not None:
        resume = Path(args.resume) if args.resume else Path(job.train.out_dir) / CHECKPOINT_NAME
    return run(job, resume)


if __name__ == "__main__":
    main()
