"""Forward + backward time and peak memory of one `HybridAttention` layer per kind (W/C/H/M), against a
naive dense-masked attention baseline measured in the same run.

The baseline is the same layer with the same parameters (projections, RoPE, compressor, indexer,
output projection all unchanged) run through the `naive-dense` backend, which swaps only the attention
kernel: sparse attention becomes a full `[S, S+C]` score matrix per sequence masked to the rows the
layer selected, and the `M` kind's causal attention a full `[S, S]` causal-masked score matrix. Every
other op runs the implementation `auto` picks for the layer. Ratios are layer / baseline of one run.

Run from the repository root: `python benchmarks/layer.py --help`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_dsa import (GraphedLayer, HybridAttention, HybridAttentionConfig, LayerKind,  # noqa: E402
                          make_graphed_layers)
from megatron_dsa.backends import (AUTO, Backend, OpFamily, call_counts, register_backend,  # noqa: E402
                                   reset_call_counts, resolve)
from megatron_dsa.config import PRESETS, PROJECTION_PRECISIONS  # noqa: E402
from megatron_dsa.ops.layout import TokenLayout  # noqa: E402

from layer_flops import attention_flop, projection_flop  # noqa: E402  (this directory)
from timing import device_name  # noqa: E402  (this directory)

BASELINE_BACKEND = "naive-dense"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
MIB = 1 << 20


# ---------------------------------------------------------------- the naive dense-masked baseline
def masked_softmax(logits: Tensor, allowed: Tensor, sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Probabilities `[B, H, S, N]` over the allowed keys (a sink `[H]` takes its share of the mass but
    carries no value) and the LSE `[B, H, S]` of the allowed keys alone, as the reference ops return it."""
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    normaliser = lse if sink is None else torch.logaddexp(lse, sink.view(1, -1, 1).to(lse.dtype))
    return torch.exp(logits - normaliser.unsqueeze(-1)), lse


def as_rows(per_sequence: Tensor) -> Tensor:
    """`[B, S, ...]` → `[B·S, ...]` (batch-major token rows)."""
    return per_sequence.reshape(-1, *per_sequence.shape[2:])


def dense_masked_sparse_attention(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                                  *, batch: int) -> tuple[Tensor, Tensor]:
    """The sparse-attention op computed densely: per sequence, scores of all `S` token rows and `C`
    compressed rows, masked to `indices`. Same signature and outputs as the reference op."""
    rows, heads, dim = query.shape
    seqlen, entries = rows // batch, (kv.shape[0] - rows) // batch
    width = seqlen + entries
    sequence = (torch.arange(rows, device=query.device) // seqlen).unsqueeze(1)
    column = torch.where(indices < rows, indices - sequence * seqlen,
                         seqlen + indices - rows - sequence * entries)
    allowed = torch.zeros(rows, width + 1, dtype=torch.bool, device=query.device)
    allowed.scatter_(1, torch.where(indices >= 0, column, width), True)  # invalid ids hit a spare column
    allowed = allowed[:, :width].view(batch, 1, seqlen, width)

    compute = torch.promote_types(query.dtype, torch.float32)
    keys = torch.cat((kv[:rows].view(batch, seqlen, dim), kv[rows:].view(batch, entries, dim)), 1).to(compute)
    q = query.view(batch, seqlen, heads, dim).to(compute)
    probs, lse = masked_softmax(torch.einsum("bshd,bkd->bhsk", q, keys) * scale, allowed, sink)
    out = torch.einsum("bhsk,bkd->bshd", probs, keys)
    return as_rows(out).to(query.dtype), as_rows(lse.transpose(1, 2))


def dense_masked_sparse_attention_backward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                                           scale: float, out: Tensor, lse: Tensor, grad_out: Tensor,
                                           grad_lse: Optional[Tensor], *, batch: int
                                           ) -> tuple[Tensor, Tensor, Tensor]:
    """Backward kernel of the baseline: autograd through the dense-masked forward, recomputed here
    because the dispatcher runs forward and backward kernels separately (one extra dense forward)."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (query, kv, sink)]
        out_again, lse_again = dense_masked_sparse_attention(inputs[0], inputs[1], indices, inputs[2],
                                                             scale, batch=batch)
        outputs, grads = [out_again], [grad_out]
        if grad_lse is not None:
            outputs.append(lse_again)
            grads.append(grad_lse)
        grad_query, grad_kv, grad_sink = torch.autograd.grad(outputs, inputs, grads)
    return grad_query, grad_kv, grad_sink


def dense_masked_causal_attention(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout,
                                  scale: float) -> tuple[Tensor, Tensor]:
    """The `M` kind's attention op computed densely: one full `[S, S]` causal-masked score matrix per
    sequence (uniform batches only). Same signature and outputs as the reference op."""
    batch, seqlen = layout.num_segments, layout.max_seqlen
    heads, groups = q.shape[1], k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)

    def per_head(t: Tensor) -> Tensor:
        return t.to(compute).repeat_interleave(heads // groups, dim=1).view(batch, seqlen, heads, -1)

    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).tril()
    logits = torch.einsum("bshd,bthd->bhst", per_head(q), per_head(k)) * scale
    probs, lse = masked_softmax(logits, causal)
    out = torch.einsum("bhst,bthd->bshd", probs, per_head(v))
    return as_rows(out).to(q.dtype), as_rows(lse.transpose(1, 2))


def register_baseline_backend(batch: int, device: torch.device, dtype: torch.dtype) -> None:
    """`naive-dense`: the dense-masked attention ops, every other op as `auto` picks it here."""
    attention = {OpFamily.SPARSE_ATTENTION_FWD: partial(dense_masked_sparse_attention, batch=batch),
                 OpFamily.SPARSE_ATTENTION_BWD: partial(dense_masked_sparse_attention_backward, batch=batch),
                 OpFamily.DENSE_ATTENTION: dense_masked_causal_attention}
    ops = {op: attention.get(op) or resolve(op, AUTO, device=device, dtype=dtype)[1] for op in OpFamily}
    register_backend(Backend(name=BASELINE_BACKEND, ops=ops))  # in no `AUTO_ORDER` row: `auto` never picks it


# ---------------------------------------------------------------- measurement
@dataclass
class Measurement:
    median_ms: float  # inf when the step ran out of memory
    peak_mib: Optional[float]  # None where the device keeps no allocator statistics (CPU)


OUT_OF_MEMORY = Measurement(float("inf"), None)


@dataclass
class Row:
    kind: LayerKind
    layer: Measurement
    baseline: Measurement
    tflop: float  # essential work of one layer step (`essential_tflop`)
    backends: str  # op → backend the layer's step used

    @property
    def ratio(self) -> float:
        return self.layer.median_ms / self.baseline.median_ms

    @property
    def tflops(self) -> float:
        return self.tflop / (self.layer.median_ms * 1e-3)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(layers: Sequence[HybridAttention | GraphedLayer], x: Tensor, grad_out: Tensor) -> None:
    """One training step of `layers` chained (each one's output is the next one's input), as a model runs
    them: every forward, then the backward from the last output; gradients start from None."""
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x.grad = None
    out = x
    for layer in layers:
        out, _ = layer(out)
    out.backward(grad_out)


def timed(step: Callable[[], None], device: torch.device) -> tuple[float, Optional[float]]:
    """Wall time (ms) of `step` and the peak memory (MiB) it allocated above what was live before it."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    live = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    step()
    synchronize(device)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    peak = (torch.cuda.max_memory_allocated(device) - live) / MIB if device.type == "cuda" else None
    return elapsed_ms, peak


def back_to_back(step: Callable[[], None], steps: int) -> Callable[[], None]:
    """`steps` calls of `step` issued without a sync in between (a training loop's steps)."""
    def steps_in_a_row() -> None:
        for _ in range(steps):
            step()

    return steps_in_a_row


def measure(layers: Sequence[HybridAttention], x: Tensor, grad_out: Tensor, repeats: int, warmup: int,
            cuda_graph: bool = False, steps: int = 1) -> Measurement:
    """Median time per step and layer, and peak memory per step, of the training step of `layers`
    (chained; eager, or replays of their CUDA graphs made by `make_graphed_layers`), each timing covering
    `steps` steps in a row; `OUT_OF_MEMORY` if it does not fit."""
    try:
        stepped = make_graphed_layers(layers, [x] * len(layers)) if cuda_graph else layers
        step = partial(train_step, stepped, x, grad_out)
        runs = [timed(back_to_back(step, steps), x.device) for _ in range(warmup + repeats)][warmup:]
    except torch.OutOfMemoryError:
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.empty_cache()
        return OUT_OF_MEMORY
    # Replays allocate only the gradients they hand over (the graphs' pool was reserved at capture).
    peaks = None if cuda_graph or runs[0][1] is None else max(peak for _, peak in runs)
    return Measurement(statistics.median(ms for ms, _ in runs) / (steps * len(layers)), peaks)


def essential_tflop(layer: HybridAttention, seq_len: int, batch: int) -> float:
    """The layer step's essential work (as counted in docs/performance.md, 'The whole layer'), from the last step's selection.

    Projections: `2·T·numel(W)` per weight, ×3 for forward + backward. Sparse attention: `2·H·ΣK_t·
    (D+D)` forward and `2·H·ΣK_t·(3D+2D)` backward over the valid selected rows `K_t`. Dense `M`:
    the same with the causal pairs `T(T+1)/2` per sequence and `(Dqk, Dv)`. The indexer and its loss
    are left out (small next to these at DSv4 dims: they are the ≈30% that is not projections)."""
    weights = sum(p.numel() for name, p in layer.named_parameters() if p.dim() == 2 and not name.endswith("ape"))
    flop = projection_flop(seq_len * batch, weights)
    core = getattr(layer, "core_attention", None)
    if core is not None:
        heads, dim = core.attn_sink.shape[0], layer.config.v_head_dim
        pairs = int((core.last_selection.all() >= 0).sum())
        flop += attention_flop(heads, pairs, dim, dim)
    else:
        c = layer.config
        pairs = batch * seq_len * (seq_len + 1) // 2
        flop += attention_flop(layer.local_heads, pairs, c.mla_qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim)
    return flop / 1e12


def build_layer(config: HybridAttentionConfig, kind: LayerKind, backend: str, device: torch.device,
                dtype: torch.dtype, projection_precision: str = "native") -> HybridAttention:
    config = config.replace(attention_backend=backend, projection_precision=projection_precision)
    return HybridAttention(config, kind=kind).to(device, dtype).train()


def benchmark_kind(config: HybridAttentionConfig, kind: LayerKind, args: argparse.Namespace) -> Row:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    layers = [build_layer(config, kind, args.backend, device, dtype, args.projection_precision)
              for _ in range(args.stack)]
    baselines = [build_layer(config, kind, args.baseline, device, dtype, args.projection_precision)
                 for _ in range(args.stack)]
    for layer, baseline in zip(layers, baselines):
        baseline.load_state_dict(layer.state_dict())
    x = torch.randn(args.seq_len, args.batch, config.hidden_size, device=device, dtype=dtype,
                    requires_grad=True)
    grad_out = torch.randn_like(x)
    # Compiled: whole-layer graphs of our custom ops (the warm-up steps include the compilation).
    measured = [torch.compile(layer, fullgraph=True, dynamic=False) for layer in layers] if args.compile else layers
    layer_time = measure(measured, x, grad_out, args.repeats, args.warmup, args.cuda_graph, args.back_to_back)
    reset_call_counts()
    if layer_time is not OUT_OF_MEMORY:
        train_step(layers[:1], x, grad_out)  # one counted step: which backend ran each op
    used = sorted({f"{op}={backend}" for (backend, op), calls in call_counts().items() if calls})
    tflop = essential_tflop(layers[0], args.seq_len, args.batch) if layer_time is not OUT_OF_MEMORY else 0.0
    baseline_time = measure(baselines, x, grad_out, args.repeats, args.warmup, steps=args.back_to_back)
    return Row(kind, layer_time, baseline_time, tflop, ", ".join(used))


# ---------------------------------------------------------------- report
def format_mib(peak: Optional[float]) -> str:
    return "n/a" if peak is None else f"{peak:.1f}"


def format_ms(measurement: Measurement) -> str:
    return "OOM" if measurement is OUT_OF_MEMORY else f"{measurement.median_ms:.2f}"


def format_table(rows: Sequence[Row]) -> str:
    lines = ["| kind | layer ms | TFLOPS | baseline ms | ratio | layer peak MiB | baseline peak MiB |",
             "|------|---------:|-------:|------------:|------:|---------------:|------------------:|"]
    for row in rows:
        fits = row.layer is not OUT_OF_MEMORY
        ratio = f"{row.ratio:.2f}" if fits and row.baseline is not OUT_OF_MEMORY else "n/a"
        lines.append(f"| {row.kind.value} | {format_ms(row.layer)} | {row.tflops:.1f} | " if fits else
                     f"| {row.kind.value} | OOM | n/a | ")
        lines[-1] += (f"{format_ms(row.baseline)} | {ratio} | {format_mib(row.layer.peak_mib)} | "
                      f"{format_mib(row.baseline.peak_mib)} |")
    lines.append("")
    lines += [f"{row.kind.value}: {row.backends}" for row in rows if row.backends]
    return "\n".join(lines)


def describe_run(args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    memory = ("peak MiB: allocated during a step above what was allocated before it" if device.type == "cuda"
              else "peak MiB: n/a on CPU (no allocator statistics)")
    return (f"HybridAttention forward + backward, preset {args.preset}, S={args.seq_len}, B={args.batch}, "
            f"{args.dtype}, projections {args.projection_precision}, {name}, torch {torch.__version__}\n"
            f"median of {args.repeats} timings after {args.warmup} warm-up, each of {args.back_to_back} step(s) in a "
            f"row of {args.stack} chained layer(s) (ms per step and layer; peak MiB per step), layer first, then the "
            f"baseline"
            f"{' (layer: CUDA-graph replays)' if args.cuda_graph else ''}"
            f"{' (layer: torch.compile, fullgraph)' if args.compile else ''}\n"
            f"layer backend {args.backend}; ratio = layer / {args.baseline} baseline (< 1: the layer is faster); "
            f"TFLOPS = essential work / layer time; {memory}")


def parse_kinds(value: str) -> list[LayerKind]:
    try:
        return [LayerKind.parse(symbol) for symbol in value.upper()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device_name)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per layer (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    parser.add_argument("--kinds", type=parse_kinds, default="WCHM", help="layer kinds, e.g. WC")
    parser.add_argument("--backend", default=AUTO, help="the measured layer's attention_backend")
    parser.add_argument("--projection-precision", default="native", choices=PROJECTION_PRECISIONS,
                        help="projection_precision of both layers: 'fp8' runs their projection GEMMs in FP8 "
                             "(fp8_gemm; torch_scaled_mm on GPUs of compute capability >= 8.9)")
    parser.add_argument("--baseline", default=BASELINE_BACKEND,
                        help=f"the baseline layer's attention_backend ('{BASELINE_BACKEND}': dense-masked attention)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time the measured layer's steps as CUDA-graph replays (megatron_dsa.make_graphed_layers: "
                             "no per-kernel host time; the baseline stays eager)")
    parser.add_argument("--compile", action="store_true",
                        help="time the measured layer under torch.compile(fullgraph=True) (eager kernels of its "
                             "ops, inductor's code around them; the baseline stays eager)")
    parser.add_argument("--back-to-back", type=int, default=1,
                        help="steps per timing, issued without a sync in between (a training loop's steps: the "
                             "host issues a step while the GPU still runs the previous one); 1 times each step "
                             "from an idle GPU, which adds the host time the GPU waits for")
    parser.add_argument("--stack", type=int, default=1,
                        help="layers of the kind chained in each step, as in a model (every forward, then every "
                             "backward; times are per layer): from the second layer on, the host issues a layer's "
                             "kernels while the GPU runs the previous layer's")
    args = parser.parse_args(argv)
    if args.cuda_graph and not args.device.startswith("cuda"):
        parser.error("--cuda-graph needs a CUDA device")
    if args.cuda_graph and args.compile:
        parser.error("--cuda-graph and --compile time different things: choose one")
    if min(args.seq_len, args.batch, args.repeats, args.back_to_back, args.stack) < 1 or args.warmup < 0:
        parser.error("--seq-len, --batch, --repeats, --back-to-back and --stack must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    config = HybridAttentionConfig.from_preset(args.preset)
    register_baseline_backend(args.batch, torch.device(args.device), DTYPES[args.dtype])
    torch.manual_seed(0)
    rows = [benchmark_kind(config, kind, args) for kind in args.kinds]
    print(describe_run(args), end="\n\n")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
