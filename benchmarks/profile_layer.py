"""Where one layer step spends its GPU time: the top CUDA kernels of a forward + backward, by total time.

    python benchmarks/profile_layer.py --preset dsv4-flash --seq-len 4096 --kind C
    python benchmarks/profile_layer.py --kind C --projection-precision fp8
    python benchmarks/profile_layer.py --kind M --dims deepseek-v3      # the M kind at DeepSeek-V3's MLA dims

Also prints which backend ran each op family and, for every op family, why `auto` declined the
backends it skipped (the dispatcher's log), and the step's GPU timeline: the time some kernel ran against
the span from the first kernel's start to the last one's end, and the longest idle gaps with the kernel
each one waited for (where an eager step waits on its host) and, with `--trace`, the host ops that ran
during each gap. GPU only.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dsa import HybridAttention, HybridAttentionConfig  # noqa: E402
from megatron_dsa.backends import call_counts, reset_call_counts, variant_counts  # noqa: E402
from megatron_dsa.config import PROJECTION_PRECISIONS  # noqa: E402

from layer_parts import DIMS  # noqa: E402  (this directory)
from profiling import timeline  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="dsv4-flash")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--kind", default="C", choices=list("WCHM"))
    parser.add_argument("--dims", default="preset", choices=sorted(DIMS),
                        help="M: the preset's own dims or DeepSeek-V3's MLA (as benchmarks/layer_parts.py)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--projection-precision", default="native", choices=PROJECTION_PRECISIONS)
    parser.add_argument("--rows", type=int, default=15, help="kernels listed")
    parser.add_argument("--trace", help="also write a Chrome trace (host and GPU timelines) here")
    args = parser.parse_args()
    if args.dims != "preset" and args.kind != "M":
        parser.error("--dims applies to --kind M only")
    if not torch.cuda.is_available():
        print("benchmarks/profile_layer.py: needs a CUDA GPU; nothing to profile here")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = HybridAttentionConfig.from_preset(args.preset, attention_backend=args.backend,
                                               projection_precision=args.projection_precision, **DIMS[args.dims])
    layer = HybridAttention(config, kind=args.kind).cuda().bfloat16().train()
    x = torch.randn(args.seq_len, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:  # a training step: fresh gradients, as `optimizer.zero_grad()` leaves them
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = layer(x)
        out.backward(grad)

    for _ in range(3):  # compile, autotune, warm caches
        step()
    torch.cuda.synchronize()
    reset_call_counts()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.trace else [])
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    print(timeline(prof, host=bool(args.trace)))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    print(", ".join(sorted(f"{op}={backend}" for (backend, op), n in call_counts().items() if n)))
    print("variants:", ", ".join(sorted(f"{op}={backend}/{variant} ×{n}"
                                        for (backend, op, variant), n in variant_counts().items() if n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
