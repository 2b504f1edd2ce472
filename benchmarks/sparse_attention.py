"""Forward and backward time of the Triton sparse-attention kernels against the unfused reference op, at
dsv4-flash dimensions (H = 64 local heads, D = 512, K = 640 = window 128 + top-k 512).

Both sides get the same inputs: query `[N, H, D]`, the tied latent kv of one sequence (`N` token rows,
then `N / 4` compressed rows), a sink `[H]`, and index rows of a causal sliding window plus random
visible compressed entries (-1 where a row sees fewer than the top-k; `--indices full` makes every slot
valid instead). Forward: `sparse_attention_forward` vs the reference op; backward:
`sparse_attention_backward` vs autograd through the reference (gradient through `out` only).

TFLOPS are nominal and count every index slot, padded or not: forward `2·N·H·K·(D_qk + D_v)`, backward
`2·N·H·K·(3·D_qk + 2·D_v)` with `D_qk = D_v = D` (K = V). Ratio = Triton / unfused (< 1: Triton is
faster). Where the Hopper (Gluon) kernels serve the calls, the portable Triton kernels are timed beside
them (`portable`). Where the vendor kernels the issue measures Triton against run here (FlashMLA's
sparse forward, cuDNN's DSA backward, through our adapters), they are timed on the same inputs too, and
`share` is Triton's speed as a fraction of theirs (vendor ms / Triton ms). Each timing covers
`--back-to-back` calls without a sync, so that kernels are compared rather than one call's latency from
an idle GPU. Needs a CUDA GPU; on a machine without one it says so and exits.

Run from the repository root: `python benchmarks/sparse_attention.py --help`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, cuda_available, median_ms, kernel_parser  # noqa: E402
from megatron_dsa.backends import BackendUnavailableError, OpFamily, resolve  # noqa: E402
from megatron_dsa.backends.dispatched_sparse_attention import sparse_call  # noqa: E402
from megatron_dsa.backends.triton_kernels.availability import triton_decline_reason  # noqa: E402
from megatron_dsa.backends.triton_kernels.sparse_attention import (  # noqa: E402
    hopper_shape_decline,
    kernel_choice,
    portable_kernels,
    sparse_attention_backward,
    sparse_attention_forward,
)
from megatron_dsa.ops.sparse_attention import sparse_attention  # noqa: E402

COMPRESS_RATIO = 4
# The yardsticks per pass: FlashMLA's sparse forward and cuDNN's DSA backward (backend names).
VENDORS = {"fwd": "flashmla", "bwd": "cudnn"}


# ---------------------------------------------------------------- inputs
@dataclass
class Problem:
    query: Tensor  # [N, H, D]
    kv: Tensor  # [N + N / 4, D]
    indices: Tensor  # [N, window + topk] int32
    sink: Tensor  # [H] fp32
    grad_out: Tensor  # [N, H, D]
    scale: float


def causal_indices(rows: int, window: int, topk: int, device: torch.device) -> Tensor:
    """Per row: the window ending at the row (-1 before the start), then `topk` random compressed entries
    among those the row can see (entry j from row t when j < (t + 1) / ratio), -1 where fewer exist."""
    entries = rows // COMPRESS_RATIO
    t = torch.arange(rows, device=device)
    win = t[:, None] - torch.arange(window - 1, -1, -1, device=device)
    visible = torch.arange(entries, device=device) < ((t + 1) // COMPRESS_RATIO)[:, None]
    scores = torch.rand(rows, entries, device=device).masked_fill(~visible, -1.0)
    best, chosen = scores.topk(min(topk, entries), dim=1)
    chosen = torch.where(best >= 0, chosen + rows, -1)
    missing = topk - chosen.shape[1]
    return torch.cat([win.clamp_min(-1), chosen, chosen.new_full((rows, missing), -1)], 1).to(torch.int32)


def build_problem(rows: int, args: argparse.Namespace, device: torch.device) -> Problem:
    dtype, kv_rows = DTYPES[args.dtype], rows + rows // COMPRESS_RATIO
    if args.indices == "full":
        indices = torch.randint(0, kv_rows, (rows, args.window + args.topk), device=device, dtype=torch.int32)
    else:
        indices = causal_indices(rows, args.window, args.topk, device)
    return Problem(query=torch.randn(rows, args.heads, args.dim, device=device, dtype=dtype),
                   kv=torch.randn(kv_rows, args.dim, device=device, dtype=dtype),
                   indices=indices, sink=torch.randn(args.heads, device=device),
                   grad_out=torch.randn(rows, args.heads, args.dim, device=device, dtype=dtype),
                   scale=args.dim ** -0.5)


# ---------------------------------------------------------------- the four timed calls
def triton_calls(p: Problem) -> tuple[Callable[[], object], Callable[[], object]]:
    out, lse = sparse_attention_forward(p.query, p.kv, p.indices, p.sink, p.scale)
    return (lambda: sparse_attention_forward(p.query, p.kv, p.indices, p.sink, p.scale),
            lambda: sparse_attention_backward(p.query, p.kv, p.indices, p.sink, p.scale, out, lse, p.grad_out,
                                              None))


def portable_calls(p: Problem) -> tuple[Callable[[], object], Callable[[], object]]:
    """The portable Triton kernels, where the Hopper kernels would otherwise serve the call."""
    def portable(call: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with portable_kernels():
                return call()
        return run

    return tuple(portable(call) for call in triton_calls(p))


def unfused_calls(p: Problem) -> tuple[Callable[[], object], Callable[[], object]]:
    leaves = [t.detach().requires_grad_() for t in (p.query, p.kv, p.sink)]
    out, _ = sparse_attention(leaves[0], leaves[1], p.indices, leaves[2], p.scale)

    def forward() -> object:
        with torch.no_grad():
            return sparse_attention(p.query, p.kv, p.indices, p.sink, p.scale)

    return forward, lambda: torch.autograd.grad(out, leaves, p.grad_out, retain_graph=True)


def vendor_calls(p: Problem) -> dict[str, Callable[[], object]]:
    """The vendor yardsticks that run here, by pass (each says once why it is missing otherwise)."""
    call = sparse_call(p.query, p.kv, p.indices)
    requests = {"fwd": (OpFamily.SPARSE_ATTENTION_FWD, call),
                "bwd": (OpFamily.SPARSE_ATTENTION_BWD, {**call, "lse_grad": False})}
    calls = {}
    out, lse = sparse_attention_forward(p.query, p.kv, p.indices, p.sink, p.scale)
    for phase, backend in VENDORS.items():
        op, description = requests[phase]
        try:
            _, kernel = resolve(op, backend, **description)
        except BackendUnavailableError as error:
            print(f"no {phase} yardstick: {error}", file=sys.stderr)
            continue
        if phase == "fwd":
            calls[phase] = lambda kernel=kernel: kernel(p.query, p.kv, p.indices, p.sink, p.scale)
        else:
            calls[phase] = lambda kernel=kernel: kernel(p.query, p.kv, p.indices, p.sink, p.scale, out, lse,
                                                        p.grad_out, None)
    return calls


# ---------------------------------------------------------------- measurement
@dataclass
class Row:
    rows: int
    phase: str  # "fwd" or "bwd"
    flops: float
    triton_ms: float
    unfused_ms: float
    portable_ms: Optional[float] = None  # the portable Triton kernel, when the Hopper kernel is the one timed
    vendor_ms: Optional[float] = None  # VENDORS[phase], when it runs here

    @property
    def share(self) -> Optional[float]:
        """Triton's speed as a fraction of the vendor kernel's."""
        return None if self.vendor_ms is None else self.vendor_ms / self.triton_ms

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12

    @property
    def ratio(self) -> float:
        return self.triton_ms / self.unfused_ms


def nominal_flops(rows: int, heads: int, width: int, dim: int) -> dict[str, float]:
    base = 2.0 * rows * heads * width
    return {"fwd": base * (dim + dim), "bwd": base * (3 * dim + 2 * dim)}


def benchmark_rows(rows: int, args: argparse.Namespace, device: torch.device) -> list[Row]:
    torch.manual_seed(0)
    problem = build_problem(rows, args, device)
    flops = nominal_flops(rows, args.heads, args.window + args.topk, args.dim)
    timed = {"triton": triton_calls(problem), "unfused": unfused_calls(problem)}
    if run_hopper_decline(args) is None:
        timed["portable"] = portable_calls(problem)
    vendors = vendor_calls(problem)
    result = []
    for position, phase in enumerate(("fwd", "bwd")):
        ms = {name: median_ms(calls[position], args.repeats, args.warmup, args.back_to_back)
              for name, calls in timed.items()}
        vendor_ms = (median_ms(vendors[phase], args.repeats, args.warmup, args.back_to_back) if phase in vendors
                     else None)
        result.append(Row(rows, phase, flops[phase], ms["triton"], ms["unfused"], ms.get("portable"), vendor_ms))
    return result


# ---------------------------------------------------------------- report
def format_table(rows: Sequence[Row]) -> str:
    lines = ["| N | pass | Triton ms | Triton TFLOPS | portable ms | unfused ms | unfused TFLOPS | ratio | vendor "
             "| vendor ms | vendor TFLOPS | share |",
             "|--:|------|----------:|--------------:|------------:|-----------:|---------------:|------:|--------"
             "|----------:|--------------:|------:|"]
    for r in rows:
        vendor = (f"{VENDORS[r.phase]} | {r.vendor_ms:.3f} | {r.tflops(r.vendor_ms):.1f} | {r.share:.2f}"
                  if r.vendor_ms is not None else "n/a | | |")
        portable = f"{r.portable_ms:.3f}" if r.portable_ms is not None else "n/a"
        lines.append(f"| {r.rows} | {r.phase} | {r.triton_ms:.3f} | {r.tflops(r.triton_ms):.1f} | {portable} | "
                     f"{r.unfused_ms:.3f} | {r.tflops(r.unfused_ms):.1f} | {r.ratio:.3f} | {vendor} |")
    return "\n".join(lines)


def run_hopper_decline(args: argparse.Namespace) -> Optional[str]:
    """Why the Hopper kernels do not serve this run's calls (None: they do)."""
    return hopper_shape_decline(torch.cuda.get_device_capability(), DTYPES[args.dtype], args.heads, args.dim)


def describe_run(args: argparse.Namespace, device: torch.device) -> str:
    return (f"sparse attention, H={args.heads}, D={args.dim}, K={args.window}+{args.topk}, {args.dtype}, "
            f"indices {args.indices}, {torch.cuda.get_device_name(device)}, torch {torch.__version__}\n"
            f"Triton forward and backward: {kernel_choice(run_hopper_decline(args))}; portable = the portable "
            f"Triton kernels, timed where the Hopper kernels serve\n"
            f"median of {args.repeats} timings of {args.back_to_back} back-to-back calls each, after "
            f"{args.warmup} warm-up calls (CUDA events); nominal TFLOPS: "
            f"fwd 2·N·H·K·(D_qk+D_v), bwd 2·N·H·K·(3·D_qk+2·D_v); ratio = Triton / unfused (< 1: Triton faster); "
            f"share = vendor ms / Triton ms (Triton's fraction of the vendor kernel's speed)")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = kernel_parser(__doc__, warmup=3, warmup_note="includes autotuning")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384], help="query rows N")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--back-to-back", type=int, default=4,
                        help="calls per timing, issued without a sync, so that the host's launch work overlaps "
                             "the previous call's kernels (1: the latency of one call from an idle GPU)")
    parser.add_argument("--indices", default="causal", choices=["causal", "full"],
                        help="causal: window + visible top-k with -1 padding; full: every slot a valid id")
    args = parser.parse_args(argv)
    if min(args.seq_lens) < COMPRESS_RATIO or args.heads < 1 or args.dim < 1 or args.window < 1 or args.topk < 0:
        parser.error(f"--seq-lens must be >= {COMPRESS_RATIO}; --heads, --dim, --window >= 1; --topk >= 0")
    if args.repeats < 1 or args.warmup < 1 or args.back_to_back < 1:
        parser.error("--repeats, --warmup and --back-to-back must be >= 1 (the warm-up autotunes the kernels)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not cuda_available("sparse_attention.py"):
        return 0
    device = torch.device("cuda")
    reason = triton_decline_reason(device)
    if reason is not None:
        print(f"Triton kernels cannot run here: {reason}", file=sys.stderr)
        return 1
    rows = [row for seq_len in args.seq_lens for row in benchmark_rows(seq_len, args, device)]
    print(describe_run(args, device), end="\n\n")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
