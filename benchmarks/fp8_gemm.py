"""Time of a decode step's FP8 projection GEMMs (`fp8_gemm` on weight codes kept by the inference cache) through
the few-rows Triton kernels, cuBLASLt's rowwise-scaled FP8 GEMM (`torch_scaled_mm`) and bf16 `F.linear` (what a
native layer runs), each as CUDA-graph replays (a decode GEMM takes microseconds: timed eagerly, the host's launch
would be measured instead).

The shapes are those of one decode step of a dsv4-flash layer (`--kind`), recorded from the layer itself: every
product its FP8 GEMMs compute, `M × N × K` (the batch's rows, the weight), a grouped projection's G groups in one
call (bf16: the native layer's grouped GEMM). `GB/s` counts the e4m3
weight bytes (the reads a decode GEMM cannot avoid); `Σ` rows add the step's GEMMs. `--splits` adds rows of the
Triton kernel with its K splits fixed. The Triton kernels launch chained, as a decode step launches them. Needs a
CUDA GPU; on a machine without one it says so and exits.

    python benchmarks/fp8_gemm.py                         # C layer, B = 1 and 32
    python benchmarks/fp8_gemm.py --kind H --batches 32 --splits 1 2 4 8
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import cuda_available, graph_median_ms, kernel_parser  # noqa: E402
from megatron_dsa import HybridAttention, HybridAttentionConfig  # noqa: E402
from megatron_dsa.backends import torch_scaled_mm  # noqa: E402
from megatron_dsa.backends.triton_kernels import fp8_gemm  # noqa: E402
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launches  # noqa: E402
from megatron_dsa.layers import projection_gemms  # noqa: E402
from megatron_dsa.layers.decoding import LayerCache  # noqa: E402
from megatron_dsa.ops.fp8_linear import quantize_rows  # noqa: E402
from megatron_dsa.ops.output_projection import grouped_output_projection  # noqa: E402


def step_shapes(kind: str, batch: int) -> Counter:
    """`(M, G, N, K)` → how often one decode step of a dsv4-flash `kind` layer (bf16, FP8 projections) multiplies
    its FP8 GEMMs at that shape (recorded around the dispatcher's `fp8_gemm`; G > 1: a grouped weight's kept
    codes `[G, N, K]` in one call)."""
    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind,
                                               projection_precision="fp8")
    layer = HybridAttention(config, kind=kind).cuda().bfloat16().eval()
    shapes: Counter = Counter()
    dispatch = projection_gemms.dispatch

    def recording(*args, **kwargs):
        gemm = dispatch(*args, **kwargs)

        def recorded(a, b, out_dtype, b_scales=None):
            shapes[(a.shape[0], *(b.shape if b.dim() == 3 else (1, *b.shape)))] += 1
            return gemm(a, b, out_dtype, b_scales)
        return recorded

    cache = LayerCache.for_layer(layer, batch=batch, capacity=16)
    x = torch.randn(1, batch, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    projection_gemms.dispatch = recording
    try:
        with torch.no_grad():
            layer(x, inference_cache=cache)
    finally:
        projection_gemms.dispatch = dispatch
    return shapes


def main() -> int:
    parser = kernel_parser(__doc__, warmup=3)
    parser.add_argument("--kind", default="C", choices=list("WCHM"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--splits", type=int, nargs="+", default=[], help="K splits of the Triton kernel to add")
    parser.add_argument("--calls", type=int, default=20, help="calls per graph replay")
    args = parser.parse_args()
    if not cuda_available("fp8_gemm.py"):
        return 0
    print(f"decode FP8 GEMMs of a dsv4-flash {args.kind} layer, {torch.cuda.get_device_name()}; median of "
          f"{args.repeats} graph replays of {args.calls} calls\n")
    print("| B | M × N × K | per step | bf16 µs | torch_scaled_mm µs | triton µs | triton GB/s |"
          + "".join(f" triton, {s} splits µs |" for s in args.splits))
    print("|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(args.splits))
    for batch in args.batches:
        totals = Counter()
        for (rows, groups, outputs, width), count in sorted(step_shapes(args.kind, batch).items()):
            a = torch.randn(rows, groups * width, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(groups * outputs, width, device="cuda", dtype=torch.bfloat16)
            codes, scales = quantize_rows(weight)
            if groups > 1:
                codes, scales = codes.view(groups, outputs, width), scales.view(groups, outputs, 1)
            runs = {"bf16": ((lambda: grouped_output_projection(a, weight, groups)) if groups > 1
                             else (lambda: F.linear(a, weight))),
                    "cublaslt": lambda: torch_scaled_mm.fp8_gemm(a, codes, torch.bfloat16, scales),
                    "triton": lambda: fp8_gemm.fp8_gemm(a, codes, torch.bfloat16, scales)}
            runs.update({f"split{s}": (lambda s=s: fp8_gemm.fp8_gemm(a, codes, torch.bfloat16, scales, splits=s))
                         for s in args.splits})
            with chained_launches():
                us = {name: graph_median_ms(run, args.repeats, args.warmup, args.calls) * 1e3
                      for name, run in runs.items()}
            for name, value in us.items():
                totals[name] += count * value
            shape = f"{rows} × {outputs} × {width}" + (f" × {groups} groups" if groups > 1 else "")
            print(f"| {batch} | {shape} | {count} | {us['bf16']:.1f} | {us['cublaslt']:.1f} | "
                  f"{us['triton']:.1f} | {codes.numel() / us['triton'] / 1e3:,.0f} |"
                  + "".join(f" {us[f'split{s}']:.1f} |" for s in args.splits), flush=True)
        print(f"| {batch} | Σ | | {totals['bf16']:.1f} | {totals['cublaslt']:.1f} | {totals['triton']:.1f} | |"
              + "".join(f" {totals[f'split{s}']:.1f} |" for s in args.splits), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
