"""Decode step time of one attention layer (one new token per sequence over a cache of `context` tokens),
eager and replayed from a CUDA graph, against a dense-MLA cache and the full-sequence recompute measured in
the same run.

Per (kind, batch B, context): the layer's decode step (`layers.decoding.decode_step`: projections, the
compressors' new entry, a C layer's indexer over its cached compressed keys and top-k, the decode attention,
the output projection) eager and as `DecodeGraph` replays, in µs per step and tokens/s of the graph step
(B / step time: one layer; a model of N layers divides by N). Baselines:
- dense MLA: the attention alone of a dense MLA cache with the same dims (every cached latent row,
  `kv_lora_rank + P` wide, the layer's heads absorbed into the latent space, no sink), through the same
  decode-attention op (so both sides have the same kernel quality), as a CUDA graph (eager on CPU);
- recompute: the layer's full forward over the `context + 1` tokens (what decoding without a cache costs per
  token), run only where `B · (context + 1)` is at most `--recompute-max-tokens` (else `skipped`; `OOM` if it
  does not fit).
The caches hold `context` tokens of random rows (a step's time does not depend on their values). Each timing
is one step from an idle GPU (the latency a decode loop sees), the median of `--repeats`.

Run from the repository root: `python benchmarks/decode.py --help`; `--smoke` runs a tiny CPU version.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_dsa import HybridAttentionConfig  # noqa: E402
from megatron_dsa.backends import AUTO, OpFamily, call_counts, dispatch, reset_call_counts  # noqa: E402
from megatron_dsa.config import PRESETS, PROJECTION_PRECISIONS  # noqa: E402
from megatron_dsa.layers import DecodeGraph  # noqa: E402
from megatron_dsa.layers.cuda_graphs import capture_graph  # noqa: E402
from megatron_dsa.layers.decoding import LayerCache  # noqa: E402
from megatron_dsa.layers.kinds import build_attention  # noqa: E402
from megatron_dsa.ops.paged_rows import PagedRows, write_rows  # noqa: E402

from timing import DTYPES, device_name, median_ms  # noqa: E402  (this directory)

GOAL_US = 150.0  # issue 29: a C-layer decode step at B = 32, 128k context, as a CUDA graph
PROFILED_STEPS = 10  # eager steps under the profiler (--profile)


@dataclass
class Row:
    kind: str
    precision: str  # the projections' (`projection_precision`)
    batch: int
    context: int
    eager_us: float
    graph_us: Optional[float]
    dense_us: float  # a CUDA graph on a GPU, else eager
    recompute: str  # ms, "skipped" or "OOM"
    backends: str

    @property
    def tokens_per_s(self) -> float:
        step = self.graph_us if self.graph_us is not None else self.eager_us
        return self.batch / (step * 1e-6)


# ---------------------------------------------------------------- timing
def median_us(step: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median µs of one `step` from an idle device (CUDA events on a GPU, wall time on CPU)."""
    if device.type == "cuda":
        return 1e3 * median_ms(step, repeats, warmup)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


# ---------------------------------------------------------------- what is timed
def filled_cache(layer, batch: int, context: int, spare: int, generator: torch.Generator,
                 fp8_indexer_keys: bool = False, fp8_attention_rows: bool = False) -> LayerCache:
    """A cache of `batch` sequences holding `context` tokens each, its rows random (FP8 indexer keys: their codes;
    scales 1; FP8 attention rows: random rows written to every slot), with room for `spare` more."""
    cache = LayerCache.for_layer(layer, batch, context + spare, fp8_indexer_keys=fp8_indexer_keys,
                                 fp8_attention_rows=fp8_attention_rows)
    buffers = [cache.window, cache.entries, cache.indexer_keys, cache.latent]
    buffers += [state.rows for state in cache.compressors.values()]
    for buffer in buffers:
        if isinstance(buffer, PagedRows):
            fill_pages(buffer, generator)
        elif buffer is not None:
            buffer.copy_(torch.randn(buffer.shape, generator=generator, device=buffer.device))
    cache.seqlens.fill_(context)
    cache.longest = context
    return cache


def fill_pages(paged: PagedRows, generator: torch.Generator, chunk: int = 2048) -> None:
    """Random rows in every slot of FP8 pages, `chunk` slots of every sequence at a time (bounded temporaries)."""
    device = paged.pages.device
    for start in range(0, paged.slots, chunk):
        slots = torch.arange(start, min(start + chunk, paged.slots), device=device)
        rows = torch.randn(paged.batch * slots.numel(), paged.dim, generator=generator, device=device)
        write_rows(paged, torch.arange(paged.batch, device=device).repeat_interleave(slots.numel()),
                   slots.repeat(paged.batch), rows)


def dense_mla_attention(config: HybridAttentionConfig, batch: int, context: int, device: torch.device,
                        dtype: torch.dtype, generator: torch.Generator) -> Callable[[], object]:
    """The dense-MLA baseline's step: every cached latent row (`kv_lora_rank + P` wide) for each head."""
    width, heads = config.mla_kv_lora_rank + config.qk_pos_emb_head_dim, config.num_attention_heads
    random = lambda *shape: torch.randn(shape, generator=generator, device=device).to(dtype)  # noqa: E731
    latent, query, new = random(batch, context, width), random(batch, heads, width), random(batch, width)
    seqlens = torch.full((batch,), context, device=device)
    no_sink = torch.full((heads,), float("-inf"), device=device)
    attend = dispatch(OpFamily.DECODE_ATTENTION, AUTO, device=device, dtype=dtype, heads=heads, head_dim=width,
                      selected=False)
    return lambda: attend(query, new, latent, seqlens, context + 1, None, None, 1, no_sink, width ** -0.5)


def print_kernel_times(step: Callable[[], object], title: str, rows: int, steps: int = PROFILED_STEPS) -> None:
    """The GPU kernels of `steps` eager decode steps by total time: where a step's device time goes (the
    graph replays the same kernels without the host gaps between them)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"\n{title}: kernels of {steps} eager steps\n"
          + prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


def recompute_ms(layer, batch: int, context: int, args: argparse.Namespace, generator: torch.Generator) -> str:
    if batch * (context + 1) > args.recompute_max_tokens:
        return "skipped"
    device = torch.device(args.device)
    try:
        hidden = torch.randn(context + 1, batch, layer.config.hidden_size, generator=generator,
                             device=device).to(DTYPES[args.dtype])
        ms = median_us(lambda: layer(hidden), device, max(1, args.repeats // 4), 1) / 1e3
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"
    return f"{ms:.1f}"


@torch.no_grad()
def measure(config: HybridAttentionConfig, kind: str, batch: int, context: int, args: argparse.Namespace) -> Row:
    """One row: `config` with its `projection_precision` (FP8: the step multiplies by the weights' FP8 codes, kept
    from the first step on, `layers.projection_gemms.RoundedWeights`)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    generator = torch.Generator(device=device).manual_seed(0)
    layer = build_attention(config, kind=kind).to(device, dtype).eval()
    # Every eager and replayed step adds a token: the first step, the profiled ones, then warm-up and timed steps of each.
    cache = filled_cache(layer, batch, context, 1 + 2 * (args.warmup + args.repeats) + PROFILED_STEPS * args.profile,
                         generator, args.fp8_indexer_keys, args.fp8_attention_rows and kind != "M")
    x = torch.randn(1, batch, config.hidden_size, generator=generator, device=device).to(dtype)
    step = lambda: layer(x, inference_cache=cache)  # noqa: E731
    reset_call_counts()
    step()
    backends = ", ".join(sorted(f"{op}={backend}" for (backend, op), calls in call_counts().items() if calls))
    eager = median_us(step, device, args.repeats, args.warmup)
    if args.profile and device.type == "cuda":
        print_kernel_times(step, f"{kind}, B={batch}, context={context}", args.profile_rows)
    dense = dense_mla_attention(config, batch, context, device, dtype, generator)
    graph_us = None
    if device.type == "cuda":
        graph = DecodeGraph(lambda rows: layer(rows, inference_cache=cache)[0], x, [cache])
        graph_us = median_us(lambda: graph(x), device, args.repeats, args.warmup)
        dense = capture_graph(dense, warmup=1)[0].replay
    dense_us = median_us(dense, device, args.repeats, args.warmup)
    cache = None  # freed before the recompute (the closures above are done with it)
    return Row(kind, config.projection_precision, batch, context, eager, graph_us, dense_us,
               recompute_ms(layer, batch, context, args, generator), backends)


# ---------------------------------------------------------------- report
def format_us(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_table(rows: Sequence[Row]) -> str:
    lines = ["| kind | projections | B | context | eager µs | graph µs | tokens/s | dense-MLA attention µs | "
             "graph / dense | recompute ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio = "n/a" if row.graph_us is None else f"{row.graph_us / row.dense_us:.2f}"
        lines.append(f"| {row.kind} | {row.precision} | {row.batch} | {row.context} | {row.eager_us:.1f} | "
                     f"{format_us(row.graph_us)} | {row.tokens_per_s:,.0f} | {row.dense_us:.1f} | {ratio} | "
                     f"{row.recompute} |")
    lines.append("")
    lines += sorted({f"{row.kind} ({row.precision}): {row.backends}" for row in rows})
    for row in rows:
        if (row.kind, row.batch, row.context) == ("C", 32, 131072) and row.graph_us:
            verdict = "met" if row.graph_us <= GOAL_US else "not met"
            lines.append(f"\ngoal (C layer, B = 32, 128k context, CUDA graph <= {GOAL_US:.0f} µs), {row.precision} "
                         f"projections: {row.graph_us:.1f} µs, {verdict}")
    return "\n".join(lines)


def describe_run(args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (eager only)"
    keys = (", FP8 indexer keys" if args.fp8_indexer_keys else "") + (
        ", FP8 attention rows (W/C/H)" if args.fp8_attention_rows else "")
    return (f"HybridAttention decode step (one token per sequence), preset {args.preset}, {args.dtype}{keys}, "
            f"{name}, torch {torch.__version__}\nmedian of {args.repeats} steps after {args.warmup} warm-up, each from an "
            f"idle device; tokens/s = B / step (one layer; graph step where there is one); dense-MLA: attention "
            f"alone over every cached latent row; recompute: the full forward over context + 1 tokens, run up to "
            f"{args.recompute_max_tokens} tokens")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run on the CPU (preset tiny, contexts 64 and 200, B = 1 and 2): checks that it runs")
    parser.add_argument("--preset", default="dsv4-flash", choices=sorted(PRESETS))
    parser.add_argument("--kinds", default="CWH",
                        help="layer kinds among W, C, H, M (M: the whole dense-MLA layer step, weights absorbed)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536, 131072])
    parser.add_argument("--profile", action="store_true",
                        help="also print each row's GPU kernels by total time (torch.profiler, eager steps)")
    parser.add_argument("--profile-rows", type=int, default=14, help="kernels listed per profile")
    parser.add_argument("--fp8-indexer-keys", action="store_true",
                        help="C layers' caches keep their indexer keys in FP8 (LayerCache.for_layer)")
    parser.add_argument("--fp8-attention-rows", action="store_true",
                        help="W/C/H layers' caches keep their attention rows in FP8 pages (LayerCache.for_layer): "
                             "FlashMLA's sparse decode where it is built")
    parser.add_argument("--projection-precision", nargs="+", default=["native"], choices=PROJECTION_PRECISIONS,
                        help="the layer's projection_precision; several: each kind's rows once per value, in one run")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default=None, type=device_name,
                        help="default: cuda where there is one; on a CPU-only machine pass --smoke, or --device cpu "
                             "with sizes small enough for it")
    parser.add_argument("--repeats", type=int, default=50, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (includes compilation)")
    parser.add_argument("--recompute-max-tokens", type=int, default=65537,
                        help="run the full-sequence recompute only up to B · (context + 1) tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.batches, args.contexts, args.dtype = "tiny", [1, 2], [64, 200], "float32"
        args.device, args.repeats, args.warmup, args.recompute_max_tokens = "cpu", 2, 1, 512
    elif args.device is None:
        if not torch.cuda.is_available():
            parser.error("no CUDA GPU here: the default sizes (dsv4-flash, contexts up to 128k) are a GPU's; "
                         "pass --smoke for a small CPU run, or --device cpu with a small --preset and --contexts")
        args.device = "cuda"
    kinds = args.kinds.upper()
    if not kinds or set(kinds) - set("WCHM"):
        parser.error(f"--kinds takes W, C, H and M, got {args.kinds!r}")
    args.kinds = kinds
    if min(args.batches + args.contexts + [args.repeats]) < 1 or args.warmup < 0:
        parser.error("--batches, --contexts and --repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    configs = [HybridAttentionConfig.from_preset(args.preset, projection_precision=precision)
               for precision in args.projection_precision]
    rows = [measure(config, kind, batch, context, args)
            for kind in args.kinds for batch in args.batches for context in args.contexts for config in configs]
    print(describe_run(args), end="\n\n")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
