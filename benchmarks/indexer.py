"""Forward and backward time of the Triton lightning-indexer scores against the unfused reference op, and
the forward against cuDNN's dense indexer forward where the cuDNN frontend is installed; then the
indexer KL loss's backward (`indexer_kl_bwd`: the KL gradient and the scores backward) for the dense
loss and the sparse loss, against cuDNN's fused kernel where it accepts the call (the sparse loss).

Inputs have the dsv4 indexer dims (HI heads of DI dims) and causal-range candidates: row t of a
sequence of T tokens sees compressed entries j < (t + 1) / 4 of C = T / 4 slots, −1 after. TFLOPS count
the per-head dots alone, 2·HI·DI per valid candidate in forward; backward is reported against the
same count (it recomputes those dots and does two more products of the same size). `--packed` adds
batches of several sequences packed back to back (cuDNN's forward takes uniform batches only). The
sparse loss's candidates are `--kl-topk` of each row's visible entries (random picks: the selection
of the layer), −1 where a row sees fewer.

Run from the repository root: `python benchmarks/indexer.py --help`. Needs CUDA; exits cleanly without.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, cuda_available, forward_backward_ms, kernel_parser, median_ms  # noqa: E402
from megatron_dsa.backends import BackendUnavailableError, OpFamily, resolve  # noqa: E402
from megatron_dsa.backends.triton_kernels.indexer import indexer_scores as triton_scores  # noqa: E402
from megatron_dsa.ops.indexer import indexer_scores as unfused_scores  # noqa: E402
from megatron_dsa.ops.indices import visible_compressed_entries  # noqa: E402
from megatron_dsa.ops.layout import TokenLayout  # noqa: E402

RATIO = 4


def make_inputs(lengths: Sequence[int], heads: int, dim: int, dtype: torch.dtype):
    """q, k, w and the candidates of sequences of `lengths` tokens packed back to back (entries too)."""
    tokens = sum(lengths)
    layout = TokenLayout.packed(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), tokens,
                                torch.device("cuda"))
    candidates = visible_compressed_entries(layout.compressed(RATIO)).rows()
    entries = int(candidates.max()) + 1
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(entries, dim, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(tokens, heads, device="cuda") * heads ** -0.5).to(dtype).requires_grad_()
    return q, k, w, candidates


def cudnn_forward(tokens: int, q: torch.Tensor):
    """cuDNN's dense indexer forward for one sequence of `tokens` (its uniform-batch hint), or None."""
    try:
        _, op = resolve(OpFamily.INDEXER_SCORES, "cudnn", device=q.device, dtype=q.dtype, heads=q.shape[1],
                        head_dim=q.shape[2], visible=True, ratio=RATIO)
    except BackendUnavailableError:
        return None
    visible = visible_compressed_entries(TokenLayout.uniform(1, tokens, q.device).compressed(RATIO))
    hint = visible.uniform_rows(slice(0, tokens))
    return lambda q, k, w, candidates, scale: op(q, k, w, candidates, scale, hint)


def topk_candidates(candidates: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, k]`: k of each row's valid candidates in random order (a top-k selection), −1 where fewer."""
    picks = torch.rand(candidates.shape, device="cuda").masked_fill(candidates < 0, -1).topk(
        min(k, candidates.shape[1]), dim=1)
    return torch.where(picks.values >= 0, candidates.gather(1, picks.indices), -1)


def kl_backward(backend: str, q: torch.Tensor, candidates: torch.Tensor, dense: bool):
    """The `indexer_kl_bwd` op of `backend` for this call, or None where it declines."""
    try:
        return resolve(OpFamily.INDEXER_KL_BWD, backend, device=q.device, dtype=q.dtype, heads=q.shape[1],
                       head_dim=q.shape[2], topk=candidates.shape[1], dense=dense)[1]
    except BackendUnavailableError:
        return None


def time_kl_backward(op, inputs, candidates: torch.Tensor, scale: float, repeats: int, warmup: int) -> float:
    """Median ms of `op(q, k, w, candidates, target, student, grad_rows, scale)` on a random target and student."""
    q, k, w, _ = inputs
    valid = candidates >= 0
    target = torch.rand(candidates.shape, device="cuda") * valid
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    student = torch.randn(candidates.shape, device="cuda").masked_fill(~valid, float("-inf"))
    grad_rows = torch.full((candidates.shape[0],), 1.0 / candidates.shape[0], device="cuda")
    return median_ms(lambda: op(q.detach(), k.detach(), w.detach(), candidates, target, student, grad_rows, scale),
                     repeats, warmup)


def time_op(fn, inputs, scale: float, repeats: int, warmup: int, backward: bool = True) -> tuple[float, float]:
    """(forward ms, backward ms) medians; backward alone = forward + backward − forward (nan without)."""
    q, k, w, candidates = inputs
    grad = torch.randn(candidates.shape, device="cuda")

    def forward() -> None:
        with torch.no_grad():
            fn(q, k, w, candidates, scale)

    def forward_backward() -> None:
        scores = fn(q, k, w, candidates, scale)
        torch.autograd.grad(scores, (q, k, w), grad.masked_fill(candidates < 0, 0))

    if not backward:
        return median_ms(forward, repeats, warmup), float("nan")
    return forward_backward_ms(forward, forward_backward, repeats, warmup)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = kernel_parser(__doc__)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--packed", nargs="*", default=[], metavar="L1,L2,...",
                        help="extra batches of sequences packed back to back, e.g. 700,1300,2096")
    parser.add_argument("--kl-topk", type=int, default=512, help="candidates per row of the sparse loss")
    args = parser.parse_args(argv)
    args.packed = [tuple(int(n) for n in spec.split(",")) for spec in args.packed]
    if min(args.seq_lens) < RATIO or args.repeats < 1 or args.warmup < 0 or args.kl_topk < 1:
        parser.error(f"--seq-lens must be >= {RATIO}, --repeats and --kl-topk >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not cuda_available("indexer.py"):
        return 0
    torch.manual_seed(0)
    print(f"indexer scores, HI={args.heads}, DI={args.dim}, {args.dtype}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; median of {args.repeats} after {args.warmup} warm-up\n"
          f"ratio = triton / unfused (< 1: triton is faster); TFLOPS = 2·HI·DI·valid candidates / time\n")
    print("| sequences | T | C | pass | triton ms | unfused ms | ratio | triton TFLOPS | unfused TFLOPS | cuDNN ms |")
    print("|---|--:|--:|------|----------:|-----------:|------:|--------------:|---------------:|---------:|")
    for lengths in [(tokens,) for tokens in args.seq_lens] + args.packed:
        inputs = make_inputs(lengths, args.heads, args.dim, DTYPES[args.dtype])
        scale = args.dim ** -0.5
        fast = time_op(triton_scores, inputs, scale, args.repeats, args.warmup)
        slow = time_op(unfused_scores, inputs, scale, args.repeats, args.warmup)
        vendor = cudnn_forward(lengths[0], inputs[0]) if len(lengths) == 1 else None
        vendor_ms = ("-" if vendor is None
                     else f"{time_op(vendor, inputs, scale, args.repeats, args.warmup, backward=False)[0]:.3f}")
        rows = [("fwd", inputs[3], fast[0], slow[0], vendor_ms), ("bwd", inputs[3], fast[1], slow[1], "-")]
        for name, candidates, dense in (("kl bwd, dense loss", inputs[3], True),
                                        (f"kl bwd, top-{args.kl_topk} loss", topk_candidates(inputs[3], args.kl_topk),
                                         False)):
            ops = [kl_backward(backend, inputs[0], candidates, dense) for backend in ("triton", "unfused", "cudnn")]
            t_ms, u_ms, c_ms = [None if op is None else
                                time_kl_backward(op, inputs, candidates, scale, args.repeats, args.warmup) for op in ops]
            rows.append((name, candidates, t_ms, u_ms, "-" if c_ms is None else f"{c_ms:.3f}"))
        for name, candidates, t_ms, u_ms, vendor in rows:
            tokens, width = candidates.shape
            flops = 2 * args.heads * args.dim * int((candidates >= 0).sum())
            tflops = [flops / (ms * 1e9) if ms > 0 else float("nan") for ms in (t_ms, u_ms)]
            print(f"| {'+'.join(map(str, lengths))} | {tokens} | {width} | {name} | {t_ms:.3f} | {u_ms:.3f} | "
                  f"{t_ms / u_ms:.2f} | {tflops[0]:.1f} | {tflops[1]:.1f} | {vendor} |")
        del inputs
    return 0


if __name__ == "__main__":
    sys.exit(main())
