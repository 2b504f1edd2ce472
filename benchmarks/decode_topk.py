"""Time of a decode step's top-k (`topk` family, `ordered=False` with the entry counts, no mask: one row of
indexer scores per sequence, top-k of its valid prefix) on each backend that runs here: Triton's radix select in
each of its launch shapes (`topk_order.PROGRAMS_PER_SM`: programs per multiprocessor over all rows, each row split
into that many chunks), cuDNN's top-k (with the cuDNN frontend installed) and the unfused stable sort. Graph
replays of `--calls` calls (`timing.graph_median_ms`), so the host's launch work is not timed; int32 counts, as the
decode step makes them (cuDNN's top-k takes them without a cast). dsv4-flash's decode shape by default (top-512 of
32768 entries: a 128k context at ratio 4), every row's prefix full. Needs a CUDA GPU; on a machine without one it
says so and exits.

    python benchmarks/decode_topk.py                        # B = 1, 32
    python benchmarks/decode_topk.py --batches 32 --entries 8192 32768 --programs-per-sm 1 2 4
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, add_decode_shape_options, cuda_available, graph_median_ms, kernel_parser  # noqa: E402
from megatron_dsa.backends import BackendUnavailableError, OpFamily, dispatch  # noqa: E402
from megatron_dsa.backends.triton_kernels import topk_order  # noqa: E402


def main() -> int:
    parser = kernel_parser(__doc__, warmup=3, dtype_help="the scores' dtype (a decode step's are float32)")
    parser.set_defaults(dtype="float32")
    add_decode_shape_options(parser)
    parser.add_argument("--calls", type=int, default=10, help="calls captured in each timed graph")
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if not cuda_available("decode_topk.py"):
        return 0
    print(f"decode top-k (unordered, counts), {torch.cuda.get_device_name()}, top-{args.topk}; median of "
          f"{args.repeats} graph replays of {args.calls} calls\n")
    print("| B | C | backend | µs |")
    print("|---:|---:|---|---:|")
    default = topk_order.PROGRAMS_PER_SM
    for batch, entries in itertools.product(args.batches, args.entries):
        g = torch.Generator(device="cuda").manual_seed(0)
        scores = torch.randn(batch, entries, device="cuda", generator=g).to(DTYPES[args.dtype])
        counts = torch.full((batch,), entries, dtype=torch.int32, device="cuda")
        variants = [(f"triton, {n}/SM", "triton", n) for n in args.programs_per_sm]
        variants += [("cudnn", "cudnn", None), ("unfused", "unfused", None)]
        for name, backend, programs in variants:
            try:
                pick = dispatch(OpFamily.TOPK, backend, device=scores.device, dtype=scores.dtype, topk=args.topk,
                                columns=entries, rows=batch)
            except BackendUnavailableError:
                print(f"| {batch} | {entries} | {name} | not available |")
                continue
            if programs is not None:
                topk_order.PROGRAMS_PER_SM = programs
            ms = graph_median_ms(lambda: pick(scores, None, args.topk, counts=counts, ordered=False), args.repeats,
                                 args.warmup, args.calls)
            print(f"| {batch} | {entries} | {name} | {ms * 1e3:.1f} |")
            topk_order.PROGRAMS_PER_SM = default
    return 0


if __name__ == "__main__":
    sys.exit(main())
