"""Time of the Triton indexer-loss kernels against the unfused reference ops.

Two parts of the indexer KL loss (docs/math.md §8), at the dsv4 attention dims (H local heads of D dims):
- teacher: `attention_mass` + the L1 normalisation in torch vs `ops.indexer_loss.teacher_target`;
  TFLOPS count the per-head dots alone, 2·H·D per valid candidate;
- KL: `kl_per_row` forward, and backward alone (= forward + backward − forward), vs the reference.
Where cuDNN's teacher accepts the call (sparse mode, bf16, SM90), its time is shown too: its
row-normalised target from `sparse_attn_score_recompute_wrapper` plus our L1 normalisation.
Candidates: `sparse` = `--topk` arbitrary kv rows per query (the selected top-k); `dense` = the T / 4
compressed entries in causal order (row t sees j < (t + 1) / 4, −1 after).

Run from the repository root: `python benchmarks/indexer_loss.py --help`. Needs CUDA; exits cleanly without.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, cuda_available, forward_backward_ms, median_ms, kernel_parser  # noqa: E402
from megatron_dsa.backends import BackendUnavailableError, OpFamily, resolve  # noqa: E402
from megatron_dsa.backends.cudnn import row_scaled_attention_mass  # noqa: E402
from megatron_dsa.backends.triton_kernels.indexer_loss import attention_mass  # noqa: E402
from megatron_dsa.backends.triton_kernels.indexer_loss import kl_per_row as triton_kl  # noqa: E402
from megatron_dsa.ops.indexer_loss import TINY, kl_per_row as unfused_kl  # noqa: E402
from megatron_dsa.ops.indexer_loss import normalise_target, teacher_target  # noqa: E402
from megatron_dsa.ops.sparse_attention import full_normaliser  # noqa: E402

RATIO = 4


def make_candidates(tokens: int, mode: str, topk: int) -> Tensor:
    """`[T, C]` rows of kv = `[T token rows; T / 4 compressed rows]`, −1 = none."""
    entries = tokens // RATIO
    if mode == "sparse":
        return torch.randint(0, tokens + entries, (tokens, topk), device="cuda")
    j = torch.arange(entries, device="cuda")
    visible = (torch.arange(tokens, device="cuda") + 1) // RATIO
    return torch.where(j < visible[:, None], j + tokens, -1)


def make_inputs(tokens: int, heads: int, dim: int, dtype: torch.dtype, candidates: Tensor, scale: float):
    """query, kv (dtype), the full normaliser over the candidates plus a sink (float32)."""
    query = torch.randn(tokens, heads, dim, device="cuda", dtype=dtype)
    kv = torch.randn(tokens + tokens // RATIO, dim, device="cuda", dtype=dtype)
    lse = full_normaliser(query, kv, candidates, torch.randn(heads, device="cuda"), scale).float()
    return query, kv, lse


def triton_teacher(query: Tensor, kv: Tensor, candidates: Tensor, lse: Tensor, scale: float) -> Tensor:
    """The Triton mass, then the L1 normalisation the layer keeps in torch."""
    mass = attention_mass(query, kv, candidates, lse, scale)
    return mass / mass.sum(-1, keepdim=True).clamp_min(TINY)


def cudnn_teacher(query: Tensor, candidates: Tensor, dense: bool) -> Optional[Callable[..., Tensor]]:
    """cuDNN's teacher (its row-normalised target, normalised again as the layer's composition does)
    where the backend accepts the call here, else None after saying why."""
    try:
        resolve(OpFamily.INDEXER_LOSS, "cudnn", device=query.device, dtype=query.dtype, heads=query.shape[1],
                head_dim=query.shape[2], topk=candidates.shape[1], dense=dense, tp_size=1)
    except BackendUnavailableError as error:
        print(f"no cuDNN teacher: {error}", file=sys.stderr)
        return None
    return lambda *inputs: normalise_target(row_scaled_attention_mass(*inputs))


def time_teacher(fn, inputs: tuple, repeats: int, warmup: int) -> float:
    """Median ms of `fn(query, kv, candidates, lse, scale)` (no autograd: the teacher is detached)."""
    return median_ms(lambda: fn(*inputs), repeats, warmup)


def time_kl(fn, target: Tensor, valid: Tensor, repeats: int, warmup: int) -> tuple[float, float]:
    """(forward ms, backward ms) medians; backward alone = forward + backward − forward."""
    student = torch.randn(valid.shape, device="cuda", requires_grad=True)
    grad = torch.randn(valid.shape[0], device="cuda")

    def forward() -> None:
        with torch.no_grad():
            fn(student, target, valid)

    def forward_backward() -> None:
        torch.autograd.grad(fn(student, target, valid), (student,), grad)

    return forward_backward_ms(forward, forward_backward, repeats, warmup)


def ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}" if den > 0 else "n/a"


def tflops(flops: int, ms: float) -> str:
    return f"{flops / (ms * 1e9):.1f}" if flops and ms > 0 else ""


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = kernel_parser(__doc__, dtype_help="query and kv dtype")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--modes", nargs="+", default=["sparse", "dense"], choices=["sparse", "dense"])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--topk", type=int, default=512, help="candidates per row of the sparse loss")
    args = parser.parse_args(argv)
    if min(args.seq_lens) < RATIO or args.topk < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error(f"--seq-lens must be >= {RATIO}, --topk and --repeats >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not cuda_available("indexer_loss.py"):
        return 0
    torch.manual_seed(0)
    scale = args.dim ** -0.5
    print(f"indexer loss, H={args.heads}, D={args.dim}, {args.dtype} query/kv, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; median of {args.repeats} after {args.warmup} warm-up\n"
          f"ratio = triton / unfused (< 1: triton is faster); teacher TFLOPS = 2·H·D·valid candidates / time\n")
    print("| mode | T | C | part | triton ms | unfused ms | ratio | triton TFLOPS | unfused TFLOPS | cudnn ms |")
    print("|------|--:|--:|------|----------:|-----------:|------:|--------------:|---------------:|---------:|")
    for tokens in args.seq_lens:
        for mode in args.modes:
            candidates = make_candidates(tokens, mode, args.topk)
            query, kv, lse = make_inputs(tokens, args.heads, args.dim, DTYPES[args.dtype], candidates, scale)
            valid = candidates >= 0
            flops = 2 * args.heads * args.dim * int(valid.sum())
            teacher_inputs = (query, kv, candidates, lse, scale)
            cudnn = cudnn_teacher(query, candidates, dense=mode == "dense")
            cudnn_ms = ("n/a" if cudnn is None else
                        f"{time_teacher(cudnn, teacher_inputs, args.repeats, args.warmup):.3f}")
            rows = [("teacher", *(time_teacher(fn, teacher_inputs, args.repeats, args.warmup)
                                  for fn in (triton_teacher, teacher_target)), cudnn_ms)]
            target = teacher_target(query, kv, candidates, lse, scale)
            fast = time_kl(triton_kl, target, valid, args.repeats, args.warmup)
            slow = time_kl(unfused_kl, target, valid, args.repeats, args.warmup)
            rows += [("kl fwd", fast[0], slow[0], ""), ("kl bwd", fast[1], slow[1], "")]
            for part, t_ms, u_ms, c_ms in rows:
                counted = flops if part == "teacher" else 0  # the KL has no dots to count
                print(f"| {mode} | {tokens} | {candidates.shape[1]} | {part} | {t_ms:.3f} | {u_ms:.3f} | "
                      f"{ratio(t_ms, u_ms)} | {tflops(counted, t_ms)} | {tflops(counted, u_ms)} | {c_ms} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
