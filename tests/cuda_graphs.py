"""Capturing a training step as one CUDA graph, the way the PyTorch CUDA-graph docs describe."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

Result = TypeVar("Result")


def capture(step: Callable[[], Result], warmup: int = 3,
            before_capture: Callable[[], None] = lambda: None) -> tuple[torch.cuda.CUDAGraph, Result]:
    """Warm `step` up on a side stream (lazy initialisation, autotuning, vendor plans), then capture one
    call: returns the graph and the captured call's result (static tensors the replays overwrite).
    `before_capture` runs between the two (e.g. to reset call counters)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result
