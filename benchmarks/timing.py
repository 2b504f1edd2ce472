"""Timing shared by the kernel benchmarks (GPU only)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median of `repeats` CUDA-event timings after `warmup` untimed calls (the first Triton call of a
    shape compiles and autotunes, so it belongs to the warm-up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def forward_backward_ms(forward: Callable[[], object], forward_backward: Callable[[], object], repeats: int,
                        warmup: int) -> tuple[float, float]:
    """(forward ms, backward ms) medians; backward alone = forward + backward − forward."""
    fwd = median_ms(forward, repeats, warmup)
    return fwd, max(median_ms(forward_backward, repeats, warmup) - fwd, 0.0)
