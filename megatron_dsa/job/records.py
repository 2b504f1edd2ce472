"""What a job records: every step's and evaluation's statistics, and `history.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

HISTORY_NAME = "history.json"


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


def write_history(history: History, out_dir: Path) -> None:
    """`history.json`: every step's and evaluation's statistics, replaced atomically."""
    path = out_dir / HISTORY_NAME
    staged = path.with_suffix(".partial")
    staged.write_text(json.dumps(history.to_dict()))
    os.replace(staged, path)


def read_history(out_dir: Path) -> History:
    return History.from_dict(json.loads((Path(out_dir) / HISTORY_NAME).read_text()))
