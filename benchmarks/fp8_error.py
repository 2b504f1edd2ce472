"""Layer-level error of bf16 and of FP8 projections against float32: one training step (forward and
backward) of the same layer, the same input and the same upstream gradient, per kind.

Three runs share the parameters: float32 with native projections (the reference; TF32 off), bf16 with
native projections, and bf16 with `projection_precision="fp8"` (`torch_scaled_mm` on GPUs of compute
capability >= 8.9, else the `unfused` reference GEMMs: same rounding). For the output, the input gradient
and each parameter's gradient the table gives the relative error `‖x − x_fp32‖ / ‖x_fp32‖` and the cosine
against float32. C layers select their top-k from each run's own indexer scores, so a flipped selection
shows up as error (`--topk` raises the top-k to keep every entry).

Run from the repository root: `python benchmarks/fp8_error.py --help`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_dsa import HybridAttention, HybridAttentionConfig, LayerKind  # noqa: E402
from megatron_dsa.backends import call_counts, reset_call_counts  # noqa: E402
from megatron_dsa.config import PRESETS  # noqa: E402
from timing import device_name  # noqa: E402  (this directory)

RUNS = (("bf16", torch.bfloat16, "native"), ("fp8", torch.bfloat16, "fp8"))


def training_step(layer: HybridAttention, x: Tensor, upstream: Tensor) -> dict[str, Tensor]:
    """`{"output", "input grad", "grad <parameter>"...}` of one forward and backward, in float32."""
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    out.backward(upstream.to(out.dtype))
    results = {"output": out.detach().float(), "input grad": x.grad.float()}
    results.update({f"grad {name}": p.grad.float() for name, p in layer.named_parameters() if p.grad is not None})
    return results


def compare(actual: Tensor, expected: Tensor) -> tuple[float, float]:
    """(relative error, cosine) of `actual` against `expected`, in float64."""
    actual, expected = actual.double().flatten(), expected.double().flatten()
    norm = expected.norm()
    relative = float((actual - expected).norm() / norm) if norm > 0 else float("nan")
    return relative, float(F.cosine_similarity(actual, expected, dim=0))


def kind_rows(config: HybridAttentionConfig, kind: LayerKind, args: argparse.Namespace) -> tuple[list[str], str]:
    """Table rows of one kind, and which `fp8_gemm` backend ran."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    reference = HybridAttention(config, kind=kind).to(device).train()
    core = getattr(reference, "core_attention", None)
    if core is not None:
        with torch.no_grad():
            core.attn_sink.normal_()  # a trained sink is not zero
    x = torch.randn(args.seq_len, args.batch, config.hidden_size, device=device)
    upstream = torch.randn_like(x)
    expected = training_step(reference, x, upstream)
    measured = {}
    reset_call_counts()
    for name, dtype, precision in RUNS:
        layer = HybridAttention(config.replace(projection_precision=precision), kind=kind).to(device).train()
        layer.load_state_dict(reference.state_dict())
        measured[name] = training_step(layer.to(dtype), x.to(dtype), upstream)
    backends = sorted({backend for (backend, op), calls in call_counts().items() if op == "fp8_gemm" and calls})
    rows = []
    for what, truth in expected.items():
        if truth.norm() == 0:
            continue  # e.g. the indexer's gradients without an indexer loss
        cells = [f"{value:.2e} | {similarity:.5f}" for value, similarity in
                 (compare(measured[name][what], truth) for name, _, _ in RUNS)]
        rows.append(f"| {kind.value} | {what} | " + " | ".join(cells) + " |")
    return rows, ", ".join(backends) or "none"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--kinds", default="WCHM", help="layer kinds, e.g. WC")
    parser.add_argument("--topk", type=int, help="dsa_indexer_topk (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device_name)
    args = parser.parse_args(argv)
    try:
        args.kinds = [LayerKind.parse(symbol) for symbol in args.kinds.upper()]
    except ValueError as error:
        parser.error(str(error))
    if min(args.seq_len, args.batch) < 1 or (args.topk is not None and args.topk < 1):
        parser.error("--seq-len, --batch and --topk must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference multiplies in float32
    overrides = {} if args.topk is None else {"dsa_indexer_topk": args.topk}
    config = HybridAttentionConfig.from_preset(args.preset, **overrides)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"relative error and cosine against float32, one training step per kind: preset {args.preset}, "
          f"S={args.seq_len}, B={args.batch}, top-k {config.dsa_indexer_topk}, {name}, torch {torch.__version__}\n")
    print("| kind | tensor | bf16 rel. error | bf16 cosine | fp8 rel. error | fp8 cosine |")
    print("|---|---|---:|---:|---:|---:|")
    ran = []
    for kind in args.kinds:
        rows, backends = kind_rows(config, kind, args)
        print("\n".join(rows))
        ran.append(f"{kind.value}: fp8_gemm={backends}")
    print("\n" + "; ".join(ran))
    return 0


if __name__ == "__main__":
    sys.exit(main())
