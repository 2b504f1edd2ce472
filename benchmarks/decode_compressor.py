"""Time of a decode step's compressor write (`decode_compressor`: the new token into its pending slot, its group's
entry pooled, normalised, rotated, encoded and stored) through the Triton kernel in its launch variants, against
the unfused reference op, each as CUDA-graph replays (a write is a few microseconds: timed eagerly, the host's
launch would be measured instead).

dsv4-flash's three writes by default: a C layer's entries (ratio 4, Dc 512), its indexer's keys (ratio 4, Dc 128,
Hadamard; `--fp8-store` for an FP8 cache) and an H layer's entries (ratio 128, Dc 512). The variants are the
warps of a program that holds a whole entry (`WARPS`) and, for a split write (ratio above
`MAX_ONE_LAUNCH_RATIO`), the warps and channel pairs of its pooling programs (`POOL_WARPS`, `SPLIT_PAIRS`).
`GB/s` counts the bytes a write must read (the new row, the pooled slot rows, ape) and write (the slot row, the
entry). Needs a CUDA GPU; on a machine without one it says so and exits.

    python benchmarks/decode_compressor.py                    # B = 1, 32; the three writes
    python benchmarks/decode_compressor.py --batches 32 --warps 2 4 8 --pool-warps 1 2 4 --split-pairs 8 16 32
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, cuda_available, graph_median_ms, kernel_parser  # noqa: E402
from megatron_dsa.backends.triton_kernels import decode_compressor  # noqa: E402
from megatron_dsa.ops.compressor import channel_factor  # noqa: E402
from megatron_dsa.ops.decode_compressor import decode_compress as reference_write  # noqa: E402
from megatron_dsa.ops.decode_compressor import pending_slots  # noqa: E402
from megatron_dsa.ops.indexer import FP8_KEYS  # noqa: E402
from megatron_dsa.ops.rope import plain_inv_freq  # noqa: E402

WRITES = {"C": (4, 512, False), "C-indexer": (4, 128, True), "H": (128, 512, False)}  # ratio, Dc, Hadamard


def buffers(batch: int, ratio: int, dc: int, fp8: bool, dtype: torch.dtype, context: int = 131072) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    width, entries = channel_factor(ratio) * dc, context // ratio
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    store, scales = randn(batch, entries, dc).to(dtype), None
    if fp8:
        store, scales = store.to(FP8_KEYS), torch.ones(batch, entries, device="cuda")
    return dict(state=randn(batch, pending_slots(ratio), 2 * width).to(dtype),
                new_rows=randn(batch, 2 * width).to(dtype),
                positions=torch.randint(0, context, (batch,), device="cuda", generator=g), ape=randn(ratio, width),
                norm_weight=randn(dc).to(dtype), eps=1e-6, inv_freq=plain_inv_freq(64, base=10000.0).float().cuda(),
                store=store, scales=scales)


def moved_bytes(inputs: dict, ratio: int) -> int:
    """What a write must move: the new row read and written to its slot, the pooled slots' kv and gate columns
    (ratio 4: 2r slots, each through half its channels; else r slots through all: r rows' worth either way),
    ape once, and the entry written."""
    state, store, ape = inputs["state"], inputs["store"], inputs["ape"]
    row = state.shape[-1] * state.element_size()  # kv and gate of one slot
    pooled = ratio * row
    entry = store.shape[-1] * store.element_size()
    return state.shape[0] * (2 * row + pooled + entry) + ape.numel() * ape.element_size()


def main() -> int:
    parser = kernel_parser(__doc__, warmup=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--writes", nargs="+", default=list(WRITES), choices=list(WRITES))
    parser.add_argument("--warps", type=int, nargs="+", default=[decode_compressor.WARPS])
    parser.add_argument("--pool-warps", type=int, nargs="+", default=[decode_compressor.POOL_WARPS])
    parser.add_argument("--split-pairs", type=int, nargs="+", default=[decode_compressor.SPLIT_PAIRS])
    parser.add_argument("--fp8-store", action="store_true", help="the indexer's keys in e4m3 with a scale each")
    args = parser.parse_args()
    if not cuda_available("decode_compressor.py"):
        return 0
    dtype = DTYPES[args.dtype]
    print(f"decode compressor write, {torch.cuda.get_device_name()}, {args.dtype}; median of {args.repeats} graph "
          "replays of 10 writes\n")
    print("| write | B | warps | pooling warps | split pairs | µs | GB/s | reference µs | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    defaults = decode_compressor.WARPS, decode_compressor.POOL_WARPS, decode_compressor.SPLIT_PAIRS
    for name, batch in itertools.product(args.writes, args.batches):
        ratio, dc, rotate = WRITES[name]
        inputs = buffers(batch, ratio, dc, args.fp8_store and rotate, dtype)
        reference_ms = graph_median_ms(lambda: reference_write(**inputs, rotate=rotate), args.repeats, args.warmup)
        split = ratio > decode_compressor.MAX_ONE_LAUNCH_RATIO
        splits = itertools.product(args.pool_warps, args.split_pairs) if split else [(None, None)]
        for warps, (pool_warps, pairs) in itertools.product(args.warps, list(splits)):
            decode_compressor.WARPS = warps
            decode_compressor.POOL_WARPS = pool_warps or defaults[1]
            decode_compressor.SPLIT_PAIRS = pairs or defaults[2]
            ms = graph_median_ms(lambda: decode_compressor.decode_compress(**inputs, rotate=rotate), args.repeats,
                                 args.warmup)
            print(f"| {name} | {batch} | {warps} | {pool_warps or '–'} | {pairs or '–'} | {ms * 1e3:.2f} | "
                  f"{moved_bytes(inputs, ratio) / ms / 1e6:,.0f} | {reference_ms * 1e3:.2f} | "
                  f"{reference_ms / ms:.1f} |")
    decode_compressor.WARPS, decode_compressor.POOL_WARPS, decode_compressor.SPLIT_PAIRS = defaults
    return 0


if __name__ == "__main__":
    sys.exit(main())
