"""Overlay the evaluations of several runs of the main job: retrieval accuracy and validation loss.

    python -m megatron_dsa.compare runs/tiny runs/tiny-window-only --out retrieval.png

Each argument is an output directory of `python -m megatron_dsa.train` (its `history.json` and
`config.yaml`); a run is labelled by its layer pattern unless `--labels` names it. Prints one line
per run (final and best retrieval accuracy, final validation LM loss, mean train loss of the last
30 steps) and writes the PNG. Runs that share a label (the same job at several seeds) are one
arm: a line per arm gives the mean and the range of those numbers, and the plot draws them in one
colour. On the tiny job a single seed says little: the steps at which retrieval and the LM's copying
are learned move by tens of steps from seed to seed, so compare arms over several seeds:

    python -m megatron_dsa.compare runs/bf16-s1 runs/bf16-s2 runs/fp8-s1 runs/fp8-s2 --labels bf16 bf16 fp8 fp8
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import yaml

from megatron_dsa.data import VALUE_ALPHABET
from megatron_dsa.train import HISTORY_NAME, History, read_history

CHANCE_ACCURACY = 1 / len(VALUE_ALPHABET)  # an answer is one digit
LAST_STEPS = 30  # the train loss is a mean over this many last steps (one step's batch is noisy)


@dataclass(frozen=True)
class Run:
    label: str
    history: History


def load_run(run_dir: Path, label: Optional[str] = None) -> Run:
    """The history of `run_dir`, labelled `label` or `<pattern> (<dir name>)`."""
    if not (run_dir / HISTORY_NAME).is_file():
        raise ValueError(f"{run_dir} holds no {HISTORY_NAME}: give output directories of python -m megatron_dsa.train")
    history = read_history(run_dir)
    if not history.evals:
        raise ValueError(f"{run_dir / HISTORY_NAME} has no evaluations to plot")
    if label is None:
        config_path = run_dir / "config.yaml"
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
        pattern = (config.get("attention") or {}).get("layer_pattern")
        label = f"{pattern} ({run_dir.name})" if pattern else run_dir.name
    return Run(label, history)


def final_train_loss(run: Run) -> Optional[float]:
    """Mean train loss of the run's last `LAST_STEPS` steps (None without steps)."""
    steps = run.history.steps[-LAST_STEPS:]
    return statistics.fmean(s.loss for s in steps) if steps else None


def summary(run: Run) -> str:
    evals = run.history.evals
    train_loss = final_train_loss(run)
    return (f"{run.label}: retrieval accuracy {evals[-1].retrieval_accuracy:.3f} at step {evals[-1].step} "
            f"(best {max(e.retrieval_accuracy for e in evals):.3f}, chance {CHANCE_ACCURACY:.3f}) | "
            f"validation LM loss {evals[-1].val_lm_loss:.3f}"
            + ("" if train_loss is None else f" | train loss {train_loss:.3f} (last {LAST_STEPS} steps)"))


def arms(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs grouped by label, in the order the labels first appear."""
    grouped: dict[str, list[Run]] = {}
    for run in runs:
        grouped.setdefault(run.label, []).append(run)
    return grouped


def arm_summary(label: str, runs: Sequence[Run]) -> str:
    """Mean (min–max) over the arm's runs of the numbers `summary` gives for one run."""
    def spread(name: str, values: list[Optional[float]]) -> str:
        if any(v is None for v in values):
            return ""
        return f"{name} {statistics.fmean(values):.3f} ({min(values):.3f}–{max(values):.3f})"

    parts = [spread("retrieval accuracy", [r.history.evals[-1].retrieval_accuracy for r in runs]),
             spread("validation LM loss", [r.history.evals[-1].val_lm_loss for r in runs]),
             spread(f"train loss (last {LAST_STEPS} steps)", [final_train_loss(r) for r in runs])]
    return f"{label} ({len(runs)} runs, mean (min–max)): " + " | ".join(p for p in parts if p)


def plot_runs(runs: Sequence[Run], path: Path) -> None:
    """Two panels over the evaluation steps: retrieval accuracy (chance dashed) and validation loss."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    FigureCanvasAgg(figure)
    accuracy_axis, loss_axis = figure.subplots(1, 2)
    for index, (label, members) in enumerate(arms(runs).items()):
        for number, run in enumerate(members):  # an arm's runs: one colour, one legend entry
            steps = [e.step for e in run.history.evals]
            style = {"color": f"C{index}", "ms": 3, "label": label if number == 0 else None}
            accuracy_axis.plot(steps, [e.retrieval_accuracy for e in run.history.evals], "o-", **style)
            loss_axis.plot(steps, [e.val_lm_loss for e in run.history.evals], "o-", **style)
    accuracy_axis.axhline(CHANCE_ACCURACY, color="grey", ls="--", lw=1, label="chance")
    accuracy_axis.set(xlabel="step", ylabel="answer accuracy", ylim=(0, 1.02),
                      title="retrieval beyond the sliding window")
    loss_axis.set(xlabel="step", ylabel="cross entropy (nats / byte)", title="validation LM loss")
    for axis in (accuracy_axis, loss_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_dsa.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="output directories of the main job")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the layer pattern)")
    parser.add_argument("--out", type=Path, default=Path("comparison.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels gives {len(args.labels)} label(s) for {len(args.runs)} run(s)")
    try:
        runs = [load_run(run_dir, label) for run_dir, label in zip(args.runs, args.labels or [None] * len(args.runs))]
    except ValueError as error:
        parser.error(str(error))
    for run in runs:
        print(summary(run))
    for label, members in arms(runs).items():
        if len(members) > 1:
            print(arm_summary(label, members))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(runs, args.out)
    print(f"plot {args.out}")


if __name__ == "__main__":
    main()
