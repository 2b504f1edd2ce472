"""Host time to issue one CUDA op on this machine: microseconds per call of a few ops issued back to
back without synchronising (the GPU runs behind). An eager layer step issues a few hundred kernels, so
this cost times the kernel count bounds how fast an eager step can be, whatever the GPU does.

    python benchmarks/host_cost.py

Also our Triton kernels' entry points on small inputs (RMSNorm, RoPE, the non-finite guard's pass), plain
and as the autograd Functions a training step calls, with how many launches took the direct path
(`backends/triton_kernels/lazy_jit.py`) rather than Triton's own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from timing import cuda_available  # noqa: E402
from megatron_dsa.backends.triton_kernels import lazy_jit, non_finite_guard, rms_norm, rope  # noqa: E402

CALLS = 2000


def host_us_per_call(issue: Callable[[], object], calls: int = CALLS) -> float:
    """Microseconds of host time per call (after a warm-up), measured before the GPU catches up."""
    for _ in range(50):
        issue()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        issue()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def triton_rows() -> list[tuple[str, float]]:
    """Host µs per call of our Triton entry points on small bf16 inputs (the kernels take a few µs), with the
    launches' path."""
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    grad_x = x.clone().requires_grad_()
    weight = torch.ones(512, device="cuda", dtype=torch.bfloat16)
    heads = torch.randn(64, 4, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(64, device="cuda")
    inv_freq = torch.rand(32, device="cuda")
    cases = [("triton rms_norm [256, 512]", lambda: rms_norm.rms_norm(x, weight, 1e-6)),
             ("triton rms_norm [256, 512], input requiring grad", lambda: rms_norm.rms_norm(grad_x, weight, 1e-6)),
             ("triton rope [64, 4, 128]", lambda: rope.rope(heads, positions, inv_freq)),
             ("triton finite stand-in [64, 4, 128]", lambda: non_finite_guard.finite_stand_in_with_flags(heads))]
    rows = []
    for name, issue in cases:
        before = dict(lazy_jit.LAUNCHES)
        micros = host_us_per_call(issue)
        paths = {path: lazy_jit.LAUNCHES[path] - before.get(path, 0) for path in ("direct", "triton")}
        rows.append((f"{name} (launches: {paths['direct']} direct, {paths['triton']} through Triton)", micros))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # --help
    if not cuda_available("host_cost.py"):
        return 0
    small = torch.randn(1024, device="cuda")
    mask = small > 0
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    rows = [("torch.add, 1024 floats", host_us_per_call(lambda: torch.add(small, small))),
            ("torch.where, 1024 floats", host_us_per_call(lambda: torch.where(mask, small, 0.0))),
            # 200 calls: enough to time the host part while the GPU queue stays far from full
            ("torch.mm 4096x4096 @ 4096x1024 bf16", host_us_per_call(lambda: torch.mm(a, b), calls=200))]
    rows += triton_rows()
    print(f"host time per issued op, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| op | host µs per call |\n|----|-----------------:|")
    for name, micros in rows:
        print(f"| {name} | {micros:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
