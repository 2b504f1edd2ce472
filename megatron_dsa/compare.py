"""Overlay the evaluations of several runs of the main job: retrieval accuracy and validation loss.

    python -m megatron_dsa.compare runs/tiny runs/tiny-window-only --out retrieval.png

Each argument is an output directory of `python -m megatron_dsa.train` (its `history.json` and
`config.yaml`); a run is labelled by its layer pattern unless `--labels` names it. Prints one line
per run (final and best retrieval accuracy, final validation LM loss) and writes the PNG.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import yaml

from megatron_dsa.data import VALUE_ALPHABET
from megatron_dsa.train import HISTORY_NAME, History, read_history

CHANCE_ACCURACY = 1 / len(VALUE_ALPHABET)  # an answer is one digit


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


def summary(run: Run) -> str:
    evals = run.history.evals
    return (f"{run.label}: retrieval accuracy {evals[-1].retrieval_accuracy:.3f} at step {evals[-1].step} "
            f"(best {max(e.retrieval_accuracy for e in evals):.3f}, chance {CHANCE_ACCURACY:.3f}) | "
            f"validation LM loss {evals[-1].val_lm_loss:.3f}")


def plot_runs(runs: Sequence[Run], path: Path) -> None:
    """Two panels over the evaluation steps: retrieval accuracy (chance dashed) and validation loss."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    FigureCanvasAgg(figure)
    accuracy_axis, loss_axis = figure.subplots(1, 2)
    for run in runs:
        steps = [e.step for e in run.history.evals]
        accuracy_axis.plot(steps, [e.retrieval_accuracy for e in run.history.evals], "o-", ms=3, label=run.label)
        loss_axis.plot(steps, [e.val_lm_loss for e in run.history.evals], "o-", ms=3, label=run.label)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(runs, args.out)
    print(f"plot {args.out}")


if __name__ == "__main__":
    main()
