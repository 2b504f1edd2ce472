"""The loss curve: `loss_curve.png` of a job's history."""

from __future__ import annotations

from pathlib import Path

from megatron_dsa.job.records import History

PLOT_NAME = "loss_curve.png"


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
