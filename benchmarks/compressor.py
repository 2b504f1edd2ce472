"""Forward and backward time of the Triton gated pooling of the compressor against the unfused reference op.

Inputs have the dsv4 compressor dims: ratio 4 (overlapping, coff 2) and ratio 128 at Dc = 512 (main
compressors), ratio 4 at Dc = 128 (the indexer's), one sequence of T tokens, kv and gate in `--dtype`,
ape in float32 as the layer keeps it. GB/s counts the bytes the pooling must move at least: forward
reads kv and gate once and writes the entries; backward also reads the upstream gradient and writes
dkv and dgate once.

Run from the repository root: `python benchmarks/compressor.py --help`. Needs CUDA; exits cleanly without.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, cuda_available, forward_backward_ms, kernel_parser  # noqa: E402
from megatron_dsa.backends.triton_kernels.compressor import gated_pool as triton_pool  # noqa: E402
from megatron_dsa.ops.compressor import channel_factor, gated_pool as unfused_pool  # noqa: E402
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout  # noqa: E402



def make_inputs(tokens: int, ratio: int, dc: int, dtype: torch.dtype):
    width = channel_factor(ratio) * dc
    kv = torch.randn(tokens, width, device="cuda", dtype=dtype, requires_grad=True)
    gate = torch.randn(tokens, width, device="cuda", dtype=dtype, requires_grad=True)
    ape = (0.02 * torch.randn(ratio, width, device="cuda")).requires_grad_()
    layout = TokenLayout.uniform(1, tokens, torch.device("cuda")).compressed(ratio)
    return kv, gate, ape, layout


def time_op(fn, inputs, repeats: int, warmup: int) -> tuple[float, float]:
    """(forward ms, backward ms) medians; backward alone = forward + backward − forward."""
    kv, gate, ape, layout = inputs
    grad = torch.randn(layout.capacity, kv.shape[1] // channel_factor(layout.ratio), device="cuda", dtype=kv.dtype)

    def forward() -> None:
        with torch.no_grad():
            fn(kv, gate, ape, layout)

    def forward_backward() -> None:
        torch.autograd.grad(fn(kv, gate, ape, layout), (kv, gate, ape), grad)

    return forward_backward_ms(forward, forward_backward, repeats, warmup)


def min_bytes(kv: torch.Tensor, layout: CompressedLayout) -> tuple[int, int]:
    """(forward, backward) bytes: kv and gate read once, entries written; backward adds the upstream
    gradient read and dkv, dgate written."""
    inputs = 2 * kv.numel() * kv.element_size()
    entries = layout.capacity * (kv.shape[1] // channel_factor(layout.ratio)) * kv.element_size()
    return inputs + entries, 2 * inputs + entries


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = kernel_parser(__doc__)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--shapes", nargs="+", default=["4:512", "128:512", "4:128"],
                        help="ratio:Dc pairs")
    args = parser.parse_args(argv)
    try:
        args.shapes = [tuple(int(part) for part in shape.split(":")) for shape in args.shapes]
    except ValueError:
        parser.error("--shapes takes ratio:Dc pairs of integers, e.g. 4:512")
    if any(len(shape) != 2 or shape[0] < 2 or shape[1] < 1 for shape in args.shapes):
        parser.error("--shapes takes ratio:Dc pairs with ratio >= 2 and Dc >= 1")
    if min(args.seq_lens) < max(ratio for ratio, _ in args.shapes) or args.repeats < 1 or args.warmup < 0:
        parser.error("--seq-lens must be >= every ratio, --repeats >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not cuda_available("compressor.py"):
        return 0
    torch.manual_seed(0)
    print(f"compressor gated pooling, {args.dtype}, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"median of {args.repeats} after {args.warmup} warm-up\n"
          f"ratio = triton / unfused (< 1: triton is faster); GB/s = minimal bytes moved / time\n")
    print("| r | Dc | T | pass | triton ms | unfused ms | ratio | triton GB/s | unfused GB/s |")
    print("|--:|---:|--:|------|----------:|-----------:|------:|------------:|-------------:|")
    for ratio, dc in args.shapes:
        for tokens in args.seq_lens:
            inputs = make_inputs(tokens, ratio, dc, DTYPES[args.dtype])
            fast = time_op(triton_pool, inputs, args.repeats, args.warmup)
            slow = time_op(unfused_pool, inputs, args.repeats, args.warmup)
            for name, t_ms, u_ms, size in zip(("fwd", "bwd"), fast, slow, min_bytes(inputs[0], inputs[3])):
                rates = [size / (ms * 1e6) if ms > 0 else float("nan") for ms in (t_ms, u_ms)]
                print(f"| {ratio} | {dc} | {tokens} | {name} | {t_ms:.3f} | {u_ms:.3f} | {t_ms / u_ms:.2f} | "
                      f"{rates[0]:.0f} | {rates[1]:.0f} |")
            del inputs
    return 0


if __name__ == "__main__":
    sys.exit(main())
