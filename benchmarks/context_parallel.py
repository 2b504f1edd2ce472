"""Context-parallel scaling of one attention layer: step time and per-rank peak memory vs CP-1.

    python benchmarks/context_parallel.py --cp 2 4 --seq-len 32768 131072 --kind C --preset dsv4-flash
    python benchmarks/context_parallel.py --tp 2 --cp 2 --seq-len 32768 --kind C   # TP-2 × CP-2, 4 GPUs
    python benchmarks/context_parallel.py --kind M --cp 2 --seq-len 16384 --ring-key-rows 1024 2048 4096
    python benchmarks/context_parallel.py --kind C --cp 2 --seq-len 32768 --profile prof   # where CP-2's time goes
    python benchmarks/context_parallel.py --kind H --cp 2 4 --seq-len 32768 --cuda-graph   # steps as graph replays

Runs the single-GPU layer (TP-1 × CP-1) and then each TP × CP-N layout on TP·N GPUs (NCCL, one process
per GPU) on the same global sequence, and prints a markdown table of median fwd+bwd step times and
per-rank peak memory, with their ratios to the single GPU. An out-of-memory run is reported as such.
`--ring-key-rows` (M only) times each CP layout once per size of the ring's key chunks (the config's
`cp_ring_key_rows`: the rows a ring block expands to K/V at once, memory against time). `--profile DIR`
profiles one more step of every layout on every rank and writes, per rank, its GPU timeline with the host
ops during the longest idle gaps (`DIR/<layout>_rank<r>.txt`, rank 0's also printed), each kernel's count and
total time (`.tsv`) and a Chrome trace (`.json`), then prints each CP layout's kernel families per rank against
their 1/N share of CP-1's (`profiling.family_table`). `--cuda-graph` times every layout's steps as replays of
`make_graphed_layers` (CP-1 too; the collectives inside the graphs), where eager steps can be host-bound; the
peak then includes the graphs' memory pool.
GPU only.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dsa import HybridAttention, HybridAttentionConfig, make_graphed_layers  # noqa: E402
from megatron_dsa.parallel import initialize_parallel_state  # noqa: E402
from megatron_dsa.parallel.context import shard_sequence  # noqa: E402

from profiling import family_table, family_totals, timeline  # noqa: E402  (this directory)

DEFAULT_KEY_ROWS = HybridAttentionConfig.cp_ring_key_rows


def step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    x.grad = None
    out, _ = layer(x)
    out.float().square().mean().backward()
    torch.cuda.synchronize()


def measure(layer: torch.nn.Module, x: torch.Tensor, warmup: int, repeats: int,
            cuda_graph: bool = False) -> tuple[float, float]:
    """Median fwd+bwd milliseconds and peak MiB above the memory held before the steps (and before the
    capture, with `cuda_graph`: the graphs' pool counts)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if cuda_graph:
        (layer,) = make_graphed_layers([layer], [x])
    times = []
    for index in range(warmup + repeats):
        start = time.perf_counter()
        step(layer, x)
        if index >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def write_profile(layer: torch.nn.Module, x: torch.Tensor, stem: Path) -> None:
    """Profiles one more step: `stem`.txt (timeline, host ops in the longest gaps), .tsv (each kernel's count
    and total µs) and .json (Chrome trace)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(layer, x)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count_total = kernels.setdefault(event.name, [0, 0.0])
            count_total[0] += 1
            count_total[1] += event.time_range.end - event.time_range.start
    rows = sorted(kernels.items(), key=lambda item: -item[1][1])
    stem.with_suffix(".tsv").write_text("".join(f"{n}\t{t:.1f}\t{name}\n" for name, (n, t) in rows))
    stem.with_suffix(".txt").write_text(timeline(prof, host=True) + "\n")
    prof.export_chrome_trace(str(stem.with_suffix(".json")))


def build(args: argparse.Namespace, state=None) -> torch.nn.Module:
    config = HybridAttentionConfig.from_preset(args.preset, num_layers=1, layer_pattern=args.kind,
                                               cp_comm_type=args.comm, cp_ring_key_rows=args.key_rows)
    torch.manual_seed(0)
    return HybridAttention(config, kind=args.kind, parallel_state=state).cuda().bfloat16()


def layout_name(args: argparse.Namespace, cp: int) -> str:
    return f"S{args.seq_len}_tp{args.tp if cp > 1 else 1}_cp{cp}"


def run_single(args: argparse.Namespace) -> tuple[float, float]:
    layer = build(args)
    x = torch.randn(args.seq_len, 1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    measured = measure(layer, x, args.warmup, args.repeats, args.cuda_graph)
    if args.profile:
        write_profile(layer, x, args.profile / f"{layout_name(args, 1)}_rank0")
    return measured


def rank_main(rank: int, args: argparse.Namespace, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.tp * args.cp)
    state = initialize_parallel_state(tp_size=args.tp, cp_size=args.cp)
    layer = build(args, state)
    torch.manual_seed(1)  # the same full sequence on every rank; TP ranks of one CP rank share its shard
    full = torch.randn(args.seq_len, 1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    x = shard_sequence(full, args.cp, state.cp_rank, "zigzag").clone().requires_grad_()
    del full
    try:
        measured = measure(layer, x, args.warmup, args.repeats, args.cuda_graph)
        if args.profile:
            write_profile(layer, x, args.profile / f"{layout_name(args, args.cp)}_rank{rank}")
        results.put((rank, *measured))
    except torch.cuda.OutOfMemoryError:
        results.put((rank, float("nan"), float("nan")))
    dist.destroy_process_group()


def run_parallel(args: argparse.Namespace) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    world = args.tp * args.cp
    procs = [ctx.Process(target=rank_main, args=(rank, args, port, results)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows = [results.get() for _ in range(world)] if not results.empty() else []
    if len(rows) != world:
        return float("nan"), float("nan")
    return max(r[1] for r in rows), max(r[2] for r in rows)  # the slowest / fullest rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[2], help="CP sizes to measure, each against CP-1")
    parser.add_argument("--tp", type=int, default=1, help="TP size of every parallel layout (no SP)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[32768])
    parser.add_argument("--kind", default="C", choices=list("WCHM"))
    parser.add_argument("--preset", default="dsv4-flash")
    parser.add_argument("--comm", default="p2p", choices=("p2p", "all_gather"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ring-key-rows", type=int, nargs="+", default=[DEFAULT_KEY_ROWS], metavar="ROWS",
                        help="M: the ring's key chunk sizes to time (`cp_ring_key_rows`)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="profile one more step of each layout on every rank, files here (see above)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time the steps as replays of make_graphed_layers (every layout, CP-1 too)")
    args = parser.parse_args()
    if args.cuda_graph and args.profile:
        parser.error("--profile profiles eager steps; leave out --cuda-graph (a replay hides the host's ops)")
    if args.kind != "M" and args.ring_key_rows != [DEFAULT_KEY_ROWS]:
        parser.error("--ring-key-rows applies to --kind M only (the ring of dense MLA blocks)")
    if min(args.ring_key_rows) < 1:
        parser.error("--ring-key-rows must be >= 1")
    args.key_rows = DEFAULT_KEY_ROWS
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    cp_sizes, seq_lens = args.cp, args.seq_len
    if torch.cuda.device_count() < args.tp * max(cp_sizes):
        sys.exit(f"needs {args.tp * max(cp_sizes)} CUDA GPUs, found {torch.cuda.device_count()}")
    print(f"kind {args.kind}, preset {args.preset}, bf16, B=1, {args.comm} zigzag; median of {args.repeats} "
          f"fwd+bwd steps{' as CUDA-graph replays' if args.cuda_graph else ''}; peak = largest per-rank peak above "
          f"the inputs; ratios against TP-1 × CP-1")
    chunks = args.kind == "M"
    print("\n| S | layout | GPUs |" + (" ring key rows |" if chunks else "")
          + " ms | time ratio | peak MiB | memory ratio |")
    print("|---:|---|---:|" + ("---:|" if chunks else "") + "---:|---:|---:|---:|")
    ratio = lambda a, b: f"{a / b:.3f}" if b == b and a == a else "n/a"  # noqa: E731  (targets such as 0.55)
    for seq_len in seq_lens:
        args.seq_len = seq_len
        try:
            single = run_single(args)
        except torch.cuda.OutOfMemoryError:
            single = (float("nan"), float("nan"))
        torch.cuda.empty_cache()
        print(f"| {seq_len} | TP-1 × CP-1 | 1 |" + (" – |" if chunks else "")
              + f" {single[0]:.1f} | 1.000 | {single[1]:.0f} | 1.000 |", flush=True)
        for cp in cp_sizes:
            for key_rows in args.ring_key_rows:
                args.cp, args.key_rows = cp, key_rows
                parallel = run_parallel(args)
                print(f"| {seq_len} | TP-{args.tp} × CP-{cp} | {args.tp * cp} |" + (f" {key_rows} |" if chunks else "")
                      + f" {parallel[0]:.1f} | {ratio(parallel[0], single[0])} | {parallel[1]:.0f} | "
                      f"{ratio(parallel[1], single[1])} |", flush=True)
    if args.profile:
        print_profiles(args.profile)


def print_profiles(directory: Path) -> None:
    """Rank 0's timeline of each profiled layout, then each CP layout's kernel families against CP-1's share."""
    for path in sorted(directory.glob("*_rank0.txt")):
        print(f"\n{path.stem}:\n{path.read_text()}")
    for single in sorted(directory.glob("*_cp1_rank0.tsv")):
        prefix = single.name.split("_tp")[0]  # S<len>
        for layout in sorted({p.name.rsplit("_rank", 1)[0] for p in directory.glob(f"{prefix}_tp*_cp*_rank*.tsv")}):
            ranks = sorted(directory.glob(f"{layout}_rank*.tsv"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
            if layout.endswith("_cp1") or not ranks:
                continue
            print(f"\n{layout}: kernel ms per family against CP-1's share (`{single.stem}`)\n")
            print(family_table(family_totals(single.read_text()), [family_totals(p.read_text()) for p in ranks]))


if __name__ == "__main__":
    main()
