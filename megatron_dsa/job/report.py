"""The job's log lines: backends per op, steps, evaluations and what the retrieval task asks."""

from __future__ import annotations

from megatron_dsa.data import window_reach
from megatron_dsa.job.config import JobConfig
from megatron_dsa.job.records import EvalStats, StepStats


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
    if stats.indexer_losses:  # none in a stack without C layers
        parts.append("indexer " + " ".join(f"L{n}={v:.2e}" for n, v in sorted(stats.indexer_losses.items())))
    parts += [f"gnorm {stats.grad_norm:.2f}", f"lr {stats.lr:.2e}", f"{stats.tokens_per_s:,.0f} tok/s"]
    return " | ".join(parts)


def format_eval(stats: EvalStats) -> str:
    return (f"eval @ step {stats.step}: validation LM loss {stats.val_lm_loss:.4f} | "
            f"retrieval accuracy {stats.retrieval_accuracy:.3f} (chance 0.100)")


def describe_retrieval(job: JobConfig) -> str:
    """One line: how far each retrieval answer lies from any earlier copy of its value, against the reach of a
    window-only (all `W`) stack of the same depth and window."""
    task, attention = job.retrieval_task(), job.attention
    reach = window_reach(attention.num_layers, attention.csa_window_size)
    verdict = ("beyond it: only C, H or M layers can reach the values" if task.closest_distance > reach
               else "within it: a window-only model could solve the task too")
    return (f"retrieval: {task.num_pairs} key/value pair(s), {task.num_queries} query(ies) per sequence; every "
            f"answer is predicted >= {task.closest_distance} tokens after any earlier copy of its value, a "
            f"window-only stack of "
            f"{attention.num_layers} layers sees {reach} back ({verdict})")
