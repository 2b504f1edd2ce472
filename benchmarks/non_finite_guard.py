"""The non-finite guard's passes over an M layer's tensors: the Triton kernels against the torch ops.

    python benchmarks/non_finite_guard.py            # dsv4-flash and DeepSeek-V3 M shapes, S = 4096, bf16

Every fused dense backend runs inside `backends.dense_layout.isolate_non_finite`. In: q, k and v each become a
stand-in (0 in place of each NaN and infinity) and a flag per head vector; on a CUDA device one Triton kernel
(`triton_kernels.non_finite_guard.finite_stand_in_with_flags`), else `finite_stand_in` and `non_finite_heads`
(`aminmax` reads t, `nan_to_num` reads it again and writes). Out: the rows that see a bad element are set to NaN,
and their gradient to 0; one Triton kernel (`fill_flagged`) against `torch.where` with the broadcast `[T, H, 1]`
condition. Median µs per call (calls issued back to back) and GB/s of the kernel's traffic (t read once, the
result written once; a fill of 1% of the rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import DTYPES, cuda_available, kernel_parser, median_ms  # noqa: E402
from megatron_dsa.backends.triton_kernels.non_finite_guard import (  # noqa: E402
    fill_flagged, finite_stand_in_with_flags)
from megatron_dsa.ops.dense_attention import finite_stand_in, non_finite_heads  # noqa: E402

# (name, heads, width, row width it is a slice of): q and k of dsv4-flash's M (64 heads, 448 + 64) and of
# DeepSeek-V3's (128 heads, 128 + 64), V3's v as the head slice of its up-projection's [S, 128, 256] rows.
SHAPES = (("dsv4-flash q, k, v, out", 64, 512, 512), ("DeepSeek-V3 q, k", 128, 192, 192),
          ("DeepSeek-V3 v (slice)", 128, 128, 256), ("DeepSeek-V3 out", 128, 128, 128))


def main() -> int:
    parser = kernel_parser(__doc__, warmup=3)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--back-to-back", type=int, default=10, help="calls per timing, issued without a sync")
    args = parser.parse_args()
    if not cuda_available("non_finite_guard.py"):
        return 0
    dtype = DTYPES[args.dtype]
    print(f"non-finite guard, {torch.cuda.get_device_name()}, {args.dtype}, S = {args.seq_len}; median of "
          f"{args.repeats} timings of {args.back_to_back} calls\n")
    print("| pass | tensor | shape | torch ops µs | Triton µs | Triton GB/s | ratio |")
    print("|---|---|---|---:|---:|---:|---:|")
    timed = lambda fn: median_ms(fn, args.repeats, args.warmup, args.back_to_back)  # noqa: E731
    for name, heads, width, row_width in SHAPES:
        t = torch.randn(args.seq_len, heads, row_width, device="cuda", dtype=dtype)[..., row_width - width:]
        dead = torch.rand(t.shape[:2], device="cuda") < 0.01
        traffic = 2 * t.numel() * t.element_size()
        passes = (("stand-in + flags", lambda: (finite_stand_in(t), non_finite_heads(t)),
                   lambda: finite_stand_in_with_flags(t)),
                  ("fill of flagged rows", lambda: torch.where(dead.unsqueeze(-1), float("nan"), t),
                   lambda: fill_flagged(t, dead, float("nan"))))
        for label, torch_ops, triton_pass in passes:
            torch_ms, triton_ms = timed(torch_ops), timed(triton_pass)
            print(f"| {label} | {name} | {list(t.shape)} | {torch_ms * 1e3:.1f} | {triton_ms * 1e3:.1f} | "
                  f"{traffic / triton_ms / 1e6:,.0f} | {torch_ms / triton_ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
