"""Time of the Triton decode attention kernel (`decode_attention`: one query row per sequence over its new row, its
window ring and its compressed entries, with the sink) in several tile choices, against the unfused reference op
and against the time its reads take at the GPU's memory bandwidth.

Three cases at dsv4-flash dims (64 heads, rows of 576 = 512 + 64 columns, window 128), each at a 128k context:
`C` attends its top-512 selected entries, `H` every visible entry (1024 at ratio 128), `M` a dense MLA cache
(every cached latent row, the ring of the absorbed step). A tile is `key rows / warps / stages[ / value parts]`
(`DecodeTiles`), `splits` the key ranges per (sequence, head block); `default` is what the launcher picks. Each
time is the median per call of calls replayed as one CUDA graph (a call's host work takes longer than its kernels
at small batches).
`GB/s` counts the key rows each sequence reads once (`B · (1 + R + E) · D` elements); `ratio` is the reference's
time over the kernel's. Needs a CUDA GPU; on a machine without one it says so and exits.

    python benchmarks/decode_attention.py                       # B = 1, 32; C, H, M
    python benchmarks/decode_attention.py --cases C --tiles 32/4/2 64/8/3 --splits 4 8 16
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, cuda_available, graph_median_ms, kernel_parser, median_ms  # noqa: E402
from megatron_dsa.backends.triton_kernels.decode_attention import (  # noqa: E402
    DecodeTiles, decode_attention, default_tiles)
from megatron_dsa.ops.decode_attention import decode_attention as reference_decode  # noqa: E402

CONTEXT = 131072
WINDOW = 128


def case_inputs(case: str, batch: int, heads: int, dim: int, dtype: torch.dtype) -> dict:
    """The `decode_attention` arguments of one case (module docstring), every sequence at `CONTEXT` tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rows(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dim, device="cuda", generator=g).to(dtype)

    seqlens = torch.full((batch,), CONTEXT, device="cuda")
    common = dict(query=rows(batch, heads), kv_new=rows(batch), seqlens=seqlens,
                  sink=torch.randn(heads, device="cuda", generator=g), scale=dim ** -0.5)
    if case == "M":
        return dict(common, window_rows=rows(batch, CONTEXT), window=CONTEXT + 1, entries=None, entry_ids=None,
                    ratio=1)
    ratio = 4 if case == "C" else 128
    entries = CONTEXT // ratio
    ids = (torch.stack([torch.randperm(entries, device="cuda", generator=g)[:512] for _ in range(batch)])
           if case == "C" else None)
    return dict(common, window_rows=rows(batch, WINDOW - 1), window=WINDOW, entries=rows(batch, entries),
                entry_ids=ids, ratio=ratio)


def read_elements(inputs: dict) -> int:
    """Key-row elements one call reads once: the new row, the ring's valid rows and the attended entries."""
    batch, dim = inputs["kv_new"].shape
    ring = min(inputs["window_rows"].shape[1], inputs["window"] - 1)
    entries = 0 if inputs["entries"] is None else (
        inputs["entry_ids"].shape[1] if inputs["entry_ids"] is not None else inputs["entries"].shape[1])
    return batch * (1 + ring + entries) * dim


def parse_tiles(text: str) -> DecodeTiles:
    """`key rows/warps/stages[/value parts]`."""
    return DecodeTiles(*(int(part) for part in text.split("/")))


def main() -> int:
    parser = kernel_parser(__doc__, warmup=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--cases", nargs="+", choices=["C", "H", "M"], default=["C", "H", "M"])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--tiles", type=parse_tiles, nargs="+",
                        default=["32/8/2", "32/4/2", "16/4/2", "64/8/3", "64/4/2"],
                        help="key rows/warps/stages[/value parts] to try besides the default")
    parser.add_argument("--splits", type=int, nargs="+", default=[],
                        help="key ranges per (sequence, head block) to try with each tile choice")
    parser.add_argument("--calls", type=int, default=10, help="calls per graph replay")
    parser.add_argument("--reference-max-batch", type=int, default=1,
                        help="time the unfused reference up to this batch (it gathers every attended row)")
    args = parser.parse_args()
    args.tiles = [parse_tiles(t) if isinstance(t, str) else t for t in args.tiles]  # the defaults come as text
    if not cuda_available("decode_attention.py"):
        return 0
    from triton.runtime.errors import OutOfResources
    dtype = DTYPES[args.dtype]
    print(f"decode attention, {torch.cuda.get_device_name()}, {args.dtype}, H = {args.heads}, D = {args.dim}, "
          f"context {CONTEXT}; median of {args.repeats} graph replays of {args.calls} calls\n")
    print("| case | B | tiles | splits | µs | GB/s | reference µs | ratio |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for case, batch in itertools.product(args.cases, args.batches):
        inputs = case_inputs(case, batch, args.heads, args.dim, dtype)
        reference_ms = (median_ms(lambda: reference_decode(**inputs), args.repeats, args.warmup)
                        if batch <= args.reference_max_batch else None)
        read_bytes = read_elements(inputs) * inputs["kv_new"].element_size()
        slots = read_elements(inputs) // (batch * args.dim)  # the new row, the ring and the attended entries
        default = default_tiles(dtype, batch, args.heads, slots, args.dim, inputs["query"].device)
        tile_choices = [None] + [t for t in args.tiles if t != default]
        variants = list(itertools.product(tile_choices, [None, *args.splits]))
        for tiles, splits in variants:
            name = "/".join(map(str, default if tiles is None else tiles)) + (" (default)" if tiles is None else "")
            try:
                ms = graph_median_ms(lambda: decode_attention(**inputs, tiles=tiles, splits=splits), args.repeats,
                                     args.warmup, args.calls)
            except OutOfResources as error:  # a tile choice this GPU cannot hold (shared memory)
                print(f"| {case} | {batch} | {name} | {splits or 'default'} | {error} | | | |", flush=True)
                continue
            reference = "–" if reference_ms is None else f"{reference_ms * 1e3:.1f}"
            ratio = "–" if reference_ms is None else f"{reference_ms / ms:.1f}"
            print(f"| {case} | {batch} | {name} | {splits or 'default'} | {ms * 1e3:.1f} | "
                  f"{read_bytes / ms / 1e6:,.0f} | {reference} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
