"""The job's configuration: `JobConfig` (the YAML file's attention:, model: and train: sections)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_dsa.config import HybridAttentionConfig, check_field_types
from megatron_dsa.data import BUILTIN, KEY_ALPHABET, PAIR_BYTES, RetrievalTask
from megatron_dsa.data_parallel import DATA_PARALLEL_MODES
from megatron_dsa.model import ModelConfig

DTYPES = ("fp32", "bf16")


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
    retrieval_queries: int = 4  # keys asked, spaced evenly after the pairs, one answer byte each
    retrieval_pair_bytes: int = 4  # bytes per pair: 'k=v;' then copies of the value (>= 4)
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
                     "retrieval_pair_bytes",
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
        if self.retrieval_pairs > len(KEY_ALPHABET):
            raise ValueError(f"train.retrieval_pairs ({self.retrieval_pairs}) must be <= {len(KEY_ALPHABET)} (each "
                             f"pair has a different one-letter key)")
        if self.retrieval_pair_bytes < PAIR_BYTES:
            raise ValueError(f"train.retrieval_pair_bytes must be >= {PAIR_BYTES} (a pair 'k=v;'), got "
                             f"{self.retrieval_pair_bytes}")
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
        """Every answer lies beyond one sliding window of any earlier copy of its value;
        `describe_retrieval` says whether it also lies beyond the reach of a window-only stack of this
        depth (it does for tiny.yaml)."""
        return RetrievalTask(seq_len=self.train.seq_len, num_pairs=self.train.retrieval_pairs,
                             num_queries=self.train.retrieval_queries, min_distance=self.attention.csa_window_size,
                             pair_bytes=self.train.retrieval_pair_bytes)

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
