"""The non-finite guard's pass over an M layer's q, k and v: the one-pass Triton kernel against the torch ops.

    python benchmarks/non_finite_guard.py            # dsv4-flash and DeepSeek-V3 M shapes, S = 4096, bf16

Every fused dense backend runs q, k and v through `backends.dense_layout.stand_in_and_flags` (0 in place of each
NaN and infinity, and a flag per head vector): on a CUDA device one Triton kernel
(`triton_kernels.finite_stand_in`), else `finite_stand_in` and `non_finite_heads` (`aminmax` reads t, `nan_to_num`
reads it again and writes). Median µs per call (calls issued back to back) and GB/s of the kernel's traffic (t
read once, the stand-in written once).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import DTYPES, cuda_available, kernel_parser, median_ms  # noqa: E402
from megatron_dsa.backends.triton_kernels.finite_stand_in import finite_stand_in_with_flags  # noqa: E402
from megatron_dsa.ops.dense_attention import finite_stand_in, non_finite_heads  # noqa: E402

# (name, heads, width, row width it is a slice of): q and k of dsv4-flash's M (64 heads, 448 + 64) and of
# DeepSeek-V3's (128 heads, 128 + 64), V3's v as the head slice of its up-projection's [S, 128, 256] rows.
SHAPES = (("dsv4-flash q, k, v", 64, 512, 512), ("DeepSeek-V3 q, k", 128, 192, 192),
          ("DeepSeek-V3 v (slice)", 128, 128, 256))


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
    print("| tensor | shape | torch ops µs | Triton µs | Triton GB/s | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for name, heads, width, row_width in SHAPES:
        t = torch.randn(args.seq_len, heads, row_width, device="cuda", dtype=dtype)[..., row_width - width:]
        timed = lambda fn: median_ms(fn, args.repeats, args.warmup, args.back_to_back)  # noqa: E731
        torch_ms = timed(lambda: (finite_stand_in(t), non_finite_heads(t)))
        triton_ms = timed(lambda: finite_stand_in_with_flags(t))
        traffic = 2 * t.numel() * t.element_size()
        print(f"| {name} | {list(t.shape)} | {torch_ms * 1e3:.1f} | {triton_ms * 1e3:.1f} | "
              f"{traffic / triton_ms / 1e6:,.0f} | {torch_ms / triton_ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
