"""Reading a profiled step (`torch.profiler`) shared by the profiling benchmarks: the GPU's busy time against
its span, its longest idle gaps, and what the host was doing during each (GPU only)."""

from __future__ import annotations

import torch
from torch.profiler import profile

# Idle gaps listed, longest first, and host ops listed per gap.
GAPS_LISTED = 8
HOST_OPS_PER_GAP = 5


def _kernels(prof: profile) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU activity of the profile, by start."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)


def idle_gaps(prof: profile) -> tuple[float, float, list[tuple[float, float, str]]]:
    """GPU busy µs (the union of its kernels' intervals), the span µs from the first kernel's start to the
    last one's end, and the gaps between kernels as (start µs, end µs, the kernel that ended it)."""
    kernels = _kernels(prof)
    if not kernels:
        return 0.0, 0.0, []
    busy, gaps, reach = 0.0, [], kernels[0][0]
    for start, end, name in kernels:
        if start > reach:
            gaps.append((reach, start, name))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy, reach - kernels[0][0], gaps


def host_ops_during(prof: profile, start: float, end: float) -> list[tuple[float, str]]:
    """The host ops (CPU events: autograd nodes, aten ops, runtime calls) that overlapped [start, end] µs,
    longest overlap first: what the GPU waited for. Needs `ProfilerActivity.CPU` in the profile."""
    overlaps = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        overlap = min(end, event.time_range.end) - max(start, event.time_range.start)
        if overlap > 0:
            overlaps.append((overlap, event.name))
    return sorted(overlaps, reverse=True)[:HOST_OPS_PER_GAP]


def timeline(prof: profile, host: bool = False) -> str:
    """The step's GPU busy time against its span and the longest idle gaps with the kernel that ended each;
    `host`: also the host ops that ran during each gap (the profile must hold CPU events)."""
    busy, span, gaps = idle_gaps(prof)
    if not span:
        return "no kernels recorded"
    lines = [f"GPU timeline: busy {busy / 1e3:.3f} ms of a {span / 1e3:.3f} ms span "
             f"({(span - busy) / 1e3:.3f} ms idle in {len(gaps)} gaps); longest gaps (µs, the kernel that ended it"
             + (", then the host ops that overlapped it, µs" if host else "") + "):"]
    for start, end, name in sorted(gaps, key=lambda gap: gap[0] - gap[1])[:GAPS_LISTED]:
        lines.append(f"  {end - start:8.1f}  {name[:90]}")
        if host:
            lines += [f"            host {overlap:8.1f}  {op[:80]}" for overlap, op in host_ops_during(prof, start, end)]
    return "\n".join(lines)


# Kernel families, first match wins: (family, substrings of the kernel name).
FAMILIES = (
    ("NCCL", ("ncclDevKernel",)),
    ("GEMM", ("nvjet", "gemm", "cutlass_80", "xmma")),
    ("top-k", ("topk", "rank_columns", "select_top")),
    ("indexer scores", ("indexer_forward", "indexer_fwd", "decode_indexer")),
    ("indexer loss", ("kl_", "attention_mass", "score_grad", "indexer_backward")),
    ("sparse attention", ("sparse_attention", "dsa_")),
    ("index_add_ / index_copy_", ("indexFunc",)),
    ("gather / index", ("gather_kernel", "index_elementwise")),
    ("norms / RoPE", ("norm", "rope")),
    ("compressor pooling", ("pool",)),
    ("cat", ("CatArray",)),
    ("copies / memsets", ("Memcpy", "Memset")),
    ("reductions", ("reduce_kernel",)),
    ("elementwise", ("elementwise",)),
)


def kernel_family(name: str) -> str:
    for family, markers in FAMILIES:
        if any(marker in name for marker in markers):
            return family
    return "other"


def family_totals(tsv: str) -> dict[str, float]:
    """Total ms per kernel family of a kernel table (`count<TAB>total µs<TAB>name` lines, as
    `context_parallel.py --profile` writes them). GPU-side annotations (`nccl:…`, which repeat their
    kernels' time) are left out."""
    totals: dict[str, float] = {}
    for line in tsv.splitlines():
        _, micros, name = line.split("\t", 2)
        if not name.startswith("nccl:"):
            family = kernel_family(name)
            totals[family] = totals.get(family, 0.0) + float(micros) / 1e3
    return totals


def family_table(single: dict[str, float], ranks: list[dict[str, float]]) -> str:
    """Markdown table of each family's ms on one GPU, its 1/N share, each of N ranks' ms and the most any rank
    spends over the share (the families a parallel layout adds or does not shrink), largest excess first."""
    share = len(ranks)
    families = sorted(set(single).union(*ranks),
                      key=lambda f: -max(r.get(f, 0.0) for r in ranks) + single.get(f, 0.0) / share)
    lines = ["| family | one GPU ms | 1/N | " + " | ".join(f"rank {r} ms" for r in range(share)) + " | over 1/N |",
             "|---|---:|---:|" + "---:|" * share + "---:|"]
    for family in families + ["total"]:
        one = sum(single.values()) if family == "total" else single.get(family, 0.0)
        per_rank = [sum(r.values()) if family == "total" else r.get(family, 0.0) for r in ranks]
        lines.append(f"| {family} | {one:.2f} | {one / share:.2f} | " + " | ".join(f"{t:.2f}" for t in per_rank)
                     + f" | {max(per_rank) - one / share:+.2f} |")
    return "\n".join(lines)
