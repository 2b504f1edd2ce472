"""Timing and command-line options shared by the kernel benchmarks (GPU only)."""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kernel_parser(doc: str, warmup: int = 2, warmup_note: str = "includes compilation",
                  dtype_help: str = "input dtype") -> argparse.ArgumentParser:
    """A parser with the options every kernel benchmark takes (`--dtype`, `--repeats`, `--warmup`);
    the script adds its own shape options. `doc`: the script's docstring (its first paragraph is the
    description)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help=dtype_help)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed calls first ({warmup_note})")
    return parser


def add_decode_shape_options(parser: argparse.ArgumentParser) -> None:
    """`--batches` and `--entries`: a decode step's sequences and the compressed entries each has cached (by default
    B = 1 and 32 at 32768 entries, a 128k context at ratio 4)."""
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--entries", type=int, nargs="+", default=[32768], help="cached compressed keys per sequence")


def cuda_available(script: str) -> bool:
    """Whether a CUDA GPU is here; if not, says that `script` has nothing to measure."""
    if not torch.cuda.is_available():
        print(f"benchmarks/{script}: needs a CUDA GPU; nothing to measure here")
    return torch.cuda.is_available()


def device_name(name: str) -> str:
    """`--device`'s argparse type: a CUDA device on a machine without CUDA is a usage error, not a CUDA
    assertion from deep inside the run."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name}: CUDA is not available on this machine")
    return name


def median_ms(fn: Callable[[], object], repeats: int, warmup: int, back_to_back: int = 1) -> float:
    """Median of `repeats` CUDA-event timings after `warmup` untimed calls (the first Triton call of a
    shape compiles and autotunes, so it belongs to the warm-up). Each timing covers `back_to_back` calls
    issued without a sync, divided by their number: with more than one, the host's work for a call
    overlaps the previous call's kernels, so a kernel is timed rather than the latency of one call from
    an idle GPU (which adds the host's launch time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return statistics.median(times)


def graph_median_ms(fn: Callable[[], object], repeats: int, warmup: int, calls: int = 10) -> float:
    """Median per-call time of `calls` calls of `fn` captured as one CUDA graph and replayed `repeats` times,
    after `warmup` eager calls (compilation) and one untimed replay: the kernels' GPU time with no host time
    between them, for calls too short to time eagerly (the host's launch work would be measured instead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def forward_backward_ms(forward: Callable[[], object], forward_backward: Callable[[], object], repeats: int,
                        warmup: int) -> tuple[float, float]:
    """(forward ms, backward ms) medians; backward alone = forward + backward − forward."""
    fwd = median_ms(forward, repeats, warmup)
    return fwd, max(median_ms(forward_backward, repeats, warmup) - fwd, 0.0)
