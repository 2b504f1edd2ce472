"""Forward and backward time of the dense causal attention of the `M` kind per backend, on the same inputs:
`q [S·B, H, Dqk]`, `k [S·B, G, Dqk]`, `v [S·B, G, Dv]`, B whole sequences of S tokens, through the
`dense_attention` family (`dispatch` with the backend named; a backend that declines the shape is listed
with its reason). Defaults: the dsv4-flash `M` kind (64 heads and KV groups, qk 448 + 64 = 512 / v 512, which
only our Triton kernels and the unfused reference take; `--dims 576,512` is the widest they take); `--dims
192,128` gives DeepSeek-V3's MLA dims, where FlashAttention and cuDNN run too.

TFLOPS count the essential work of causal attention, `S·(S+1)/2` (query, key) pairs per sequence and head:
forward `2·(Dqk + Dv)` per pair, backward `2·(3·Dqk + 2·Dv)` (scores again, dP, dV, dQ, dK). `ratio` is the
backend's forward + backward time over the first backend's (the baseline, measured in the same run).
Needs a CUDA GPU; on a machine without one it says so and exits.

Run from the repository root: `python benchmarks/dense_attention.py --help`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import DTYPES, cuda_available, forward_backward_ms, kernel_parser  # noqa: E402
from megatron_dsa.backends import BackendUnavailableError, OpFamily, dispatch  # noqa: E402
from megatron_dsa.ops.layout import TokenLayout  # noqa: E402

BACKENDS = ("unfused", "triton", "flash_attn", "cudnn", "torch_sdpa")


def parse_args():
    parser = kernel_parser(__doc__, warmup=2)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--groups", type=int, default=None, help="KV groups (default: one per head)")
    parser.add_argument("--dims", default="512,512", help="qk and v head dims")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                        help="the first is the baseline of `ratio`")
    parser.add_argument("--show-tuning", action="store_true",
                        help="print each Triton kernel's autotune candidates with their measured times")
    parser.add_argument("--skip-unfused-above", type=int, default=16384,
                        help="sequence length above which the unfused reference is not timed (minutes a call)")
    return parser.parse_args()


def essential_tflop(seq_len: int, batch: int, heads: int, qk: int, v: int) -> tuple[float, float]:
    pairs = batch * heads * seq_len * (seq_len + 1) / 2
    return 2 * pairs * (qk + v) / 1e12, 2 * pairs * (3 * qk + 2 * v) / 1e12


def main() -> None:
    args = parse_args()
    if not cuda_available("dense_attention.py"):
        return
    qk, v_dim = (int(d) for d in args.dims.split(","))
    groups = args.groups or args.heads
    print(f"# dense causal attention, {torch.cuda.get_device_name()}, {args.dtype}, B={args.batch}, H={args.heads}, "
          f"G={groups}, qk {qk} / v {v_dim}; medians of {args.repeats}")
    print("| S | backend | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOPS | fwd+bwd TFLOPS | ratio |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for seq_len in args.seq_lens:
        time_backends(args, seq_len, qk, v_dim, groups)
        torch.cuda.empty_cache()
    if args.show_tuning and "triton" in args.backends:
        show_tuning()


def time_backends(args, seq_len: int, qk: int, v_dim: int, groups: int) -> None:
    """One table row per backend at `seq_len` tokens a sequence."""
    rows, dtype = seq_len * args.batch, DTYPES[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, args.heads, qk, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(rows, groups, qk, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(rows, groups, v_dim, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(rows, args.heads, v_dim, device="cuda", dtype=dtype, generator=gen)
    layout = TokenLayout.uniform(args.batch, seq_len, q.device)
    fwd_tflop, bwd_tflop = essential_tflop(seq_len, args.batch, args.heads, qk, v_dim)
    baseline = None
    for backend in args.backends:
        if backend == "unfused" and seq_len > args.skip_unfused_above:
            print(f"| {seq_len} | {backend} | skipped above --skip-unfused-above | | | | | |")
            continue
        try:
            attend = dispatch(OpFamily.DENSE_ATTENTION, backend, device=q.device, dtype=dtype, head_dim=qk,
                              v_head_dim=v_dim, heads=args.heads, groups=groups, layout=layout, lse_grad=False)
        except BackendUnavailableError as error:
            print(f"| {seq_len} | {backend} | declines: {error} | | | | | |")
            continue

        def forward():
            with torch.no_grad():
                return attend(q, k, v, layout, qk ** -0.5)

        def forward_backward():
            out, _ = attend(q, k, v, layout, qk ** -0.5)
            torch.autograd.grad(out, (q, k, v), grad)

        fwd_ms, bwd_ms = forward_backward_ms(forward, forward_backward, args.repeats, args.warmup)
        total = fwd_ms + bwd_ms
        baseline = baseline or total
        print(f"| {seq_len} | {backend} | {fwd_ms:.3f} | {bwd_ms:.3f} | {total:.3f} | "
              f"{fwd_tflop / fwd_ms * 1e3:.0f} | {(fwd_tflop + bwd_tflop) / total * 1e3:.0f} | "
              f"{total / baseline:.3f} |", flush=True)


def show_tuning() -> None:
    """Each autotuned Triton dense kernel's candidates and their times (ms) for the last shape it tuned."""
    from megatron_dsa.backends.triton_kernels import dense_attention as triton_dense

    kernels = triton_dense._kernels()
    for name in ("forward", "query_grad", "key_value_grad"):
        tuner = getattr(kernels, name)
        for config, times in sorted(getattr(tuner, "configs_timings", {}).items(), key=lambda item: item[1][0]):
            print(f"# tuning {name}: {config} -> {times[0]:.3f} ms")


if __name__ == "__main__":
    main()
