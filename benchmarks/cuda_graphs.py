"""Training-step time of one layer three ways, taking turns in one run: eager, `make_graphed_layers` (the
public API: two graph replays, the input and output gradient copied in, the parameter gradients handed
over to `.grad`), and the whole step captured as one CUDA graph whose gradients stay in graph memory
(the GPU work alone, a lower bound no training step reaches).

Each sample reports the median of `--repeats` steps timed from an idle GPU (a sync before each: the
host's time to issue the first kernels counts) and the mean of `--back-to-back` steps issued without a
sync (as a training loop issues them). Run from the repository root: `python benchmarks/cuda_graphs.py`.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_dsa import HybridAttention, HybridAttentionConfig, make_graphed_layers  # noqa: E402
from megatron_dsa.config import PRESETS  # noqa: E402
from megatron_dsa.layers.cuda_graphs import capture_graph  # noqa: E402
from layer import train_step  # noqa: E402
from timing import DTYPES, cuda_available, kernel_parser  # noqa: E402

Step = Callable[[], None]


def one_graph_step(layer: HybridAttention, x: Tensor, grad_out: Tensor) -> Step:
    """Forward + backward (`autograd.grad`, no `.grad`) as one graph, warmed up on a side stream."""
    params = list(layer.parameters())

    def step() -> None:
        out, _ = layer(x)
        torch.autograd.grad(out, [x, *params], grad_out, allow_unused=True)

    graph, _ = capture_graph(step, warmup=3)
    return graph.replay


def wall_ms(step: Step, steps: int) -> float:
    """Wall time per step of `steps` steps issued in a row, from an idle GPU to the last kernel's end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = kernel_parser(__doc__, warmup=2)
    parser.add_argument("--preset", default="dsv4-flash", choices=sorted(PRESETS))
    parser.add_argument("--kind", default="C", choices=list("WCHM"))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=4, help="rounds in which the three steps take turns")
    parser.add_argument("--back-to-back", type=int, default=8, help="steps per back-to-back timing")
    parser.set_defaults(repeats=15)
    args = parser.parse_args(argv)
    if min(args.seq_len, args.samples, args.back_to_back, args.repeats) < 1 or args.warmup < 0:
        parser.error("--seq-len, --samples, --back-to-back and --repeats must be >= 1 and --warmup >= 0")
    if not cuda_available("cuda_graphs.py"):
        return 0
    config = HybridAttentionConfig.from_preset(args.preset)
    layer = HybridAttention(config, kind=args.kind).cuda().to(DTYPES[args.dtype]).train()
    x = torch.randn(args.seq_len, 1, config.hidden_size, device="cuda", dtype=DTYPES[args.dtype],
                    requires_grad=True)
    grad_out = torch.randn_like(x)
    eager = partial(train_step, [layer], x, grad_out)
    for _ in range(3):  # lazy initialisation and kernel compilation before any capture
        eager()
    graphed = make_graphed_layers([layer], [x])[0]
    steps = {"eager": eager, "`make_graphed_layers`": partial(train_step, [graphed], x, grad_out),
             "one graph, gradients left in graph memory": one_graph_step(layer, x, grad_out)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(args.samples):
        for name, step in steps.items():
            for _ in range(args.warmup):
                step()
            idle = statistics.median(wall_ms(step, 1) for _ in range(args.repeats))
            results[name].append((idle, wall_ms(step, args.back_to_back)))
    print(f"{args.kind} layer training step, preset {args.preset}, S={args.seq_len}, B=1, {args.dtype}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.samples} samples each, taking turns\n")
    print("| step | from idle ms (median of each sample) | back to back ms (mean of each sample) |")
    print("|------|------:|------:|")
    for name, samples in results.items():
        print(f"| {name} | {', '.join(f'{idle:.2f}' for idle, _ in samples)} | "
              f"{', '.join(f'{b2b:.2f}' for _, b2b in samples)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
