"""A paper model of a W / C / H attention stack past the machines we measured on: per-rank step time and
memory under context parallelism (CP, zigzag p2p) and tensor parallelism (TP, with sequence parallelism)
on H100 / H200, calibrated on the 1-, 2- and 4-GPU measurements of docs/performance.md, "Scaling model".

    python benchmarks/scaling_model.py --gpu H200 --kind C --seq-len 131072 --cp 1 2 4 8 --tp 1
    python benchmarks/scaling_model.py --calibration     # predicted against measured, every point
    python benchmarks/scaling_model.py --hiding          # where the entry gathers stop hiding

Per rank and layer (forward + backward, B = 1, bf16):

* compute = Σ work / measured rate, per op family: projection GEMMs, sparse attention forward and
  backward, the indexer's selection scores (quadratic: every visible compressed entry), its top-k scan,
  its KL backward and teacher (per selected entry), and a per-token remainder (norms, RoPE, pooling,
  copies) that is the one fitted number per kind. Rates come from the kernel tables, not from a fit.
* CP: the rank's rows are its two zigzag chunks plus their halos (`h` rows each, projected and attended
  again); its compressed entries are all-gathered, hidden behind the indexer's selection unless the
  transfer takes longer; the halo exchange and the backward's reduce-scatter of the entry gradients are
  blocking. Two fitted numbers: a slowdown of the attention-side kernels on CP rows and a fixed host
  cost per CP step; `--cuda-graph` refits the fixed cost on steps replayed as CUDA graphs.
* TP (SP on): the heads' work divides by TP, the replicated parts (down projections, compressors,
  indexer) do not; the sequence all-gather, the output reduce-scatter and the backward all-reduces of the
  shared latents are blocking.
* memory = parameters and optimizer state + activations kept per layer (measured per token at 64k) +
  one layer's backward transient + gathered entries; `--recompute` keeps only each layer's input rows
  and prices the second forward with the measured recompute factor.

Link bandwidth is not calibrated: at the measured sizes every transfer is under 1% of a step, so the
measurements cannot tell a bandwidth. It is nominal NVLink 4 (450 GB/s per direction) or one 400 Gb/s
NIC per GPU across nodes, times an assumed achievable fraction. No GPU needed (it reads the presets through the package).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_dsa import HybridAttentionConfig  # noqa: E402  (the package: its kind table validates patterns)
from layer_flops import (attention_backward_flop, attention_forward_flop, indexer_score_flop,  # noqa: E402
                         projection_flop)

MIB = 1 << 20
BF16 = 2
KINDS = ("W", "C", "H")


# ---------------------------------------------------------------- dims and counts
@dataclass(frozen=True)
class Dims:
    """The layer dims the model needs (`HybridAttentionConfig` field names in the comments)."""

    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    head_dim: int  # v_head_dim (= the query / key dim of W/C/H)
    q_lora: int  # q_lora_rank
    o_groups: int
    o_lora: int  # o_lora_rank
    window: int  # csa_window_size
    topk: int  # dsa_indexer_topk
    indexer_heads: int
    indexer_dim: int
    ratios: dict  # kind → compression ratio (0: none)

    @classmethod
    def from_preset(cls, name: str = "dsv4-flash") -> "Dims":
        config = HybridAttentionConfig.from_preset(name)
        return cls(config.hidden_size, config.num_attention_heads, config.v_head_dim, config.q_lora_rank,
                   config.o_groups, config.o_lora_rank, config.csa_window_size, config.dsa_indexer_topk,
                   config.dsa_indexer_n_heads, config.dsa_indexer_head_dim,
                   {kind: config.compress_ratio(kind) for kind in KINDS})

    def index_width(self, kind: str, seq_len: int) -> int:
        """Columns of every query's index row `[T, W + K]`: the window, then C's top-k or every entry H's
        query may see (the sequence's entry count). The sparse kernels loop over all of them, valid or −1."""
        ratio = self.ratios[kind]
        entries = seq_len // ratio if ratio else 0
        return self.window + (entries if kind == "H" else min(self.topk, entries))

    def halo(self, kind: str) -> int:
        """Rows before a CP piece its first tokens read (`layers.context_parallel.context_halo`)."""
        ratio = self.ratios[kind]
        compressor = 0 if ratio == 0 else (2 * ratio - 1 if ratio == 4 else ratio - 1)
        return max(self.window - 1, compressor)


@dataclass(frozen=True)
class Weights:
    """Parameter counts of one layer. `split`: divided over TP ranks; `replicated`: on every rank; of the
    replicated matrices, `indexer` read the input detached (their GEMMs are still counted `6·T·|W|`)."""

    split: int  # 2-D, head-parallel (q_up, o_group_proj, linear_proj)
    replicated: int  # 2-D, every rank (q_down, kv_proj, compressors, indexer)
    indexer: int  # the part of `replicated` that is the indexer's
    vectors: int  # norms, sink, compressor position embeddings (not GEMM work)

    @property
    def total(self) -> int:
        return self.split + self.replicated + self.vectors

    def per_rank(self, tp: int) -> int:
        return self.split // tp + self.replicated + self.vectors


def layer_weights(dims: Dims, kind: str) -> Weights:
    d, D, heads = dims.hidden, dims.head_dim, dims.heads
    split = dims.q_lora * heads * D + dims.o_groups * dims.o_lora * (heads * D // dims.o_groups) \
        + dims.o_groups * dims.o_lora * d
    replicated = d * dims.q_lora + d * D
    vectors = dims.q_lora + D + heads  # q_layernorm, kv_layernorm, attn_sink
    ratio, indexer = dims.ratios[kind], 0
    if ratio:
        width = (2 if ratio == 4 else 1) * D  # the overlapping compressor pools two groups
        replicated += 2 * d * width  # linear_wkv, linear_wgate
        vectors += ratio * width + D  # ape, norm
    if kind == "C":
        width = 2 * dims.indexer_dim
        indexer = dims.q_lora * dims.indexer_heads * dims.indexer_dim + d * dims.indexer_heads + 2 * d * width
        replicated += indexer
        vectors += ratio * width + dims.indexer_dim
    return Weights(split, replicated, indexer, vectors)


def sum_floor(n: int, ratio: int) -> int:
    """Σ_{u=0}^{n} ⌊u / ratio⌋."""
    if n < 0:
        return 0
    whole, rest = divmod(n + 1, ratio)
    return ratio * whole * (whole - 1) // 2 + whole * rest


def sum_min(n: int, cap: int) -> int:
    """Σ_{u=0}^{n} min(u, cap)."""
    if n < 0:
        return 0
    below = min(n, cap)
    return below * (below + 1) // 2 + cap * max(0, n - cap)


def sum_min_floor(n: int, ratio: int, cap: int) -> int:
    """Σ_{u=0}^{n} min(⌊u / ratio⌋, cap)."""
    if n < 0:
        return 0
    first_capped = cap * ratio  # from here on ⌊u/r⌋ ≥ cap
    return sum_floor(min(n, first_capped - 1), ratio) + cap * max(0, n - first_capped + 1)


@dataclass(frozen=True)
class Rows:
    """Per-query counts summed over query positions `[start, stop)` of one sequence (query t sees window
    rows `min(t+1, W)`, visible entries `⌊(t+1)/r⌋`, and attends `min(top-k, visible)` of them in C)."""

    tokens: int = 0
    window_pairs: int = 0
    visible: int = 0  # Σ visible compressed entries (C: the indexer scores each; H: attended)
    selected: int = 0  # Σ min(top-k, visible) (C only)

    def __add__(self, other: "Rows") -> "Rows":
        return Rows(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return self.tokens, self.window_pairs, self.visible, self.selected

    @property
    def attended_pairs(self) -> int:
        return self.window_pairs + self.selected


def query_rows(dims: Dims, kind: str, start: int, stop: int) -> Rows:
    ratio = dims.ratios[kind]
    window = sum_min(stop, dims.window) - sum_min(start, dims.window)
    if not ratio:
        return Rows(stop - start, window)
    visible = sum_floor(stop, ratio) - sum_floor(start, ratio)
    if kind == "H":  # attends every visible entry
        return Rows(stop - start, window, visible, visible)
    selected = sum_min_floor(stop, ratio, dims.topk) - sum_min_floor(start, ratio, dims.topk)
    return Rows(stop - start, window, visible, selected)


def rank_rows(dims: Dims, kind: str, seq_len: int, cp: int, rank: int) -> Rows:
    """The query rows rank `rank` owns under the zigzag partition: chunks `rank` and `2·cp − 1 − rank`."""
    if cp == 1:
        return query_rows(dims, kind, 0, seq_len)
    chunk = seq_len // (2 * cp)
    return sum((query_rows(dims, kind, c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)), Rows())


# ---------------------------------------------------------------- hardware and rates
@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_tb_s: float  # memory bandwidth: scales the memory-bound families from the H200 they were measured on
    memory_gib: float
    nvlink_gb_s: float = 450.0  # NVLink 4, per direction, nominal
    nic_gb_s: float = 50.0  # one 400 Gb/s NIC per GPU across nodes, nominal
    gpus_per_node: int = 8


GPUS = {"H200": Gpu("H200", 4.8, 141.0), "H100": Gpu("H100", 3.35, 80.0)}


@dataclass(frozen=True)
class Rates:
    """Measured on one H200 (docs/performance.md); the memory-bound ones scale with HBM bandwidth."""

    gemm_tflops: float = 790.0  # projection GEMMs: the C profile's 3.9 ms for its 3.1 TFLOP
    sparse_fwd_tflops: float = 500.0  # FlashMLA sparse forward, N = 4096 and 16384
    sparse_bwd_tflops: float = 400.0  # cuDNN sparse backward, N = 4096 and 16384
    indexer_tflops: float = 377.0  # cuDNN dense indexer scores, 16384 × 4096 (1.457 ms); CP rows too, as segments
    topk_ps_per_entry: float = 17.4  # top-k scan per visible entry (H100: 0.584 ms at 16384 × 4096)
    kl_backward_ns_per_pick: float = 0.318  # cuDNN fused indexer KL backward, 16384 × 512: 2.666 ms
    teacher_ns_per_pick: float = 0.246  # Triton teacher over the picks, all heads, 16384 × 512: 2.063 ms
    link_efficiency: float = 0.8  # achievable fraction of nominal link bandwidth (assumed, not measured)
    hop_latency_us: float = 10.0  # per ring step of a collective, or per point-to-point exchange (assumed)


TOPK_MEASURED_ON_HBM_TB_S = 3.35  # the top-k table is an H100's
HBM_REFERENCE_TB_S = 4.8  # every other rate is an H200's


@dataclass(frozen=True)
class Fitted:
    """The fitted numbers: one per kind on one GPU, two for CP (see `calibrate`)."""

    other_us_per_token: dict  # kind → µs per token of the memory-bound remainder (H200), from S = 4096
    cp_attention_slowdown: float  # attention-side kernels on CP rows (packed layout) vs one GPU
    cp_host_ms: float  # fixed per CP layer step (host plan, blocking halo ops): eager, or graphed (`fit_graph_host`)


# Per-token bytes of the activations a W/C/H layer keeps for its backward, measured at S = 65536 on one
# H200 (docs/performance.md, "Activation recompute": kept after forward / S), and the backward transient
# (step peak − kept, 4672 MiB for every kind).
KEPT_MIB_PER_TOKEN = {"W": 17296 / 65536, "C": 18824 / 65536, "H": 17425 / 65536}
TRANSIENT_MIB_PER_TOKEN = 4672 / 65536
# Step time with `recompute_attention` over without, same run (S = 65536, H200): the forward runs twice.
RECOMPUTE_TIME_FACTOR = {"W": 109.0 / 87.6, "C": 443.3 / 276.4, "H": 161.4 / 128.4}
# The harness of benchmarks/context_parallel.py keeps more per token (fp32 loss copies of the output, the
# input gradient): 13426 MiB at S = 32768 for C there, 0.41 MiB/token against 0.36 in the layer benchmark.
# Only ratios of that harness are calibrated, so its per-token bytes cancel.


def per_head_share(dims: Dims, kind: str) -> float:
    """Fraction of the kept activations that is per head (divided by TP): q before and after its norm +
    RoPE, the attention output before and after its inverse RoPE, `4·H·D` bf16 values per token (inferred
    from what the ops save, not measured)."""
    return min(1.0, 4 * dims.heads * dims.head_dim * BF16 / MIB / KEPT_MIB_PER_TOKEN[kind])


# ---------------------------------------------------------------- the model
@dataclass(frozen=True)
class Setup:
    gpu: Gpu
    kind: str
    seq_len: int
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("seq_len", "cp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ValueError(f"seq_len {self.seq_len} must be a multiple of 2·cp = {2 * self.cp} (zigzag)")
        if self.seq_len % self.tp:
            raise ValueError(f"seq_len {self.seq_len} must be a multiple of tp = {self.tp} (sequence parallel)")

    @property
    def cp_crosses_nodes(self) -> bool:
        """Megatron order puts TP innermost: a CP group spans nodes once tp·cp GPUs outgrow a node."""
        return self.cp * self.tp > self.gpu.gpus_per_node


@dataclass(frozen=True)
class Prediction:
    setup: Setup
    rows: int  # query rows the rank computes (its own and its halos')
    work: dict  # family → ms of compute on the slowest rank
    comm_exposed_ms: float  # communication the step waits for (blocking, or not hidden)
    gather_ms: float  # the forward's entry all-gather, in flight behind `overlap_ms`
    overlap_ms: float  # compute queued while the gather is in flight
    host_ms: float
    memory: dict  # part → MiB of one layer's step on the rank (a stack: `predict_stack`)
    flop: float  # essential FLOP of the slowest rank (projections + attention)

    @property
    def compute_ms(self) -> float:
        return sum(self.work.values())

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.comm_exposed_ms + self.host_ms

    @property
    def hidden(self) -> bool:
        """Whether the entry gather hides behind the compute queued with it."""
        return self.gather_ms <= self.overlap_ms

    @property
    def memory_mib(self) -> float:
        return sum(self.memory.values())


def transfer_ms(bytes_per_rank: float, bandwidth_gb_s: float, hops: int, rates: Rates) -> float:
    """α–β cost of moving `bytes_per_rank` into a rank over `hops` sequential ring steps."""
    return bytes_per_rank / (bandwidth_gb_s * rates.link_efficiency * 1e6) + hops * rates.hop_latency_us * 1e-3


def essential_flop(dims: Dims, kind: str, own: Rows, halo: int = 0, tp: int = 1) -> float:
    """`layer.py`'s essential work (projections + attention, fwd + bwd) of one TP rank computing the query
    rows `own` and two halos of `halo` rows (each attends its full window)."""
    weights = layer_weights(dims, kind)
    pairs = own.attended_pairs + 2 * halo * dims.window
    D = dims.head_dim
    return projection_flop(own.tokens + 2 * halo, weights.split // tp + weights.replicated) \
        + attention_forward_flop(dims.heads // tp, pairs, D, D) + attention_backward_flop(dims.heads // tp, pairs, D, D)


def predict(setup: Setup, dims: Dims, fitted: Fitted, rates: Rates = Rates()) -> Prediction:
    """One layer's training step on the slowest CP rank. Zigzag gives every rank the same work, except that
    rank 0's first chunk starts the sequence (its first queries see less than a full window and top-k)."""
    kind, cp, tp = setup.kind, setup.cp, setup.tp
    halo = dims.halo(kind) if cp > 1 else 0
    slowest_first = lambda rows: (rows.visible, rows.attended_pairs)  # noqa: E731
    own = max((rank_rows(dims, kind, setup.seq_len, cp, rank) for rank in range(cp)), key=slowest_first)
    rows = own.tokens + 2 * halo  # halo rows are projected and attended again (their outputs dropped)
    work = compute_ms(setup, dims, own, halo, fitted, rates)
    exposed, gather, overlap = communication_ms(setup, dims, own, rows, work, rates)
    host = fitted.cp_host_ms if cp > 1 else 0.0
    return Prediction(setup, rows, work, exposed, gather, overlap, host, memory_mib(setup, dims, rows),
                      essential_flop(dims, kind, own, halo, tp))


def compute_ms(setup: Setup, dims: Dims, own: Rows, halo: int, fitted: Fitted, rates: Rates) -> dict:
    """Milliseconds per op family of a rank computing the query rows `own` and two halos."""
    kind, tp, gpu = setup.kind, setup.tp, setup.gpu
    # The kernels' work: every index slot of every row, valid or not (the rates count the same way).
    rows = own.tokens + 2 * halo
    slots = rows * dims.index_width(kind, setup.seq_len)
    heads, D = dims.heads // tp, dims.head_dim
    weights = layer_weights(dims, kind)
    slowdown = fitted.cp_attention_slowdown if setup.cp > 1 else 1.0
    work = {
        "projections": projection_flop(rows, weights.split // tp + weights.replicated) / (rates.gemm_tflops * 1e9),
        "sparse attention": slowdown * (
            attention_forward_flop(heads, slots, D, D) / (rates.sparse_fwd_tflops * 1e9)
            + attention_backward_flop(heads, slots, D, D) / (rates.sparse_bwd_tflops * 1e9)),
        # Assumed: half of the remainder is per-head work (q norm + RoPE, the inverse RoPE of the output).
        "other (per token)": fitted.other_us_per_token[kind] * 1e-3 * rows * HBM_REFERENCE_TB_S / gpu.hbm_tb_s
        * (1 + 1 / tp) / 2,
    }
    if kind == "C":  # the indexer is replicated over TP: every rank scores all indexer heads
        scores = indexer_score_flop(dims.indexer_heads, dims.indexer_dim, own.visible)
        work["indexer scores"] = scores / (rates.indexer_tflops * 1e9)
        work["top-k"] = own.visible * rates.topk_ps_per_entry * 1e-9 * TOPK_MEASURED_ON_HBM_TB_S / gpu.hbm_tb_s
        work["indexer loss"] = slowdown * own.selected * 1e-6 * (rates.kl_backward_ns_per_pick
                                                                 + rates.teacher_ns_per_pick / tp)
    return work


def communication_ms(setup: Setup, dims: Dims, own: Rows, rows: int, work: dict,
                     rates: Rates) -> tuple[float, float, float]:
    """`(exposed, forward gathers in flight, compute queued behind them)` in ms.

    CP: each rank pools the entries whose last token it holds and all-gathers everyone's (a ring: (cp−1)/cp
    of the buffer arrives over cp − 1 hops). The main entries are in flight behind the indexer's selection
    (C; H queues only its index rows), C's indexer keys behind the indexer's query projection. The halo
    exchange, and in backward the reduce-scatter of the entries' gradient (the gather's adjoint: the same
    bytes and hops) and the halo gradients, block.
    TP (sequence parallel, Megatron style, nothing overlapped): the sequence all-gather, the output
    reduce-scatter and its backward all-gather; backward all-reduces of the shared q latent and K = V rows,
    and (C) the teacher's head-summed mass."""
    kind, cp, tp, gpu, D = setup.kind, setup.cp, setup.tp, setup.gpu, dims.head_dim
    ratio = dims.ratios[kind]
    entries = setup.seq_len // ratio if ratio else 0
    exposed = gather = overlap = 0.0
    if cp > 1:
        link, hops = gpu.nic_gb_s if setup.cp_crosses_nodes else gpu.nvlink_gb_s, cp - 1
        gathers = []  # (bytes of the whole gathered buffer, ms of compute queued behind it)
        if entries:
            gathers.append((entries * D * BF16, work.get("indexer scores", 0.0) + work.get("top-k", 0.0)))
        if kind == "C":
            query_projection = 2.0 * rows * dims.q_lora * dims.indexer_heads * dims.indexer_dim  # forward GEMM
            gathers.append((entries * dims.indexer_dim * BF16, query_projection / (rates.gemm_tflops * 1e9)))
        exposed += 2 * transfer_ms(2 * dims.halo(kind) * dims.hidden * BF16, link, 1, rates)  # two tails, each way
        for buffer, behind in gathers:
            in_flight = transfer_ms(buffer * hops / cp, link, hops, rates)
            gather, overlap = gather + in_flight, overlap + behind
            exposed += max(0.0, in_flight - behind) + transfer_ms(buffer * hops / cp, link, hops, rates)
    if tp > 1:
        share, hops = (tp - 1) / tp, tp - 1
        exposed += 3 * transfer_ms(share * rows * dims.hidden * BF16, gpu.nvlink_gb_s, hops, rates)
        reduced = [rows * dims.q_lora * BF16, (rows + entries) * D * BF16]
        if kind == "C":
            reduced.append(own.tokens * dims.topk * 4)  # fp32
        exposed += sum(transfer_ms(2 * share * size, gpu.nvlink_gb_s, 2 * hops, rates) for size in reduced)
    return exposed, gather, overlap


def memory_mib(setup: Setup, dims: Dims, rows: int) -> dict:
    """Per part, MiB of one layer's step on a rank (the benchmarks' peak counts all but the entries)."""
    kind, tp = setup.kind, setup.tp
    ratio = dims.ratios[kind]
    entries = setup.seq_len // ratio if ratio else 0
    entry_width = dims.head_dim + (dims.indexer_dim if kind == "C" else 0)
    kept_per_token = KEPT_MIB_PER_TOKEN[kind] * (1 - per_head_share(dims, kind) * (1 - 1 / tp))
    return {"kept activations": rows * kept_per_token,
            "backward transient": rows * TRANSIENT_MIB_PER_TOKEN / tp,  # assumed per head, like the kept q and o
            "gathered entries (+ gradient)": 2 * entries * entry_width * BF16 / MIB,
            "parameter gradients (bf16)": layer_weights(dims, kind).per_rank(tp) * BF16 / MIB}


@dataclass(frozen=True)
class StackPrediction:
    """`layers` layers in training, every forward then every backward, on one rank."""

    layers: list  # Prediction per layer
    memory_gib: float
    parameters_gib: float  # of which parameters, gradients and optimizer state

    @property
    def step_ms(self) -> float:
        return sum(layer.step_ms for layer in self.layers)

    @property
    def comm_exposed_ms(self) -> float:
        return sum(layer.comm_exposed_ms for layer in self.layers)

    @property
    def host_ms(self) -> float:
        return sum(layer.host_ms for layer in self.layers)

    @property
    def tflops(self) -> float:
        return sum(layer.flop for layer in self.layers) / (self.step_ms * 1e9)

    @property
    def unhidden_gather_ms(self) -> float:
        return sum(max(0.0, layer.gather_ms - layer.overlap_ms) for layer in self.layers)


def predict_stack(kinds: Sequence[str], gpu: Gpu, seq_len: int, cp: int, tp: int, dims: Dims, fitted: Fitted,
                  bytes_per_parameter: float = 18.0, recompute: bool = False) -> StackPrediction:
    """Per-rank time and memory of the layers `kinds` (e.g. "CH" * 20). Memory: parameters with optimizer
    state (`bytes_per_parameter`: 18 = bf16 weight, fp32 gradient, fp32 master and two Adam moments,
    nothing sharded over data parallelism), the activations every layer keeps, and the largest backward
    transient and gathered entries of one layer. With `recompute` a layer keeps only its input rows
    (`rows · d` bf16), the layer in backward holds its kept activations again, and its compute takes the
    measured recompute factor (its collectives are not counted twice)."""
    layers = [predict(Setup(gpu, kind, seq_len, cp, tp), dims, fitted) for kind in kinds]
    if recompute:
        layers = [replace(layer, work={family: ms * RECOMPUTE_TIME_FACTOR[layer.setup.kind]
                                       for family, ms in layer.work.items()}) for layer in layers]
    total, transient, parameters = 0.0, 0.0, 0.0
    for layer in layers:
        kept, peak = layer.memory["kept activations"], layer.memory["backward transient"]
        if recompute:
            kept, peak = layer.rows * dims.hidden * BF16 / MIB, peak + kept
        parameters += layer_weights(dims, layer.setup.kind).per_rank(tp) * bytes_per_parameter / MIB
        total += kept
        transient = max(transient, peak + layer.memory["gathered entries (+ gradient)"])
    return StackPrediction(layers, (parameters + total + transient) / 1024, parameters / 1024)


# ---------------------------------------------------------------- measurements and calibration
@dataclass(frozen=True)
class StepPoint:
    """One measured single-GPU step (ms) or peak (MiB), and whether it calibrates (`fit`) or checks."""

    gpu: str
    kind: str
    seq_len: int
    value: float
    source: str
    fit: bool = False


# One GPU, fwd + bwd of one layer (docs/performance.md): `--cuda-graph` replays at S = 4096, eager above. The
# H200 steps at S = 4096 and 16384 were measured with layer.py on one H200 on 2026-11-26 (commit 0fb29bf); the
# 32k and 131k ones are context_parallel.py's CP-1 on the 4×H200 box of CP_RATIOS (2026-11-27, commit 7288b09);
# the H100 ones at an earlier commit.
STEP_MS = (
    StepPoint("H200", "W", 4096, 5.46, "layer.py, CUDA graph", fit=True),
    StepPoint("H200", "C", 4096, 9.41, "layer.py, CUDA graph", fit=True),
    StepPoint("H200", "H", 4096, 6.08, "layer.py, CUDA graph", fit=True),
    StepPoint("H200", "C", 16384, 39.34, "layer.py, eager"),
    StepPoint("H200", "C", 32768, 88.0, "context_parallel.py CP-1, eager"),
    StepPoint("H200", "C", 131072, 484.9, "context_parallel.py CP-1, eager"),
    StepPoint("H200", "H", 32768, 52.9, "context_parallel.py CP-1, eager"),
    StepPoint("H200", "H", 131072, 312.5, "context_parallel.py CP-1, eager"),
    StepPoint("H100", "W", 4096, 5.86, "layer.py, CUDA graph"),
    StepPoint("H100", "C", 4096, 10.21, "layer.py, CUDA graph"),
    StepPoint("H100", "H", 4096, 6.57, "layer.py, CUDA graph"),
)
# Peak MiB of a step above its inputs (parameter gradients included); the 64k points give the per-token bytes.
PEAK_MIB = (
    StepPoint("H200", "C", 65536, 23496, "recompute_memory.py", fit=True),
    StepPoint("H200", "W", 65536, 21968, "recompute_memory.py", fit=True),
    StepPoint("H200", "H", 65536, 22097, "recompute_memory.py", fit=True),
    StepPoint("H200", "C", 4096, 1371.5, "layer.py"),
    StepPoint("H200", "C", 16384, 5823.6, "layer.py"),
)


@dataclass(frozen=True)
class CpPoint:
    """`benchmarks/context_parallel.py` on `tp·cp` H200s: TP × CP-N over TP-1 × CP-1, step time and per-rank
    peak memory."""

    kind: str
    seq_len: int
    cp: int
    time_ratio: float
    memory_ratio: float
    tp: int = 1


# 4×H200, 2026-11-27, commit 7288b09: `context_parallel.py --kind C|H --cp 2 4 --seq-len 32768 131072 --repeats 3`
# (p2p zigzag, fwd + bwd median of 3; ratios against CP-1 on the same box). They replace the eight points of
# 2026-11-26 (commit 0fb29bf), measured before the CP rows' gathers became row maps and before cuDNN's indexer
# ran under CP.
CP_RATIOS = (
    CpPoint("C", 32768, 2, 0.523, 0.541),
    CpPoint("C", 32768, 4, 0.301, 0.285),
    CpPoint("C", 131072, 2, 0.503, 0.530),
    CpPoint("C", 131072, 4, 0.255, 0.269),
    CpPoint("H", 32768, 2, 0.545, 0.535),
    CpPoint("H", 32768, 4, 0.340, 0.282),
    CpPoint("H", 131072, 2, 0.524, 0.528),
    CpPoint("H", 131072, 4, 0.261, 0.268),
)
# 4×H200, 2026-11-27 (later), commit f611024 + the vendor stack: `context_parallel.py --kind H|C --cp 4 --seq-len
# 32768 --repeats 5 --cuda-graph`, every layout's steps replayed as CUDA graphs (CP-1 too). Eager in the same
# call: H 0.305, C 0.311 (the host-bound points of CP_RATIOS). They fit the graphed fixed cost only.
GRAPH_CP_RATIOS = (
    CpPoint("C", 32768, 4, 0.266, 0.284),
    CpPoint("H", 32768, 4, 0.268, 0.282),
)
# Same box and tree, `--kind C --tp 2 --cp 2` (TP-2 × CP-2 on 4 GPUs, no sequence parallelism): a check, not
# fitted. The model prices TP with SP's collectives; without SP the same bytes move as all-reduces.
TP_CP_CHECKS = (
    CpPoint("C", 32768, 2, 0.520, 0.384, tp=2),
    CpPoint("C", 131072, 2, 0.492, 0.362, tp=2),
)


def calibrate(dims: Dims, rates: Rates = Rates(), cp_points: Sequence[CpPoint] = CP_RATIOS) -> Fitted:
    """Fit the model's five free numbers: the per-token remainder of each kind from its S = 4096 H200 step
    (three numbers, three points: reproduced exactly), then the CP slowdown and host cost by least squares
    on the CP time ratios `cp_points` (two numbers, eight points). Everything else is a measured kernel rate
    or an assumption."""
    h200 = GPUS["H200"]
    zero = Fitted({kind: 0.0 for kind in KINDS}, 1.0, 0.0)
    other = {}
    for point in (p for p in STEP_MS if p.fit):
        bare = predict(Setup(h200, point.kind, point.seq_len), dims, zero, rates)
        other[point.kind] = (point.value - bare.step_ms) / point.seq_len * 1e3
    single = Fitted(other, 1.0, 0.0)
    # ratio = (base + s·attention + h) / t1: linear in (s, h); solve the 2×2 normal equations.
    rows = []
    for point in cp_points:
        one, plain = point_predictions(point, dims, single, rates)
        t1 = one.step_ms
        attention = plain.work["sparse attention"] + plain.work.get("indexer loss", 0.0)
        rows.append(((attention / t1, 1 / t1), point.time_ratio - (plain.step_ms - attention) / t1))
    a11 = sum(x[0] * x[0] for x, _ in rows)
    a12 = sum(x[0] * x[1] for x, _ in rows)
    a22 = sum(x[1] * x[1] for x, _ in rows)
    b1 = sum(x[0] * y for x, y in rows)
    b2 = sum(x[1] * y for x, y in rows)
    det = a11 * a22 - a12 * a12
    return Fitted(other, (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det)


def fit_graph_host(fitted: Fitted, dims: Dims, rates: Rates = Rates(),
                   points: Sequence[CpPoint] = GRAPH_CP_RATIOS) -> Fitted:
    """`fitted` for steps replayed as CUDA graphs (`make_graphed_layers`), where the host no longer issues each
    op: `cp_host_ms` refitted on the graph-replay CP time ratios `points` (one number: ratio = (base + h) / t1,
    least squares in h), the slowdown and the per-token remainders kept."""
    rows = []
    hostless = replace(fitted, cp_host_ms=0.0)
    for point in points:
        one, many = point_predictions(point, dims, hostless, rates)
        rows.append((1 / one.step_ms, point.time_ratio - many.step_ms / one.step_ms))
    return replace(fitted, cp_host_ms=sum(x * y for x, y in rows) / sum(x * x for x, _ in rows))


def single_gpu_peak_mib(prediction: Prediction) -> float:
    """What the benchmarks' peak counts: kept + transient activations and the gradients (no entries gather)."""
    m = prediction.memory
    return m["kept activations"] + m["backward transient"] + m["parameter gradients (bf16)"]


def calibration_table(dims: Dims, fitted: Fitted) -> str:
    lines = ["One GPU, one layer, fwd + bwd:", "",
             "| GPU | kind | S | measured | predicted | error | source | role |",
             "|---|---|--:|--:|--:|--:|---|---|"]
    for point in STEP_MS:
        predicted = predict(Setup(GPUS[point.gpu], point.kind, point.seq_len), dims, fitted).step_ms
        lines.append(f"| {point.gpu} | {point.kind} | {point.seq_len} | {point.value:.2f} ms | {predicted:.2f} ms | "
                     f"{relative_error(predicted, point.value)} | {point.source} | {role(point)} |")
    for point in PEAK_MIB:
        predicted = single_gpu_peak_mib(predict(Setup(GPUS[point.gpu], point.kind, point.seq_len), dims, fitted))
        lines.append(f"| {point.gpu} | {point.kind} | {point.seq_len} | {point.value:.0f} MiB | {predicted:.0f} MiB | "
                     f"{relative_error(predicted, point.value)} | {point.source} | {role(point)} |")
    lines += ["", "TP × CP-N against TP-1 × CP-1 on the same H200 box (zigzag, p2p, eager):", "",
              "| kind | S | TP | CP | time ratio measured | predicted | error | error, point left out of the fit | "
              "memory ratio measured | predicted | error |",
              "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for point in CP_RATIOS + TP_CP_CHECKS:
        time_ratio, memory_ratio = cp_ratios(point, dims, fitted)
        if point in CP_RATIOS:
            without = calibrate(dims, cp_points=[other for other in CP_RATIOS if other is not point])
            left_out = relative_error(cp_ratios(point, dims, without)[0], point.time_ratio)
        else:
            left_out = "check, not fitted"
        lines.append(f"| {point.kind} | {point.seq_len} | {point.tp} | {point.cp} | {point.time_ratio:.3f} | "
                     f"{time_ratio:.3f} | {relative_error(time_ratio, point.time_ratio)} | {left_out} | "
                     f"{point.memory_ratio:.3f} | {memory_ratio:.3f} | "
                     f"{relative_error(memory_ratio, point.memory_ratio)} |")
    graphed = fit_graph_host(fitted, dims)
    lines += ["", "CP-N against CP-1, every step a CUDA-graph replay (fits the graphed fixed cost only):", "",
              "| kind | S | CP | time ratio measured | predicted (graphed) | error | predicted eager |",
              "|---|--:|--:|--:|--:|--:|--:|"]
    for point in GRAPH_CP_RATIOS:
        time_ratio = cp_ratios(point, dims, graphed)[0]
        lines.append(f"| {point.kind} | {point.seq_len} | {point.cp} | {point.time_ratio:.3f} | {time_ratio:.3f} | "
                     f"{relative_error(time_ratio, point.time_ratio)} | {cp_ratios(point, dims, fitted)[0]:.3f} |")
    other = ", ".join(f"{kind} {us:.3f}" for kind, us in fitted.other_us_per_token.items())
    lines += ["", f"fitted: other µs per token (H200) {other}"
              + f" (S = 4096 steps); CP attention-side slowdown {fitted.cp_attention_slowdown:.2f}, CP host "
              f"{fitted.cp_host_ms:.2f} ms per step (the {len(CP_RATIOS)} TP-1 time ratios; the memory ratios and the "
              f"TP × CP points are not fitted); graphed CP fixed cost {graphed.cp_host_ms:.2f} ms per step (the "
              f"{len(GRAPH_CP_RATIOS)} graph-replay ratios)"]
    return "\n".join(lines)


def point_predictions(point: CpPoint, dims: Dims, fitted: Fitted,
                      rates: Rates = Rates()) -> tuple[Prediction, Prediction]:
    """What a CP point's ratios compare, on the H200 it was measured on: TP-1 × CP-1, and its own TP × CP."""
    h200 = GPUS["H200"]
    return (predict(Setup(h200, point.kind, point.seq_len), dims, fitted, rates),
            predict(Setup(h200, point.kind, point.seq_len, point.cp, point.tp), dims, fitted, rates))


def cp_ratios(point: CpPoint, dims: Dims, fitted: Fitted) -> tuple[float, float]:
    one, many = point_predictions(point, dims, fitted)
    peak = lambda p: single_gpu_peak_mib(p) + p.memory["gathered entries (+ gradient)"]  # noqa: E731
    return many.step_ms / one.step_ms, peak(many) / peak(one)


def relative_error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.1f}%"


def role(point: StepPoint) -> str:
    return "fit" if point.fit else "check"


# ---------------------------------------------------------------- where the gathers stop hiding
def hiding_limit(dims: Dims, fitted: Fitted, gpu: Gpu, kind: str, cp: int, tp: int = 1,
                 longest: int = 1 << 24) -> Optional[int]:
    """Rows per rank (S/cp) below which the forward's entry gathers take longer than the compute queued
    behind them, at this `cp`: 0 if they hide at every S, None if at none up to `longest`."""
    hidden = lambda seq_len: predict(Setup(gpu, kind, seq_len, cp, tp), dims, fitted).hidden  # noqa: E731
    step = 2 * cp * max(tp, dims.ratios[kind] or 1)
    low, high = 1, longest // step  # in multiples of `step`
    if hidden(low * step):
        return 0
    if not hidden(high * step):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if hidden(middle * step) else (middle, high)
    return high * step // cp


def comm_share(dims: Dims, fitted: Fitted, gpu: Gpu, kind: str, seq_len: int, cp: int, tp: int = 1) -> float:
    """Fraction of the step spent waiting for communication."""
    prediction = predict(Setup(gpu, kind, seq_len, cp, tp), dims, fitted)
    return prediction.comm_exposed_ms / prediction.step_ms


# ---------------------------------------------------------------- command line
def prediction_table(gpu: Gpu, pattern: str, layers: int, seq_lens: Sequence[int], cps: Sequence[int],
                     tps: Sequence[int], dims: Dims, fitted: Fitted, bytes_per_parameter: float,
                     recompute: bool, graphs: bool = False) -> str:
    kinds = (pattern * layers)[:layers]
    shown = kinds if len(kinds) <= 12 else kinds[:12] + "…"
    lines = [f"{gpu.name}, {layers} layer(s) {shown}, fwd + bwd, B = 1, bf16"
             f"{', CUDA-graph replays' if graphs else ', eager'} (CP fixed cost {fitted.cp_host_ms:.2f} ms per layer); "
             f"memory with {bytes_per_parameter:g} B per parameter{', attention recomputed' if recompute else ''}",
             "",
             "| S | CP | TP | S/CP | step ms | exposed comm ms | CP host ms | essential TFLOPS per GPU | "
             "unhidden gather ms | GiB per rank | of which parameters + optimizer | fits |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for seq_len in seq_lens:
        for cp in cps:
            for tp in tps:
                try:
                    stack = predict_stack(kinds, gpu, seq_len, cp, tp, dims, fitted, bytes_per_parameter, recompute)
                except ValueError as error:
                    lines.append(f"| {seq_len} | {cp} | {tp} | – | {error} | | | | | | | |")
                    continue
                lines.append(f"| {seq_len} | {cp} | {tp} | {seq_len // cp} | {stack.step_ms:.1f} | "
                             f"{stack.comm_exposed_ms:.2f} | {stack.host_ms:.1f} | {stack.tflops:.0f} | "
                             f"{stack.unhidden_gather_ms:.2f} | {stack.memory_gib:.1f} | {stack.parameters_gib:.1f} | "
                             f"{'yes' if stack.memory_gib <= gpu.memory_gib else 'no'} |")
    return "\n".join(lines)


def hiding_table(dims: Dims, fitted: Fitted) -> str:
    lines = ["Forward entry gathers against the compute queued behind them, and the share of the step spent "
             "waiting for communication (the halo exchange and the backward reduce-scatter never overlap):", "",
             "| GPU | kind | CP | link | gathers hide down to S/CP | comm share at S/CP = 1024 | at 8192 | at 65536 |",
             "|---|---|--:|---|--:|--:|--:|--:|"]
    for gpu in GPUS.values():
        for kind in ("C", "H"):
            for cp in (8, 64):
                link = "NVLink" if cp <= gpu.gpus_per_node else "NIC"
                limit = hiding_limit(dims, fitted, gpu, kind, cp)
                shares = [f"{comm_share(dims, fitted, gpu, kind, per_rank * cp, cp) * 100:.1f}%"
                          for per_rank in (1024, 8192, 65536)]
                shown = "never hidden" if limit is None else limit
                lines.append(f"| {gpu.name} | {kind} | {cp} | {link} | {shown} | " + " | ".join(shares) + " |")
    return "\n".join(lines)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    parser.add_argument("--kind", default="C", help="a layer kind (W, C, H) or a pattern repeated to --layers, e.g. HC")
    parser.add_argument("--layers", type=positive, default=1)
    parser.add_argument("--seq-len", type=positive, nargs="+", default=[131072])
    parser.add_argument("--cp", type=positive, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tp", type=positive, nargs="+", default=[1])
    parser.add_argument("--preset", default="dsv4-flash")
    parser.add_argument("--bytes-per-parameter", type=float, default=18.0,
                        help="parameter + gradient + optimizer bytes per parameter on a rank")
    parser.add_argument("--recompute", action="store_true", help="recompute_attention: keep only the input rows")
    parser.add_argument("--calibration", action="store_true", help="predicted against measured, every point")
    parser.add_argument("--hiding", action="store_true", help="where the entry gathers stop hiding")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="price the steps as CUDA-graph replays: the fixed CP cost fitted on graph-replay ratios")
    args = parser.parse_args(argv)
    if not args.kind or set(args.kind) - set(KINDS):
        parser.error(f"--kind must be made of {', '.join(KINDS)} (M is not modelled), got {args.kind!r}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    dims = Dims.from_preset(args.preset)
    fitted = calibrate(dims)
    if args.cuda_graph:
        fitted = fit_graph_host(fitted, dims)
    if args.calibration:
        print(calibration_table(dims, fitted))
    elif args.hiding:
        print(hiding_table(dims, fitted))
    else:
        print(prediction_table(GPUS[args.gpu], args.kind, args.layers, args.seq_len, args.cp, args.tp, dims,
                               fitted, args.bytes_per_parameter, args.recompute, args.cuda_graph))
    return 0


if __name__ == "__main__":
    sys.exit(main())
