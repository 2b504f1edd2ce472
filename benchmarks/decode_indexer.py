"""Time of the Triton decode indexer kernel (`decode_indexer_scores`: one query row per sequence scored against
that sequence's cached compressed keys) in each of its launch variants, against the unfused reference op and
against the time its key read takes at the GPU's memory bandwidth.

The variants are the kernel's orientation (`KEYS_MAJOR`: the dot as keys × heads, its sum over heads inside
each warp, or as heads × keys, its sum across warps) and the programs per multiprocessor the column ranges aim
at (`PROGRAMS_PER_SM`; `FP8_PROGRAMS_PER_SM` with `--fp8-keys`). dsv4-flash indexer dims by default (64 heads
of 128), every cached key counted. `GB/s` is the key bytes read per second (`B · C · DI` elements); `ratio` is
the reference's time over the kernel's. Needs a CUDA GPU; on a machine without one it says so and exits.

    python benchmarks/decode_indexer.py                    # B = 1, 32; C = 32768 (a 128k context at ratio 4)
    python benchmarks/decode_indexer.py --batches 32 --entries 2048 16384 32768
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, add_decode_shape_options, cuda_available, kernel_parser, median_ms  # noqa: E402
from megatron_dsa.backends.triton_kernels import decode_indexer  # noqa: E402
from megatron_dsa.ops.indexer import decode_indexer_scores as reference_scores  # noqa: E402


def main() -> int:
    parser = kernel_parser(__doc__, warmup=3)
    add_decode_shape_options(parser)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--back-to-back", type=int, default=10, help="calls per timing, issued without a sync")
    parser.add_argument("--fp8-keys", action="store_true",
                        help="keys in e4m3 with a float32 scale each (an FP8 cache); GB/s counts their bytes")
    args = parser.parse_args()
    if not cuda_available("decode_indexer.py"):
        return 0
    dtype = DTYPES[args.dtype]
    print(f"decode indexer scores, {torch.cuda.get_device_name()}, {args.dtype}, HI = {args.heads}, DI = {args.dim}; "
          f"median of {args.repeats} timings of {args.back_to_back} calls\n")
    print("| B | C | variant | µs | GB/s | reference µs | ratio |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    per_sm = "FP8_PROGRAMS_PER_SM" if args.fp8_keys else "PROGRAMS_PER_SM"  # e4m3 keys launch on their own
    defaults = decode_indexer.KEYS_MAJOR, getattr(decode_indexer, per_sm)
    for batch, entries in itertools.product(args.batches, args.entries):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, args.heads, args.dim, device="cuda", generator=g).to(dtype)
        keys = torch.randn(batch, entries, args.dim, device="cuda", generator=g).to(dtype)
        key_scales = None
        if args.fp8_keys:
            keys = keys.to(torch.float8_e4m3fn)
            key_scales = torch.rand(batch, entries, device="cuda", generator=g) + 0.5
        weights = torch.randn(batch, args.heads, device="cuda", generator=g).to(dtype)
        counts = torch.full((batch,), entries, device="cuda")
        scale = args.dim ** -0.5
        reference_ms = median_ms(lambda: reference_scores(q, keys, weights, counts, scale, key_scales), args.repeats,
                                 args.warmup, args.back_to_back)
        key_bytes = keys.numel() * keys.element_size() + (0 if key_scales is None else key_scales.numel() * 4)
        for keys_major, programs in itertools.product([True, False], args.programs_per_sm):
            decode_indexer.KEYS_MAJOR = keys_major
            setattr(decode_indexer, per_sm, programs)
            ms = median_ms(lambda: decode_indexer.decode_indexer_scores(q, keys, weights, counts, scale, key_scales),
                           args.repeats, args.warmup, args.back_to_back)
            variant = f"{'keys' if keys_major else 'heads'}-major, {programs}/SM"
            print(f"| {batch} | {entries} | {variant} | {ms * 1e3:.1f} | {key_bytes / ms / 1e6:,.0f} | "
                  f"{reference_ms * 1e3:.1f} | {reference_ms / ms:.1f} |")
    decode_indexer.KEYS_MAJOR = defaults[0]
    setattr(decode_indexer, per_sm, defaults[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
