"""The `cudnn` backend: NVIDIA cuDNN frontend (`nvidia-cudnn-frontend >= 1.32`, `from cudnn import DSA`).

* `sparse_attention_bwd`: `DSA.sparse_attention_backward_wrapper` (CuTe DSL; SM90 and SM100).
  Our rows are already flat with global kv ids. The kernel takes the natural-log, sink-free LSE our
  forward returns, and the plain softmax scale (it applies log2(e) itself: passing a pre-multiplied
  scale would apply it twice, bug class A2.1; the GPU test with a non-default scale catches that).
  It has no LSE-gradient input, so it declines calls whose `lse_grad` is set.
* `sparse_attention_fwd` (SM100 only): `DSA.sparse_attention_forward_wrapper` (CuTe DSL). It returns
  the LSE the backward takes (natural log, sink-free), so either backward follows it. Never run on
  its GPU here (ours are SM90), only against a CPU fake: a one-time self-test against the reference
  guards each call class before it serves one (see `sparse_attention_forward`).
* `indexer_kl_bwd` (sparse indexer loss): `DSA.indexer_backward_wrapper`, the KL gradient fused
  into the indexer-scores backward; per-row loss weights enter through the target (see there).
* `indexer_loss` (sparse indexer loss, no tensor parallelism, SM90): the teacher target from
  `DSA.sparse_attn_score_recompute_wrapper`, the per-row KL from Triton's KL kernel where Triton
  runs, else the torch one (see `indexer_loss`).
* `indexer_scores` (the selection's scoring of every visible entry): `DSA.indexer_forward_wrapper`, the
  dense ratio-causal indexer forward, for uniform batches and a CP rank's rows of an SBHD batch (the
  layer passes their structure as the op's `visible` hint; anything else goes to the kernels that read
  candidate ids). Forward only.
* `topk`: `DSA.indexer_top_k_wrapper` (radix top-k, SM90+, k <= 2048), post-processed to the exact
  `ops.indices.topk_columns` contract (−1 padding, highest first, ties to the lower column) by one
  Triton kernel where Triton runs (`triton_kernels.topk_order`), else by a torch sort.
* `dense_attention` (`M` kind): torch's bundled cuDNN SDPA kernel (the aten op behind
  `SDPBackend.CUDNN_ATTENTION`, which handles qk/v dims 192/128 on Hopper). It needs no frontend
  package; it serves whole-sequence batches (`TokenLayout.uniform`) and has no LSE gradient.

The package is imported lazily and only after the probe said it imports; JIT compilation happens at
the first call of each kernel shape.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_dsa.backends import probes
from megatron_dsa.backends.dense_layout import batched_dense_attention
from megatron_dsa.backends.registry import Backend, OpFamily, register_backend
from megatron_dsa.backends.sparse_layout import (
    empty_rows,
    heads_problem,
    kernel_ids,
    kv_rows_problem,
    pad_heads,
    padded_heads,
    padded_row_chunks,
    rows_in_chunks,
)
from megatron_dsa.backends.triton_kernels.availability import triton_decline_reason
from megatron_dsa.backends.triton_kernels.indexer_loss import kl_per_row as triton_kl_per_row
from megatron_dsa.backends.triton_kernels.kl_slots import kl_slots as triton_kl_slots
from megatron_dsa.backends.triton_kernels.topk_order import order_picks
from megatron_dsa.device_cache import DeviceCache, device_scalar
from megatron_dsa.ops.indexer_loss import KLFn, indexer_kl, kl_per_row
from megatron_dsa.ops.indices import SegmentedVisibleRows, UniformVisibleRows, VisibleStructure, prefix_valid
from megatron_dsa.ops.precision import compute_dtype
from megatron_dsa.ops.sparse_attention import sparse_attention_forward as reference_sparse_forward
from megatron_dsa.parallel.state import group_size

PACKAGE = "cudnn"
DISTRIBUTION = "nvidia-cudnn-frontend"
MIN_VERSION = (1, 32)
INSTALL_HINT = "install the [cudnn] extra (pip install 'megatron_dsa[cudnn]')"
SPARSE_HEAD_DIM = 512  # our V is the whole KV row; the kernel's D=576 mode uses only 512 dims as V
TOPK_MAX = 2048
TOPK_COLUMN_ALIGNMENT = 8  # rows of 32 bytes in float32
INDEXER_BLOCK = 128  # the indexer backward's top-k block (SM90 asserts top-k % 128 == 0)
INDEXER_MIN_HEADS = 64  # SM90 asserts at least 64 indexer heads (fewer are padded with zero weights)
INDEXER_HEAD_DIM = 128
INDEXER_ROW_CHUNK = 32768  # query rows per call (the kernel's grid limit, as Megatron chunks them)
INDEXER_FORWARD_HEADS = (16, 32, 64)  # query heads per key head the SM90 indexer forward is built for
# Index tensors of uniform-batch rows (segment bounds, visible counts): built by a few small ops from
# host ints, the same for every layer and step of a layout, so they are kept.
_UNIFORM_ROWS_INDEX: DeviceCache[Any] = DeviceCache(max_entries=256)


def _dsa() -> Any:
    return probes.load(PACKAGE).DSA


@functools.lru_cache(maxsize=None)
def package_problem() -> Optional[str]:
    """None when the frontend package imports and is new enough for `cudnn.DSA` (checked once per process;
    each op's wrapper is checked by `wrapper_problem`)."""
    problem = probes.import_problem(PACKAGE, INSTALL_HINT)
    if problem is not None:
        return problem
    version = probes.distribution_version(DISTRIBUTION) or getattr(probes.load(PACKAGE), "__version__", "")
    if probes.version_tuple(version) < MIN_VERSION:
        return f"{DISTRIBUTION} {version or '(unknown version)'} is older than 1.32 (no DSA kernels); {INSTALL_HINT}"
    return None


# The DSA wrapper behind each op family (the dense kind uses torch's own cuDNN SDPA instead).
WRAPPERS = {OpFamily.SPARSE_ATTENTION_FWD: "sparse_attention_forward_wrapper",
            OpFamily.SPARSE_ATTENTION_BWD: "sparse_attention_backward_wrapper",
            OpFamily.TOPK: "indexer_top_k_wrapper",
            OpFamily.INDEXER_SCORES: "indexer_forward_wrapper",
            OpFamily.INDEXER_KL_BWD: "indexer_backward_wrapper",
            OpFamily.INDEXER_LOSS: "sparse_attn_score_recompute_wrapper"}


@functools.lru_cache(maxsize=None)
def wrapper_problem(wrapper: str) -> Optional[str]:
    """None when `cudnn.DSA.<wrapper>` is usable (checked once per wrapper). DSA is a lazy namespace:
    touching a wrapper imports its CuTe-DSL module now, at the probe, not mid-backward."""
    try:
        getattr(_dsa(), wrapper)
    except Exception as error:  # noqa: BLE001 - a missing CuTe DSL shows up as any import error
        return f"cudnn.DSA.{wrapper} not usable ({type(error).__name__}: {error}); {INSTALL_HINT}"
    return None


def _index_alignment(device: torch.device) -> int:
    """Top-k width tile of the backward kernel: 128 on SM90, 64 on SM100."""
    capability = probes.cuda_capability(device)
    return 128 if capability is None or capability[0] == 9 else 64


# ---------------------------------------------------------------- sparse attention backward
def sparse_attention_backward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                              out: Tensor, lse: Tensor, grad_out: Tensor,
                              grad_lse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The `sparse_attention_bwd` contract on `DSA.sparse_attention_backward_wrapper`.

    Heads are padded to 64/128 with zero queries, zero output gradients and −inf sinks (a −inf sink
    has no mass, so the padding heads contribute nothing to dkv). Rows without keys get a finite
    stand-in LSE; their `out` is exactly 0 (the forward contract), so `<dO, O> = 0` gives them a zero
    sink gradient, and with no indices they add nothing to dq or dkv, as in the reference. With all
    64/128 heads neither `out` nor `grad_out` is copied (one full `[N, H, D]` pass each, 0.35 ms at
    S=4096 on an H200); fewer heads are padded a chunk of rows at a time (`padded_row_chunks`).
    """
    if grad_lse is not None:
        raise ValueError("the cuDNN sparse backward has no lse-gradient input (the probe declines it)")
    rows, heads, head_dim = query.shape
    width = padded_heads(heads)
    empty = torch.isneginf(lse)  # [N, H]: rows without keys (our forward's contract)
    lse = torch.where(empty, 0.0, lse.float())
    kv, padded_sink = kv.contiguous(), pad_heads(sink.float(), width, float("-inf"))
    ids = kernel_ids(indices, kv.shape[0], _index_alignment(query.device))

    def run(chunk: slice) -> tuple[Tensor, Tensor, Tensor]:
        result = _dsa().sparse_attention_backward_wrapper(
            pad_heads(query[chunk], width),
            kv,
            pad_heads(out[chunk].to(query.dtype), width),
            pad_heads(grad_out[chunk].to(query.dtype), width),
            pad_heads(lse[chunk], width),
            padded_sink,
            ids[chunk],
            softmax_scale=float(scale),
        )
        return result["dq"][:, :heads], result["dkv"], result["d_sink"][:heads]

    chunks = padded_row_chunks(rows, heads, head_dim)
    if len(chunks) == 1:
        grad_query, grad_kv, grad_sink = run(chunks[0])
    else:  # padded heads, chunk by chunk: the key and sink gradients summed over the chunks in compute dtype
        grad_query, grad_kv, grad_sink = query.new_empty(query.shape), 0, 0
        for chunk in chunks:
            grad_query[chunk], chunk_kv, chunk_sink = run(chunk)
            grad_kv = chunk_kv.to(compute_dtype(chunk_kv.dtype)) + grad_kv
            grad_sink = chunk_sink.to(compute_dtype(chunk_sink.dtype)) + grad_sink
    return grad_query.to(query.dtype), grad_kv.to(kv.dtype), grad_sink.to(sink.dtype)


def _sparse_problem(call: Mapping[str, Any]) -> Optional[str]:
    """What the sparse forward and backward kernels share: bf16/fp16, D = 512 (the D = 576 mode uses only
    512 dims as V), 64/128 heads, int32 ids."""
    heads = call.get("heads")
    return probes.first_problem(
        probes.dtype_problem(call, (torch.bfloat16, torch.float16)),
        probes.head_dim_problem(call, SPARSE_HEAD_DIM),
        heads_problem(heads) if heads is not None else None,
        kv_rows_problem(call),
    )


def _sparse_backward_problem(call: Mapping[str, Any]) -> Optional[str]:
    return probes.first_problem(
        "the kernel has no lse-gradient input (lse_grad needed)" if call.get("lse_grad") else None,
        _sparse_problem(call),
    )


# ---------------------------------------------------------------- sparse attention forward (SM100)
FORWARD_TOPK_TILE = 64  # the SM100 forward reads ids 64 slots at a time (any count of tiles)
# The self-test: |out| <= 1 (kv in [-1, 1]); the kernel rounds P and out to 16 bits (each <= 2^-9
# relative), so a correct kernel is within about 2^-8 of the float32 reference; 2^-6 is four times that.
# The lse is float32 from the same rounded inputs (only summation order differs, ~1e-6). On this problem
# a missing or doubled sink, a base-2 lse, an lse with the sink or a scale applied with log2(e) moves out
# by >= 0.16 or the lse by >= 0.7 (any head count).
SELF_TEST_SCALE = 0.09  # not 1/sqrt(D) (the kernel's default); logits of about unit size at D = 512
SELF_TEST_OUT_TOLERANCE = 2.0 ** -6
SELF_TEST_LSE_TOLERANCE = 1e-3
SELF_TEST_EMPTY_ROW = 1


def sparse_attention_forward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                             scale: float) -> tuple[Tensor, Tensor]:
    """The `sparse_attention_fwd` contract on `DSA.sparse_attention_forward_wrapper` (SM100).

    query `[N, H, D]`, kv `[M, D]`, indices `[N, K]`, sink `[H]` → out `[N, H, D]` (query dtype), lse
    `[N, H]` float32. Heads are padded to 64/128 with zero queries and −inf sinks (the kernel adds the
    sink to the output's normaliser only: a −inf sink changes nothing; a chunk of rows at a time,
    `padded_row_chunks`); ids become int32 with −1 at
    every invalid slot, padded with −1 to the 64-slot tile; the scale goes in plain (the kernel applies
    log2(e) itself). The kernel's LSE is natural-log and sink-free, as ours; rows without a valid id
    come back with out 0 and lse +inf, which becomes −inf.
    """
    rows, heads, head_dim = query.shape
    width = padded_heads(heads)
    ids = kernel_ids(indices, kv.shape[0], FORWARD_TOPK_TILE)
    padded_sink = pad_heads(sink.float(), width, float("-inf"))

    def run(chunk: slice) -> tuple[Tensor, Tensor]:
        result = _dsa().sparse_attention_forward_wrapper(pad_heads(query[chunk], width), kv, ids[chunk],
                                                         attn_sink=padded_sink, softmax_scale=float(scale))
        return result["out"][:, :heads], result["lse"][:, :heads]

    out, lse = rows_in_chunks(run, padded_row_chunks(rows, heads, head_dim), rows)
    empty = empty_rows(indices, kv.shape[0]).unsqueeze(1)
    return out.contiguous(), torch.where(empty, float("-inf"), lse)


def _sparse_forward_problem(call: Mapping[str, Any]) -> Optional[str]:
    """Why the SM100 sparse forward cannot take `call` (None: it can; its self-test passed where the
    call names its class). The kernel has no top-k limit (its wrapper takes any number of slots)."""
    return probes.first_problem(
        probes.gpu_problem(call, (10,), "cuDNN's sparse forward (built for SM100 only)"),
        _sparse_problem(call),
    ) or _self_test_problem(call)


def _self_test_problem(call: Mapping[str, Any]) -> Optional[str]:
    device, dtype, heads, head_dim = (call.get(key) for key in ("device", "dtype", "heads", "head_dim"))
    if device is None or dtype is None or heads is None or head_dim is None:
        return None  # no call yet (layer construction, `info`): nothing to test with
    device = probes.canonical_device(device)
    return probes.kept_self_test("cuDNN's sparse forward", ("cudnn sparse_attention_forward", device, dtype, heads,
                                                             head_dim),
                                 device, lambda: _sparse_forward_self_test(device, dtype, heads, head_dim),
                                 f"{device}, {dtype}, {heads} heads, head dim {head_dim}")


def _sparse_forward_self_test(device: torch.device, dtype: torch.dtype, heads: int,
                              head_dim: int) -> Optional[str]:
    """None when `sparse_attention_forward` agrees with the reference on a tiny problem of this call
    class, else why not (kept per class by `probes.kept_self_test`, which also turns an exception into
    the verdict).

    Why: this adapter was written from the kernel's source and has only run against a CPU fake of it;
    no SM100 GPU was at hand to run it on. Its lse goes to the backward as is (cuDNN's and Triton's
    take the natural-log, sink-free lse), so the lse is checked as tightly as float32 allows, and the
    row without keys must give out exactly 0 (the cuDNN backward relies on it). Tolerances: above.
    """
    query, kv, indices, sink = _self_test_inputs(device, dtype, heads, head_dim)
    out, lse = sparse_attention_forward(query, kv, indices, sink, SELF_TEST_SCALE)
    out_ref, lse_ref = reference_sparse_forward(query.float(), kv.float(), indices, sink, SELF_TEST_SCALE)
    out_error, lse_error = probes.max_difference(out, out_ref), probes.max_difference(lse, lse_ref)
    empty_out = float(out[SELF_TEST_EMPTY_ROW].abs().max())
    if out_error <= SELF_TEST_OUT_TOLERANCE and lse_error <= SELF_TEST_LSE_TOLERANCE and empty_out == 0.0:
        return None
    return (f"cuDNN's sparse forward failed its self-test against the reference (max |Δout| {out_error:.3g}, "
            f"|Δlse| {lse_error:.3g}, |out| of the row without keys {empty_out:.3g}; tolerances "
            f"{SELF_TEST_OUT_TOLERANCE:.3g}, {SELF_TEST_LSE_TOLERANCE:.3g}, 0); please report")


def _self_test_inputs(device: torch.device, dtype: torch.dtype, heads: int,
                      head_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """4 query rows over 8 kv rows in `[−1, 1]`, 6 slots (not a whole tile): repeated ids, −1, ids ≥ M
    and below −1, and row `SELF_TEST_EMPTY_ROW` without a valid id; sinks from 1.5 down to −1.5."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(4, heads, head_dim, generator=gen).to(device, dtype)
    kv = (torch.rand(8, head_dim, generator=gen) * 2 - 1).to(device, dtype)
    indices = torch.tensor([[3, 3, 5, -1, 8, 0],
                            [-1, 8, -2, -1, 11, -1],
                            [7, 6, 5, 4, 3, 2],
                            [1, -1, 1, -1, 1, 0]], device=device)
    sink = torch.linspace(1.5, -1.5, heads, device=device)
    return query, kv, indices, sink


# ---------------------------------------------------------------- indexer scores (dense, ratio-causal)
def indexer_scores(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, scale: float,
                   visible: Optional[VisibleStructure] = None) -> Tensor:
    """The `indexer_scores` contract on `DSA.indexer_forward_wrapper`, for the rows `visible` describes.

    The kernel scores every entry of a sequence densely (THD: one segment of query rows and one of keys
    per run, `q_causal_offsets` = the position of each segment's first row, so a chunk may start
    mid-sequence) and writes −inf past the ratio-causal limit `(offset + row + 1) // ratio`, our visibility
    rule; its column j is entry j of the row's sequence, which is our candidate column j. `sm_scale`
    multiplies `Σ_h ReLU(<q_h, k>)·w_h` once, as our `scale`. A uniform batch's segments are the sequences
    the rows touch, over keys that already lie in sequence order; row segments (`SegmentedVisibleRows`, a CP
    rank's pieces) bring their tensors and the rows of their keys, gathered once per segment. Index tensors
    are made on the device from host ints (no host-to-device copy, no sync) and kept per row structure.
    Forward only: the selection needs no gradient.
    """
    if visible is None:
        raise ValueError("the cuDNN indexer forward needs the visible-entry structure (`visible`)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, weights)):
        raise ValueError("the cuDNN indexer forward has no backward; call it without autograd")
    rows = q.shape[0]
    segmented = isinstance(visible, SegmentedVisibleRows)
    entries = visible.keys if segmented else visible.entries
    expected_rows = visible.num_rows if segmented else visible.stop - visible.start
    if rows != expected_rows or candidates.shape != (rows, entries):
        raise ValueError(f"indexer rows {rows} / candidates {tuple(candidates.shape)} do not match the visible "
                         f"structure's {expected_rows} rows with {entries} entries each")
    if rows == 0 or entries == 0:
        return torch.full((rows, entries), float("-inf"), dtype=torch.float32, device=q.device)
    if segmented:
        keys, max_rows = k.index_select(0, visible.key_rows), visible.max_rows
        cu_seqlens_q, cu_seqlens_k, q_causal_offsets = visible.cu_rows, visible.cu_keys, visible.first_positions
    else:
        first, last = visible.start // visible.seqlen, (visible.stop - 1) // visible.seqlen
        keys, max_rows = k[first * entries:(last + 1) * entries], min(visible.seqlen, rows)
        cu_seqlens_q, cu_seqlens_k, q_causal_offsets = _indexer_segments(visible, q.device)
    result = _dsa().indexer_forward_wrapper(
        q.contiguous(), keys.unsqueeze(1), weights.contiguous(), ratio=visible.ratio, sm_scale=float(scale),
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_rows, max_seqlen_k=entries,
        q_causal_offsets=q_causal_offsets)
    # The kernel's −inf past the ratio-causal limit is exactly where the candidates are −1 (either structure
    # has no other gaps): its scores are returned as they are.
    return result["scores"]


def _indexer_segments(visible: UniformVisibleRows, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """`(cu_seqlens_q, cu_seqlens_k, q_causal_offsets)` int32 of the THD call scoring the rows `visible`
    describes: one segment per sequence the rows touch, each starting at its first row in the chunk."""
    def build() -> tuple[Tensor, Tensor, Tensor]:
        rows, seqlen = visible.stop - visible.start, visible.seqlen
        first, last = visible.start // seqlen, (visible.stop - 1) // seqlen
        segment = torch.arange(last - first + 2, dtype=torch.int32, device=device)
        return ((segment * seqlen + (first * seqlen - visible.start)).clamp_(0, rows), segment * visible.entries,
                (visible.start - (first + segment[:-1]) * seqlen).clamp_(min=0))

    return _UNIFORM_ROWS_INDEX.get(("indexer_segments", visible, torch.device(device)), device, build)


def _visible_counts(visible: UniformVisibleRows, device: torch.device) -> Tensor:
    """`[n]` int32 visible entries of each row `visible` describes, `(position + 1) // ratio` (a prefix of
    its columns)."""
    def build() -> Tensor:
        positions = torch.arange(visible.start, visible.stop, device=device) % visible.seqlen
        return ((positions + 1) // visible.ratio).to(torch.int32)

    return _UNIFORM_ROWS_INDEX.get(("visible_counts", visible, torch.device(device)), device, build)


def _indexer_scores_problem(call: Mapping[str, Any]) -> Optional[str]:
    heads, ratio = call.get("heads"), call.get("ratio")
    return probes.first_problem(
        # Unknown (no call yet: the layer-construction check) is not a decline; a call without it is.
        "needs the visible-entry structure (a uniform batch's or an SBHD batch's CP row segments; the kernel "
        "scores whole sequences)" if call.get("visible") is False else None,
        probes.dtype_problem(call, (torch.bfloat16,)),
        probes.head_dim_problem(call, INDEXER_HEAD_DIM, "indexer head dim"),
        f"{heads} indexer heads unsupported (needs one of {INDEXER_FORWARD_HEADS})"
        if heads is not None and heads not in INDEXER_FORWARD_HEADS else None,
        # A 32-head tile packs 4 query rows but masks only its last 64-key block per element: below ratio
        # 3 those rows' visible limits can straddle a block edge.
        f"32 indexer heads with compression ratio {ratio} (the SM90 kernel's tile masking needs ratio >= 3)"
        if heads == 32 and ratio is not None and ratio < 3 else None,
    )


# ---------------------------------------------------------------- top-k
def topk(scores: Tensor, valid: Optional[Tensor], k: int, visible: Optional[UniformVisibleRows] = None,
         counts: Optional[Tensor] = None, ordered: bool = True) -> Tensor:
    """The `ops.indices.topk_columns` contract on `DSA.indexer_top_k_wrapper`.

    scores `[T, C]`, valid `[T, C]` → `[T, min(k, C)]` int64 columns, highest score first, ties to the
    lower column, −1 where fewer than k are valid. The kernel scans columns `[0, seq_len)` of each row,
    so seq_len is the last valid column + 1 and invalid columns inside it are −inf; its picks are
    then re-checked against `valid` and put in our order (the kernel does not promise an order). A
    valid column scoring −inf ties there with the invalid ones before it, so with gaps in `valid` it may
    lose its place to one and come back −1 (the layer's masks are prefixes: no gaps).
    With `visible` (uniform-batch rows) the valid columns are a prefix of known length, kept per
    layout, and with `counts [T]` (`valid[t]` is the prefix `[0, counts[t])`, as in a decode step) a prefix
    of given length: the kernel scans each row's prefix only, so the scores go in as they are, four or five
    small ops fewer per call. With counts and `ordered=False` (a decode step) the kernel's picks are returned
    as they come: it scans only the valid prefix, so every pick in it is valid and the attention ignores the
    rest (the order kernel took about as long as the top-k itself); `valid` may then be None (`prefix_valid`
    builds it where the order needs it).
    """
    rows, cols = scores.shape
    width = min(k, cols)
    if visible is not None and (rows != visible.stop - visible.start or cols != visible.entries):
        raise ValueError(f"top-k scores {tuple(scores.shape)} do not match the visible rows "
                         f"{visible.start}:{visible.stop} with {visible.entries} entries each")
    if rows == 0 or width == 0:
        return torch.full((rows, width), -1, dtype=torch.long, device=scores.device)
    if visible is not None:  # the uniform structure's counts, kept per layout
        counts = _visible_counts(visible, scores.device)
    if counts is not None:
        ranked, seq_lens = scores.float(), counts.to(torch.int32)
    else:
        valid = prefix_valid(valid, counts, cols)  # the error when neither is given
        ranked = torch.where(valid, scores.float(), float("-inf"))
        seq_lens = torch.where(valid, torch.arange(1, cols + 1, device=scores.device), 0).amax(1).to(torch.int32)
    if cols % TOPK_COLUMN_ALIGNMENT:
        ranked = torch.nn.functional.pad(ranked, (0, TOPK_COLUMN_ALIGNMENT - cols % TOPK_COLUMN_ALIGNMENT),
                                         value=float("-inf"))
    picked = _dsa().indexer_top_k_wrapper(ranked, seq_lens, width, next_n=1, return_val=False,
                                          deterministic=True)["indices"]
    if counts is not None and not ordered:
        return picked.long()
    valid = prefix_valid(valid, counts, cols)
    if triton_decline_reason(scores.device) is None:  # one kernel instead of the torch sort below
        return order_picks(picked, ranked, valid)
    return _in_reference_order(picked.long(), ranked, valid)


def _in_reference_order(picked: Tensor, ranked: Tensor, valid: Tensor) -> Tensor:
    """Valid picks sorted by (score descending, column ascending), −1 after them (the torch form of
    `triton_kernels.topk_order.order_picks`).

    One sort of int64 keys: the score's order-preserving int32 image in the high half, the reversed
    column in the low half (so equal scores put the lower column first), invalid picks lowest."""
    cols = valid.shape[1]
    column = picked.clamp(0, cols - 1)
    ok = (picked >= 0) & (picked < cols) & torch.gather(valid, 1, column)
    score = torch.gather(ranked, 1, column) + 0.0  # −0.0 → +0.0: equal scores must tie
    bits = score.view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of the bits = float order
    key = torch.where(ok, ordered * 2**32 + (2**31 - 1 - column), torch.iinfo(torch.int64).min)
    order = key.sort(dim=1, descending=True).indices
    return torch.where(torch.gather(ok, 1, order), torch.gather(column, 1, order), -1)


def _topk_problem(call: Mapping[str, Any]) -> Optional[str]:
    k = call.get("topk")
    return probes.first_problem(
        probes.dtype_problem(call, (torch.float32, torch.bfloat16, torch.float16)),
        f"top-k {k} exceeds the kernel's maximum {TOPK_MAX}" if k is not None and k > TOPK_MAX else None,
    )


# ---------------------------------------------------------------- indexer KL backward (sparse loss)
def indexer_kl_backward(q: Tensor, k: Tensor, weights: Tensor, candidates: Tensor, target: Tensor,
                        student: Tensor, grad_rows: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The `indexer_kl_bwd` contract on `DSA.indexer_backward_wrapper` (the sparse loss).

    The kernel differentiates `loss_coeff·mean_t KL_t` with one runtime scalar `grad_loss`; its score
    gradient is `g − predict·Σg` with `g = −target·loss_coeff·grad_loss/rows` (targets and predictions
    below `e^−100` clipped). Passing `target·grad_rows[t]` as the target, `grad_loss = rows` and
    `loss_coeff = 1` makes that `grad_rows[t]·(predict·Σtarget − target)`: our weighted gradient, for
    the non-negative row weights a loss gives. The kernel applies `scale` itself (inside the ReLU, as
    our scores do on the weights side). Candidates are padded to the kernel's 128-wide block with −1
    and zero target and prediction (no gradient there); heads are padded to 64 with zero queries and
    weights; ids are global rows of k (one batch of all rows), in row chunks of at most 32768 (the
    kernel's grid limit); dk accumulates in float32 across chunks.
    """
    rows, heads, _ = q.shape
    width = probes.round_up(max(candidates.shape[1], 1), INDEXER_BLOCK)
    slots = triton_kl_slots if triton_decline_reason(q.device) is None else kl_slots  # one kernel, else ~15 ops
    weighted, predict, ids = (t.unsqueeze(0) for t in slots(
        candidates, k.shape[0], student.float(), target.float(), grad_rows.float(), width))
    q_heads = max(heads, INDEXER_MIN_HEADS)
    q_padded, w_padded = pad_heads(q, q_heads).unsqueeze(0), pad_heads(weights, q_heads).unsqueeze(0)
    keys = k.contiguous().unsqueeze(0)
    grad_q, grad_w, grad_k = [], [], None
    for start in range(0, rows, INDEXER_ROW_CHUNK):
        chunk = slice(start, start + INDEXER_ROW_CHUNK)
        count = q_padded[:, chunk].shape[1]
        result = _dsa().indexer_backward_wrapper(
            q_padded[:, chunk].contiguous(), w_padded[:, chunk].contiguous(), keys,
            weighted[:, chunk], predict[:, chunk], ids[:, chunk], device_scalar(count, torch.float32, q.device),
            sm_scale=float(scale), loss_coeff=1.0, topk_indices_global=True,
            d_index_k=torch.empty(keys.shape, dtype=torch.float32, device=k.device))
        grad_q.append(result["d_index_q"][0, :, :heads])
        grad_w.append(result["d_weights"][0, :, :heads])
        grad_k = result["d_index_k"][0] if grad_k is None else grad_k + result["d_index_k"][0]
    if grad_k is None:  # no rows
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(weights)
    # One chunk (up to 32768 rows, the usual case) returns the kernel's own buffers: no copies.
    merged = [t[0] if len(t) == 1 else torch.cat(t) for t in (grad_q, grad_w)]
    return merged[0].to(q.dtype), grad_k.to(k.dtype), merged[1].to(weights.dtype)


def kl_slots(candidates: Tensor, keys: int, student: Tensor, target: Tensor, grad_rows: Tensor,
             width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's per-slot inputs, `[T, width]` each: `(weighted, predict, ids)` (the torch form of
    `triton_kernels.kl_slots.kl_slots`; shapes there).

    A slot is valid when its candidate is a row of k. predict: the student's softmax over the valid slots
    (invalid ones at float32's lowest value), 0 elsewhere; weighted: `target · grad_rows[t]` at valid
    slots; ids: the candidate, −1 where invalid; padding slots 0, 0, −1."""
    valid = (candidates >= 0) & (candidates < keys)
    floor = torch.finfo(torch.float32).min
    predict = torch.where(valid, torch.softmax(torch.where(valid, student, floor), -1), 0.0)
    weighted = torch.where(valid, target * grad_rows.unsqueeze(-1), 0.0)
    ids = torch.where(valid, candidates, -1).to(torch.int32)
    pad = (0, width - candidates.shape[1])
    return (torch.nn.functional.pad(weighted, pad), torch.nn.functional.pad(predict, pad),
            torch.nn.functional.pad(ids, pad, value=-1))


def _indexer_kl_problem(call: Mapping[str, Any]) -> Optional[str]:
    heads, topk = call.get("heads"), call.get("topk")
    return probes.first_problem(
        "the dense indexer loss (the kernel scores selected slots; Megatron refuses cuDNN's SM90 dense "
        "path as unreliable)" if call.get("dense") else None,
        probes.dtype_problem(call, (torch.bfloat16,)),
        probes.head_dim_problem(call, INDEXER_HEAD_DIM, "indexer head dim"),
        f"{heads} indexer heads: more than {INDEXER_MIN_HEADS} not validated"
        if heads is not None and heads > INDEXER_MIN_HEADS else None,
        f"top-k {topk} exceeds the kernel's maximum {TOPK_MAX}" if topk is not None and topk > TOPK_MAX else None,
    )


# ---------------------------------------------------------------- indexer loss teacher (sparse loss)
TEACHER_SLOTS = 128  # the SM90 kernel normalises a row 128 slots at a time: widths must be multiples


@torch.no_grad()
def row_scaled_attention_mass(query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor,
                              scale: float) -> Tensor:
    """`ops.indexer_loss.attention_mass` times a positive factor per row, on
    `DSA.sparse_attn_score_recompute_wrapper` (shapes as there; returns `[T, C]` float32).

    The SM90 kernel sums `exp(scale·<q_h, kv[c]> − lse_h)` over heads with the normaliser it is given
    (natural log; it has no sink of its own, so `full_lse` brings ours) and the plain scale (it applies
    log2(e) itself), and returns `mass / (Σ_row mass + 1e-10)`. `normalise_target` divides
    by the row sum again, which cancels any per-row factor: the composition is exactly our target for
    every row with mass (a row without valid candidates stays 0). Only a tensor-parallel all-reduce
    between the two would mix differently scaled rows (the caller refuses it).

    Heads are padded to 64/128 with zero queries and a +inf normaliser (no mass); ids become int32
    with −1 at every invalid slot (the kernel zeroes −1 slots only: an id ≥ M would read a zero row
    and get `exp(−lse)`), padded with −1 to a multiple of 128 slots; one batch, global ids.
    """
    rows, heads, _ = query.shape
    width = candidates.shape[1]
    if rows == 0 or width == 0:
        return torch.zeros((rows, width), dtype=torch.float32, device=query.device)
    padded = padded_heads(heads)
    result = _dsa().sparse_attn_score_recompute_wrapper(
        pad_heads(query, padded).unsqueeze(0),
        kv.contiguous().unsqueeze(0),
        pad_heads(full_lse.float(), padded, float("inf")).unsqueeze(0),
        kernel_ids(candidates, kv.shape[0], TEACHER_SLOTS).unsqueeze(0),
        float(scale),
        topk_indices_global=True,
    )
    return result["target"][0, :, :width]


def _kl_kernel(student_scores: Tensor) -> KLFn:
    """Triton's one-pass KL where Triton runs (float32 scores on a CUDA device), else the torch one."""
    if student_scores.dtype == torch.float32 and triton_decline_reason(student_scores.device) is None:
        return triton_kl_per_row
    return kl_per_row


def indexer_loss(student_scores: Tensor, query: Tensor, kv: Tensor, candidates: Tensor, full_lse: Tensor,
                 scale: float, tp_group: Optional[ProcessGroup] = None, *,
                 return_target: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The `indexer_loss` contract (`ops.indexer_loss.indexer_kl`) with the cuDNN teacher
    (`row_scaled_attention_mass`), for heads that are not split over tensor-parallel ranks."""
    ranks = group_size(tp_group)
    if ranks > 1:
        raise ValueError(f"the cuDNN teacher normalises each rank's target before the head sum over tp_group "
                         f"({ranks} ranks) could complete it; use the triton or unfused indexer_loss")
    return indexer_kl(student_scores, query, kv, candidates, full_lse, scale, tp_group,
                      mass=row_scaled_attention_mass, kl=_kl_kernel(student_scores), return_target=return_target)


def _teacher_problem(call: Mapping[str, Any]) -> Optional[str]:
    heads, topk, ranks = call.get("heads"), call.get("topk"), call.get("tp_size")
    capability = probes.cuda_capability(call.get("device"))
    return probes.first_problem(
        "SM90 only (the SM100 target kernel zeroes rows whose selected mass is <= 1e-10; ours normalises "
        "them)" if capability is not None and capability[0] != 9 else None,
        "the dense indexer loss (the kernel scores selected slots; the dense loss scores every visible "
        "entry)" if call.get("dense") else None,
        f"heads split over {ranks} tensor-parallel ranks (the kernel normalises each rank's target before "
        "the head sum over ranks)" if ranks is not None and ranks > 1 else None,
        probes.dtype_problem(call, (torch.bfloat16,)),
        probes.head_dim_problem(call, SPARSE_HEAD_DIM),
        heads_problem(heads) if heads is not None else None,
        f"top-k {topk} above {TOPK_MAX} not validated (the kernel keeps a float per slot in shared memory "
        "beside 192 KiB of query and kv tiles)" if topk is not None and topk > TOPK_MAX else None,
    )


# ---------------------------------------------------------------- dense attention (torch's cuDNN SDPA)
def _cudnn_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                  scale=scale)[:2]
    return out, lse


def _dense_probe(call: Mapping[str, Any]) -> Optional[str]:
    return probes.first_problem(
        None if torch.backends.cudnn.is_available() else "torch was built without cuDNN",
        probes.gpu_problem(call, (9, 10), "cuDNN SDPA"),
        probes.dtype_problem(call, (torch.bfloat16, torch.float16)),
        probes.batched_layout_problem(call),
        probes.dense_problem(call),
    )


# ---------------------------------------------------------------- registration
def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    if op is OpFamily.DENSE_ATTENTION:
        return _dense_probe(call)
    # `or`: the wrapper is looked up only once the package imports.
    problem = (package_problem() or wrapper_problem(WRAPPERS[op])
               or probes.gpu_problem(call, (9, 10), "cuDNN DSA"))
    if problem is not None:
        return problem
    if op is OpFamily.SPARSE_ATTENTION_FWD:
        return _sparse_forward_problem(call)
    if op is OpFamily.SPARSE_ATTENTION_BWD:
        return _sparse_backward_problem(call)
    if op is OpFamily.INDEXER_KL_BWD:
        return _indexer_kl_problem(call)
    if op is OpFamily.INDEXER_SCORES:
        return _indexer_scores_problem(call)
    if op is OpFamily.INDEXER_LOSS:
        return _teacher_problem(call)
    return _topk_problem(call)


CUDNN = Backend(
    name="cudnn",
    ops={OpFamily.SPARSE_ATTENTION_FWD: sparse_attention_forward,
         OpFamily.SPARSE_ATTENTION_BWD: sparse_attention_backward, OpFamily.TOPK: topk,
         OpFamily.INDEXER_SCORES: indexer_scores, OpFamily.INDEXER_KL_BWD: indexer_kl_backward,
         OpFamily.INDEXER_LOSS: indexer_loss,
         OpFamily.DENSE_ATTENTION: batched_dense_attention(_cudnn_sdpa)},
    probe=probe,
    version=lambda: probes.versions_line(DISTRIBUTION, "nvidia-cutlass-dsl"),
)

register_backend(CUDNN)
