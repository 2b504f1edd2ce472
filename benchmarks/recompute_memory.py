"""Activation memory one `HybridAttention` layer keeps for backward, with and without
`recompute_attention`, and what the recompute costs in step time.

Per kind: the memory still allocated after the forward (minus the output, the weights and the input),
which is what the layer holds for its backward while later layers run, the peak of the whole step over
what was live before it, and the median forward + backward time. Run from the repository root:

    python benchmarks/recompute_memory.py --device cuda --preset dsv4-flash --seq-len 65536 --kinds WCHM
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_dsa import HybridAttention, HybridAttentionConfig, LayerKind  # noqa: E402
from megatron_dsa.config import PRESETS  # noqa: E402

MIB = 1 << 20


def measure(layer: HybridAttention, x: torch.Tensor, grad: torch.Tensor, repeats: int
            ) -> tuple[float, float, float]:
    """`(kept MiB after forward, step peak MiB over the live memory before it, median step ms)`."""
    device = x.device
    times, kept, peak = [], 0.0, 0.0
    for _ in range(repeats + 1):  # the first step warms up (kernels compile, caches fill)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        out, _ = layer(x)
        kept = (torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size()) / MIB
        out.backward(grad)
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
        peak = (torch.cuda.max_memory_allocated(device) - before) / MIB
        x.grad = None
        layer.zero_grad(set_to_none=False)  # keep the grad buffers: they are not activations
    return kept, peak, statistics.median(times[1:])


def run(args: argparse.Namespace) -> str:
    device, dtype = torch.device(args.device), torch.bfloat16
    config = HybridAttentionConfig.from_preset(args.preset)
    rows = ["| kind | S | kept after forward, MiB (plain → recompute) | step peak, MiB | step ms | kept ratio |",
            "|---|---|---|---|---|---|"]
    for kind in args.kinds:
        torch.manual_seed(0)
        plain = HybridAttention(config, kind=kind).to(device, dtype).train()
        recomputing = HybridAttention(config.replace(recompute_attention=True), kind=kind).to(device, dtype).train()
        recomputing.load_state_dict(plain.state_dict())
        x = torch.randn(args.seq_len, 1, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        results = []
        for layer in (plain, recomputing):
            results.append(measure(layer, x, grad, args.repeats))
            layer.cpu()
            torch.cuda.empty_cache()
        (kept, peak, ms), (kept_r, peak_r, ms_r) = results
        rows.append(f"| {kind.value} | {args.seq_len} | {kept:,.0f} → {kept_r:,.0f} | {peak:,.0f} → {peak_r:,.0f} | "
                    f"{ms:.1f} → {ms_r:.1f} | {kept_r / kept:.3f} |")
    return "\n".join(rows)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="dsv4-flash", choices=sorted(PRESETS))
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--kinds", type=lambda v: [LayerKind.parse(k) for k in v], default="WCHM")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layer (median reported)")
    parser.add_argument("--device", default="cuda")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit("recompute_memory.py measures CUDA memory: give --device cuda on a machine with a GPU")
    print(f"{torch.cuda.get_device_name(args.device)}, bf16, {args.preset}, B=1")
    print(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
