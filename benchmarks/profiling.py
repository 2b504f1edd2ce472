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
