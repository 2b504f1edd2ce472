"""An `M` layer's training step against the sum of its parts run alone: its dense attention (the backend the
layer's own step ran, same shapes) and its projection GEMMs (each weight's forward, input-gradient and
weight-gradient products over the layer's rows, as plain matmuls). `layer − parts` is what the layer adds:
norms, RoPE, the K/V split and concat, casts, non-finite isolation and, eager, the host's gaps.

    python benchmarks/layer_parts.py --dims deepseek-v3 --dtype bfloat16 --seq-len 4096 --cuda-graph
    python benchmarks/layer_parts.py --dims preset --dtype bfloat16 --seq-len 4096 --cuda-graph

`--dims deepseek-v3`: DeepSeek-V3's MLA (hidden 7168, 128 heads, q rank 1536, KV rank 512, qk 128 + 64 RoPE,
v 128) in the preset's layer (dsv4-flash: its grouped low-rank output projection); `preset`: the preset's own
`M` kind (dsv4-flash: qk 448 + 64, v 512, 64 heads). Every part is timed as the layer is (each timing from an idle
device: a sync before and after); on a CPU the times are wall times of the unfused path (a smoke test).

Run from the repository root: `python benchmarks/layer_parts.py --help`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_dsa import HybridAttention, HybridAttentionConfig, LayerKind  # noqa: E402
from megatron_dsa.backends import OpFamily, call_counts, dispatch, reset_call_counts  # noqa: E402
from megatron_dsa.ops.layout import TokenLayout  # noqa: E402

from layer import DTYPES, OUT_OF_MEMORY, build_layer, measure, timed, train_step  # noqa: E402  (this directory)
from timing import device_name  # noqa: E402  (this directory)

DIMS = {
    "preset": {},
    "deepseek-v3": dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, qk_head_dim=128,
                        kv_lora_rank=512, v_head_dim=128, qk_pos_emb_head_dim=64),
}


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of `fn` from an idle device (a sync before and after), as `layer.measure` times a step."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device)[0] for _ in range(repeats))


def attention_backend(layer: HybridAttention, x: Tensor, grad_out: Tensor) -> str:
    """The backend the layer's step ran its dense attention on (one counted step)."""
    reset_call_counts()
    train_step([layer], x, grad_out)
    ran = [backend for (backend, op), calls in call_counts().items() if calls and op == OpFamily.DENSE_ATTENTION.value]
    if len(ran) != 1:
        raise RuntimeError(f"expected one dense attention backend in the layer's step, counted {ran}")
    return ran[0]


def attention_ms(layer: HybridAttention, backend: str, tokens: int, batch: int, args: argparse.Namespace) -> float:
    """Forward + backward of the layer's dense attention alone: `q [T, H, qk+P]`, `k [T, G, qk+P]`,
    `v [T, G, Dv]`, B whole sequences, through `backend`."""
    c, device, dtype = layer.config, torch.device(args.device), DTYPES[args.dtype]
    qk, v_dim, heads, groups = (layer.core.q_head_dim(c), c.v_head_dim, layer.local_heads, layer.local_groups)
    q = torch.randn(tokens, heads, qk, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(tokens, groups, qk, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(tokens, groups, v_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, heads, v_dim, device=device, dtype=dtype)
    layout = TokenLayout.uniform(batch, tokens // batch, device)
    attend = dispatch(OpFamily.DENSE_ATTENTION, backend, device=device, dtype=dtype, head_dim=qk, v_head_dim=v_dim,
                      heads=heads, groups=groups, layout=layout, lse_grad=False)
    scale = layer.core.softmax_scale(c)

    def forward_backward() -> None:
        out, _ = attend(q, k, v, layout, scale)
        torch.autograd.grad(out, (q, k, v), grad)

    return median_ms(forward_backward, device, args.repeats, args.warmup)


def projection_parts(layer: HybridAttention) -> list[tuple[str, int, int]]:
    """`(name, in, out)` of every projection weight `[out, in]` the layer's step multiplies its rows by (as
    `layer.py` counts the essential work: a grouped weight as one product of the same size)."""
    return [(name, p.shape[1], p.shape[0]) for name, p in layer.named_parameters()
            if p.dim() == 2 and not name.endswith("ape")]


def projection_ms(width_in: int, width_out: int, tokens: int, args: argparse.Namespace) -> float:
    """Forward (`x·Wᵀ`), input gradient (`dy·W`) and weight gradient (`dyᵀ·x`) of one weight `[out, in]` over
    `tokens` rows."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    x = torch.randn(tokens, width_in, device=device, dtype=dtype)
    weight = torch.randn(width_out, width_in, device=device, dtype=dtype)
    grad = torch.randn(tokens, width_out, device=device, dtype=dtype)

    def products() -> None:
        x @ weight.t()
        grad @ weight
        grad.t() @ x

    return median_ms(products, device, args.repeats, args.warmup)


def report(args: argparse.Namespace) -> str:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = HybridAttentionConfig.from_preset(args.preset, **DIMS[args.dims])
    torch.manual_seed(0)
    layer = build_layer(config, LayerKind.MLA, args.backend, device, dtype)
    x = torch.randn(args.seq_len, args.batch, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn_like(x)
    tokens = args.seq_len * args.batch
    backend = attention_backend(layer, x, grad_out)
    eager = measure([layer], x, grad_out, args.repeats, args.warmup)
    graphed = measure([layer], x, grad_out, args.repeats, args.warmup, cuda_graph=True) if args.cuda_graph else None
    if eager is OUT_OF_MEMORY:
        return "the layer's step ran out of memory"
    parts = [(f"dense attention ({backend})", attention_ms(layer, backend, tokens, args.batch, args))]
    parts += [(f"{name} [{width_in} → {width_out}]", projection_ms(width_in, width_out, tokens, args))
              for name, width_in, width_out in projection_parts(layer)]
    total = sum(ms for _, ms in parts)
    lines = [f"M layer, {args.dims} dims (preset {args.preset}), S={args.seq_len}, B={args.batch}, {args.dtype}, "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}; "
             f"medians of {args.repeats} after {args.warmup} warm-up, each from an idle device",
             "", "| part | fwd+bwd ms | share of parts |", "|---|---:|---:|"]
    lines += [f"| {name} | {ms:.3f} | {ms / total:.1%} |" for name, ms in parts]
    lines += [f"| **parts** | **{total:.3f}** | |", "", "| layer step | ms | over parts |", "|---|---:|---:|"]
    steps = [("eager", eager)] + ([("CUDA graph (`make_graphed_layers`)", graphed)] if graphed is not None else [])
    lines += [f"| {name} | {step.median_ms:.3f} | {step.median_ms / total - 1:+.1%} |" for name, step in steps]
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dims", default="deepseek-v3", choices=sorted(DIMS),
                        help="the M layer's MLA dims (see the module docstring)")
    parser.add_argument("--preset", default="dsv4-flash", help="the preset the dims override")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device_name)
    parser.add_argument("--backend", default="auto", help="the layer's attention_backend")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (compilation, autotuning)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also time the layer's step as CUDA-graph replays (no host gaps)")
    args = parser.parse_args(argv)
    if args.cuda_graph and not args.device.startswith("cuda"):
        parser.error("--cuda-graph needs a CUDA device")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    print(report(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
