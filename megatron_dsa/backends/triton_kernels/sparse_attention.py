"""Sparse attention with a learnable sink as Triton kernels: forward and backward (docs/math.md §7).

Same contract as the unfused reference `megatron_dsa.ops.sparse_attention`: query `[N, H, D]`
attends, per row, the kv rows `indices[t]` of the tied key/value latent `kv [M, D]` (one KV head
shared by all `H` heads); entries outside `[0, M)` are ignored and duplicates count as separate keys.
The sink `[H]` enters only the denominator. The LSE is natural-log and excludes the sink; a row
without a valid index gives `out = 0`, `lse = -inf`.

Kernel design (Hopper first, correct anywhere Triton runs):
* one program per (query row, block of `BLOCK_H` heads); the heads are the M dimension of `tl.dot`
  (padded to at least 16 with masks), so each gathered kv block serves every head of the row;
* a loop over blocks of `BLOCK_K` indices gathers kv rows by pointer arithmetic; online softmax
  and accumulation in fp32; the head dim is a power-of-two chunk plus an optional tail chunk;
* backward (the portable kernel; Hopper has its own, below): recomputes the probabilities from the
  saved LSE, keeps dq in registers, and per index block forms the kv gradient (value term `p dO` plus
  key term `scale dS q`, K = V, as one dot of stacked operands) in column chunks of `BLOCK_DC`,
  scattered by fp32 atomic adds into an `[M, D]` scratch that is cast once at the end; per-row sink
  terms are summed afterwards (deterministic for dq and the sink; the dkv sum order follows the
  atomics).
On CUDA a short autotune list picks the blocks, warps and stages; the CPU interpreter runs a single
fixed configuration so that tests stay fast.

The forward has two kernels. On Hopper, for bf16, blocks of 64 heads and D = 512 (dsv4), a
warp-specialised Gluon kernel (`_sparse_attention_hopper_forward_kernels`: a producer warpgroup gathers
kv, two consumer warpgroups score alternate index blocks and split the output columns) takes 0.76 ms at 4096
rows and 2.86 ms at 16k on an H200 (bf16, H = 64, D = 512, 640 indices per row;
`benchmarks/sparse_attention.py`), 90-96% of FlashMLA's speed; `hopper_decline` says when it does
not apply. Everywhere else the portable Triton kernel runs (1.31 / 4.97 ms there, about 265 TFLOPS) with
64 heads, 64 indices, 8 warps and 2 stages per program. It is register-bound: the [64, 512] fp32
accumulator takes half the register file, so the query stays in shared memory as a dot operand, and the
loads carry no head or dim masks when the tiles cover H and D exactly.

The backward has two kernels. On Hopper, for bf16, blocks of 64 heads and D = 512 (dsv4), a Gluon kernel
(`_sparse_attention_hopper_backward_kernels`: explicit shared-memory tiles, asynchronous gathers and MMAs
that overlap the atomics) takes 2.9 ms at 4096 rows, 73-76% of cuDNN's speed; `hopper_decline` says when it
does not apply. Everywhere else (other GPUs, dtypes, head counts, head dims, and the interpreter) the
portable Triton kernel runs: it takes 4.6 ms on the same problem. It keeps all 64 heads and 64 indices per
program, so every dot is a warpgroup MMA and each kv row is reduced once per query row; q and dO are loaded
once per row and stay in shared memory; the kv gradient is one stacked dot per column chunk in a
pipelined loop. Its index loop runs single-stage (q, dO and the kv block fill 192 KB of shared memory),
and its [64, D] fp32 dq accumulator makes it spill a little. `auto` prefers cuDNN's fused backward on
Hopper where it is installed.

Interpreter (`TRITON_INTERPRET=1`, CPU tests): triton 3.6's `triton.jit` chooses compiled or
interpreted execution when a function is *decorated*. Our kernel bodies therefore live undecorated in
`_sparse_attention_kernels` and are decorated on first use, cached per mode, so they follow the switch
at call time. Triton's own library functions (`tl.sum`, `tl.max`, `tl.zeros`, ...) are decorated when
triton is first imported, though, so the switch must be on before that import: the CPU tests run the
kernels in a child process started with `TRITON_INTERPRET=1`, and the rest of the suite never sees the
interpreter. Importing this module never imports triton.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from megatron_dsa.backends import probes
from megatron_dsa.backends.registry import OpFamily, count_variant
from megatron_dsa.backends.sparse_layout import INT32_ROWS, kernel_ids
from megatron_dsa.backends.triton_kernels.availability import interpreting, require_triton, triton_decline_reason
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.tiles import MIN_DOT, cdiv, dot_precision, head_dim_chunks, on_device, pow2

logger = logging.getLogger("megatron_dsa.backends")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 1024
MAX_BLOCK_H = 64  # heads per program: one Hopper warpgroup MMA tile
INTERPRETER_BLOCK_K = 16
LOG2E = math.log2(math.e)
# The Hopper kernels (Gluon; `_sparse_attention_hopper_forward_kernels`,
# `_sparse_attention_hopper_backward_kernels`): their tiles, and the triton that was measured.
HOPPER_HEAD_BLOCK = 64
HOPPER_HEAD_DIM = 512
HOPPER_MIN_TRITON = (3, 6)
# Which kernel ran, per call and pass, as the `triton` backend's variants in `registry.variant_counts()`
# (tests read them to prove the path).
BACKEND = "triton"
HOPPER_VARIANT, PORTABLE_VARIANT = "gluon_hopper", "portable"


# ---------------------------------------------------------------- kernels, decorated lazily per mode
@dataclass(frozen=True)
class _Kernels:
    forward: Any
    backward: Any
    autotuned: bool  # CUDA: the autotuner owns BLOCK_H / BLOCK_K / BLOCK_DC / num_warps / num_stages


# CUDA autotune candidates. Short on purpose: each is compiled on the first call of every (H, K, D, dtype).
# An oversized candidate fails to launch and the autotuner skips it; `_prune` caps the head block at the
# head count. Forward (BLOCK_H, BLOCK_K, num_warps, num_stages): all (up to 64) heads of a row in one
# program, so a gathered kv block serves them all; 8 warps (two warpgroups share the [64, D] fp32
# accumulator) won every H200 sweep; one-stage variants keep GPUs with less shared memory than Hopper
# covered.
FORWARD_CONFIGS = ((64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 1), (64, 32, 8, 1))
# Backward (BLOCK_H, BLOCK_K, BLOCK_DC, num_warps, num_stages): all heads and index blocks of 64, so that
# every dot is a warpgroup MMA on Hopper and each kv row is reduced once per query row; column chunks of
# 32-64 beat 128 and 256 on an H200 (the chunk's fp32 tile sits beside the [64, D] dq accumulator). One
# stage for the index loop: q, dO and the kv block already take 192 KB of shared memory at D = 512 in
# bf16, and the column-chunk loop's three buffers take the rest. Index blocks of 32 fit D = 576; the last
# candidate fits fp32 inputs (and GPUs with less shared memory).
BACKWARD_CONFIGS = ((64, 64, 64, 8, 1), (64, 64, 32, 8, 1), (64, 32, 32, 8, 1), (16, 32, 32, 4, 1))
INTERPRETER_BLOCK_DC = 32


def _head_block(heads: int, cap: int = MAX_BLOCK_H) -> int:
    """Heads per program: a power of two >= 16 (`tl.dot` minimum; extra heads are masked), <= `cap`."""
    return pow2(heads, MIN_DOT, cap)


def _cuda_configs(candidates: tuple[tuple[int, ...], ...]) -> list:
    """`triton.Config`s of `(BLOCK_H, BLOCK_K[, BLOCK_DC], num_warps, num_stages)` tuples."""
    import triton

    names = ("BLOCK_H", "BLOCK_K", "BLOCK_DC")
    return [triton.Config(dict(zip(names, blocks)), num_warps=num_warps, num_stages=num_stages)
            for *blocks, num_warps, num_stages in candidates]


def _prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """Cap every candidate's head block at what the head count needs (and its column chunk at what the
    head dim needs), dropping the duplicates."""
    import triton

    pruned = {}
    for config in configs:
        blocks = dict(config.kwargs, BLOCK_H=_head_block(named_args["H"], config.kwargs["BLOCK_H"]))
        if "BLOCK_DC" in blocks:
            blocks["BLOCK_DC"] = pow2(named_args["D"], MIN_DOT, blocks["BLOCK_DC"])
        key = (*sorted(blocks.items()), config.num_warps, config.num_stages)
        pruned.setdefault(key, triton.Config(blocks, num_warps=config.num_warps, num_stages=config.num_stages))
    return list(pruned.values())


@functools.lru_cache(maxsize=None)
def _build_kernels(interpret: bool) -> _Kernels:
    import triton

    from megatron_dsa.backends.triton_kernels import _sparse_attention_kernels as source

    forward = triton.jit(source.sparse_attention_fwd_kernel)
    backward = triton.jit(source.sparse_attention_bwd_kernel)
    if interpret:
        return _Kernels(forward, backward, autotuned=False)
    key = ["H", "K", "D"]  # the autotuner adds the tensor dtypes to the key itself

    def tuned(kernel: Any, candidates: tuple, **options: Any) -> Any:
        return triton.autotune(_cuda_configs(candidates), key=key, prune_configs_by={"early_config_prune": _prune},
                               **options)(kernel)

    return _Kernels(forward=tuned(forward, FORWARD_CONFIGS),
                    # The scratch gradient is accumulated with atomics, so every trial must start from zero.
                    backward=tuned(backward, BACKWARD_CONFIGS, reset_to_zero=["dkv_ptr"]),
                    autotuned=True)


def _kernels() -> _Kernels:
    from triton import knobs

    return _build_kernels(bool(knobs.runtime.interpret))  # the same switch `triton.jit` reads


# ---------------------------------------------------------------- tiling and launch
def _launch(kernel: Any, autotuned: bool, rows: int, heads: int, dim: int, *args: Any,
            column_chunks: bool = False, **meta: Any) -> None:
    """Launch one program per (row, head block); `column_chunks`: the kernel takes a `BLOCK_DC`."""
    block_d, block_dt = head_dim_chunks(dim)
    meta.update(BLOCK_D=block_d, BLOCK_DT=block_dt)
    if not autotuned:
        meta.update(BLOCK_H=_head_block(heads), BLOCK_K=INTERPRETER_BLOCK_K, num_warps=4, num_stages=1)
        if column_chunks:
            meta.update(BLOCK_DC=min(INTERPRETER_BLOCK_DC, block_d))
    # Program id = row * head blocks + head block: the head blocks of one row run side by side, so they
    # meet the row's kv rows in L2 together.
    kernel[lambda config: (rows * cdiv(heads, config["BLOCK_H"]),)](*args, **meta)



# ---------------------------------------------------------------- the Hopper kernels
_PORTABLE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("portable_kernels", default=False)


@contextlib.contextmanager
def portable_kernels() -> Iterator[None]:
    """Within the block, every call runs the portable Triton kernels (benchmarks and tests compare the
    Hopper kernels against them)."""
    token = _PORTABLE_ONLY.set(True)
    try:
        yield
    finally:
        _PORTABLE_ONLY.reset(token)


def hopper_decline(query: Tensor) -> Optional[str]:
    """None when the Gluon Hopper kernels (forward and backward alike) take a call with this
    `query [N, H, D]`, else why not."""
    if _PORTABLE_ONLY.get():
        return "is switched off by portable_kernels()"
    if query.device.type != "cuda":
        return f"tensors on {query.device.type}, it needs CUDA"
    if interpreting():
        return "the Triton CPU interpreter cannot run Gluon kernels"
    return hopper_shape_decline(torch.cuda.get_device_capability(query.device), query.dtype, *query.shape[1:])


def hopper_shape_decline(capability: tuple[int, int], dtype: torch.dtype, heads: int, dim: int) -> Optional[str]:
    """The Hopper kernels' limits (forward and backward alike) on a CUDA device of `capability`: they are
    tuned and tested for bf16, blocks of 64 heads and D = 512 (dsv4); every other call runs the portable
    Triton kernels."""
    if capability[0] != 9:
        return f"needs a Hopper GPU (sm_90), got sm_{capability[0]}{capability[1]}"
    if dtype != torch.bfloat16:
        return f"runs bfloat16 only, got {dtype}"
    if heads % HOPPER_HEAD_BLOCK != 0:
        return f"needs a multiple of {HOPPER_HEAD_BLOCK} heads, got {heads}"
    if dim != HOPPER_HEAD_DIM:
        return f"needs head dim {HOPPER_HEAD_DIM}, got {dim}"
    return _gluon_problem()


def describe_hopper_kernels() -> str:
    """Which Triton sparse-attention kernels serve dsv4 calls (bf16, 64 heads, D = 512) on this machine's
    current CUDA device, for `megatron-dsa info --verbose`."""
    prefix = "triton sparse attention forward and backward (bf16, 64 heads, D = 512):"
    reason = triton_decline_reason(None)
    if reason is None and not torch.cuda.is_available():
        reason = "no CUDA device"
    if reason is not None:
        return f"{prefix} not available here ({reason})"
    decline = hopper_shape_decline(torch.cuda.get_device_capability(), torch.bfloat16, HOPPER_HEAD_BLOCK,
                                   HOPPER_HEAD_DIM)
    return f"{prefix} {kernel_choice(decline)}"


def kernel_choice(decline: Optional[str]) -> str:
    """The kernel that runs, given the Hopper kernel's decline reason (None: it runs), as the log, the
    `info` command and the benchmark name it."""
    return "the Hopper kernel (Gluon)" if decline is None else f"the portable kernel (the Hopper kernel {decline})"


@functools.lru_cache(maxsize=None)
def _gluon_problem() -> Optional[str]:
    version = probes.load("triton").__version__
    if probes.version_tuple(version) < HOPPER_MIN_TRITON:
        return f"needs triton >= {'.'.join(map(str, HOPPER_MIN_TRITON))} (Gluon), got {version}"
    return probes.import_problem("triton.experimental.gluon.language.nvidia.hopper", "a triton with Gluon")


@functools.lru_cache(maxsize=None)
def _log_kernel_choice(pass_name: str, decline: Optional[str]) -> None:
    """Log once per pass and distinct reason which kernel runs."""
    logger.info("triton sparse attention %s: %s", pass_name, kernel_choice(decline))


def _launch_hopper_forward(operands: _Prepared, out: Tensor, lse: Tensor, qk_scale: float) -> None:
    from megatron_dsa.backends.triton_kernels._sparse_attention_hopper_forward_kernels import (
        sparse_attention_fwd_hopper_kernel,
    )

    rows, heads, dim = operands.query.shape
    q, kv, ids, sink = operands.query, operands.kv, operands.indices, operands.sink
    # 4 warps for consumer 0; the kernel's warp specialisation adds consumer 1 and the producer.
    launcher(sparse_attention_fwd_hopper_kernel)[(rows * (heads // HOPPER_HEAD_BLOCK),)](
        q, kv, ids, sink, out, lse, qk_scale, operands.kv_rows, ids.shape[1], heads, dim, num_warps=4)


def _launch_hopper_backward(operands: _Prepared, *args: Any, has_dlse: bool) -> None:
    """`args`: out, lse, grad_out, grad_lse, grad_query, grad_kv, sink_terms, scale, qk_scale."""
    from megatron_dsa.backends.triton_kernels._sparse_attention_hopper_backward_kernels import (
        sparse_attention_bwd_hopper_kernel,
    )

    rows, heads, dim = operands.query.shape
    q, kv, ids, sink = operands.query, operands.kv, operands.indices, operands.sink
    launcher(sparse_attention_bwd_hopper_kernel)[(rows * (heads // HOPPER_HEAD_BLOCK),)](
        q, kv, ids, sink, *args, operands.kv_rows, ids.shape[1], heads, dim, HAS_DLSE=has_dlse, num_warps=8)


# ---------------------------------------------------------------- input checks and preparation
def _require(condition: bool, error: type[Exception], message: str) -> None:
    if not condition:
        raise error(message)


def _check_tensor(name: str, value: Any) -> None:
    _require(isinstance(value, Tensor), TypeError, f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_attention_inputs(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> None:
    for name, value in (("query", query), ("kv", kv), ("indices", indices), ("sink", sink)):
        _check_tensor(name, value)
    _require(query.dim() == 3, ValueError, f"query must be [N, H, D], got shape {tuple(query.shape)}")
    _require(kv.dim() == 2, ValueError, f"kv must be [M, D], got shape {tuple(kv.shape)}")
    rows, heads, dim = query.shape
    _require(kv.shape[1] == dim, ValueError, f"kv head dim {kv.shape[1]} must equal query head dim {dim}")
    _require(1 <= dim <= MAX_HEAD_DIM, ValueError, f"head dim D must be in [1, {MAX_HEAD_DIM}], got {dim}")
    _require(heads >= 1, ValueError, "query must have at least one head")
    _require(query.dtype in SUPPORTED_DTYPES, TypeError,
             f"query dtype must be one of float32/bfloat16/float16 for the Triton kernel, got {query.dtype} "
             f"(float64 runs on the unfused backend)")
    _require(kv.dtype == query.dtype, TypeError, f"kv dtype {kv.dtype} must equal query dtype {query.dtype}")
    _require(indices.dim() == 2 and indices.shape[0] == rows, ValueError,
             f"indices must be [N, K] with N = {rows}, got shape {tuple(indices.shape)}")
    _require(indices.dtype in (torch.int32, torch.int64), TypeError,
             f"indices must be int32 or int64, got {indices.dtype}")
    _require(sink.shape == (heads,), ValueError, f"sink must be [H] = [{heads}], got shape {tuple(sink.shape)}")
    _require(sink.is_floating_point(), TypeError, f"sink must be a floating tensor, got {sink.dtype}")
    _require(isinstance(scale, (int, float)) and not isinstance(scale, bool), TypeError,
             f"scale must be a real number, got {type(scale).__name__}")
    _require(math.isfinite(scale), ValueError, f"scale must be finite, got {scale}")
    for name, value in (("kv", kv), ("indices", indices), ("sink", sink)):
        _require(value.device == query.device, ValueError,
                 f"{name} is on {value.device}, query on {query.device}: all inputs must share one device")
    require_triton(query.device, "sparse attention", "query's device")


def _check_rows(name: str, value: Optional[Tensor], shape: tuple[int, ...], device: torch.device) -> None:
    if value is None:
        return
    _check_tensor(name, value)
    _require(tuple(value.shape) == shape, ValueError, f"{name} must have shape {shape}, got {tuple(value.shape)}")
    _require(value.is_floating_point(), TypeError, f"{name} must be a floating tensor, got {value.dtype}")
    _require(value.device == device, ValueError, f"{name} is on {value.device}, query on {device}")


@dataclass(frozen=True)
class _Prepared:
    """Contiguous kernel operands. Empty `indices` / `kv` get one dummy entry (an index of -1, a zero
    row) so that no kernel pointer is null; `kv_rows` stays the true `M`, so the dummy is never valid."""

    query: Tensor
    kv: Tensor
    indices: Tensor  # int32 [N, K'] (int64 past int32 kv rows), entries outside [0, M) are ignored by the kernels
    sink: Tensor  # fp32 [H]
    kv_rows: int

    @property
    def wide_offsets(self) -> bool:
        """Whether kv element offsets `id * D` can pass int32 (the kernels then widen them to int64)."""
        return self.kv.numel() > INT32_ROWS


def _kernel_indices(indices: Tensor, kv_rows: int) -> Tensor:
    """int32 ids for the kernels, which ignore every id outside `[0, M)`: int64 ids are clamped into
    `[−1, M]` first, so none can wrap into range when narrowed (int32 ids load 13% faster than int64 in
    the H200 forward). An empty selection gets one −1 column so that it still launches."""
    if indices.shape[1] == 0:
        return kernel_ids(indices, kv_rows, alignment=1)
    if indices.dtype == torch.int64 and kv_rows < INT32_ROWS:
        return indices.clamp(-1, kv_rows).to(torch.int32)
    return indices


def _prepare(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor) -> _Prepared:
    kv_rows = kv.shape[0]
    indices = _kernel_indices(indices, kv_rows)
    kv_operand = kv if kv_rows > 0 else kv.new_zeros(1, kv.shape[1])
    return _Prepared(query.contiguous(), kv_operand.contiguous(), indices.contiguous(),
                     sink.detach().to(torch.float32).contiguous(), kv_rows)


# ---------------------------------------------------------------- entry points
def sparse_attention_forward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                             scale: float) -> tuple[Tensor, Tensor]:
    """Sparse attention forward.

    `query [N, H, D]`, `kv [M, D]` (K = V latent, one KV head), `indices [N, K]` int32/int64
    (entries < 0 or >= M ignored), `sink [H]`. Returns `out [N, H, D]` in the query dtype and
    `lse [N, H]` float32: the natural-log logsumexp over the valid keys, sink excluded. A row with
    no valid index gives `out = 0`, `lse = -inf`.
    """
    _check_attention_inputs(query, kv, indices, sink, scale)
    rows, heads, dim = query.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=query.device)
    if rows == 0:
        return out, lse
    operands = _prepare(query, kv, indices, sink)
    decline = hopper_decline(query)
    _log_kernel_choice("forward", decline)
    count_variant(BACKEND, OpFamily.SPARSE_ATTENTION_FWD, PORTABLE_VARIANT if decline else HOPPER_VARIANT)
    with on_device(query.device):
        if decline is None:
            _launch_hopper_forward(operands, out, lse, float(scale) * LOG2E)
        else:
            kernels = _kernels()
            _launch(kernels.forward, kernels.autotuned, rows, heads, dim,
                    operands.query, operands.kv, operands.indices, operands.sink, out, lse,
                    float(scale) * LOG2E, heads, operands.kv_rows, operands.indices.shape[1], dim,
                    WIDE_OFFSETS=operands.wide_offsets, DOT_PRECISION=dot_precision(query.dtype))
    return out, lse


def sparse_attention_backward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
                              out: Tensor, lse: Tensor, grad_out: Tensor,
                              grad_lse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse attention backward from the forward's `out [N, H, D]` and `lse [N, H]`.

    `grad_out [N, H, D]` (cast to the query dtype) and `grad_lse [N, H]` or None (no gradient
    through the LSE; when given, `dS_k += grad_lse · exp(s_k - lse)`). Returns `(grad_query [N, H, D]`
    in the query dtype, `grad_kv [M, D]` in the kv dtype, `grad_sink [H]` in the sink dtype).
    """
    _check_attention_inputs(query, kv, indices, sink, scale)
    rows, heads, dim = query.shape
    _check_rows("out", out, tuple(query.shape), query.device)
    _require(out.dtype == query.dtype, TypeError, f"out dtype {out.dtype} must equal query dtype {query.dtype}")
    _check_rows("lse", lse, (rows, heads), query.device)
    _check_rows("grad_out", grad_out, tuple(query.shape), query.device)
    _check_rows("grad_lse", grad_lse, (rows, heads), query.device)

    grad_query = torch.empty_like(query, memory_format=torch.contiguous_format)
    grad_kv = torch.zeros(max(kv.shape[0], 1), dim, dtype=torch.float32, device=kv.device)
    sink_terms = torch.zeros(rows, heads, dtype=torch.float32, device=query.device)  # -p_sink · delta
    if rows > 0:
        operands = _prepare(query, kv, indices, sink)
        has_dlse = grad_lse is not None
        dlse = grad_lse.to(torch.float32).contiguous() if has_dlse else sink_terms  # unread without HAS_DLSE
        tensors = (out.contiguous(), lse.to(torch.float32).contiguous(), grad_out.to(query.dtype).contiguous(), dlse,
                   grad_query, grad_kv, sink_terms, float(scale), float(scale) * LOG2E)
        decline = hopper_decline(query)
        _log_kernel_choice("backward", decline)
        count_variant(BACKEND, OpFamily.SPARSE_ATTENTION_BWD, PORTABLE_VARIANT if decline else HOPPER_VARIANT)
        with on_device(query.device):
            if decline is None:
                _launch_hopper_backward(operands, *tensors, has_dlse=has_dlse)
            else:
                kernels = _kernels()
                _launch(kernels.backward, kernels.autotuned, rows, heads, dim,
                        operands.query, operands.kv, operands.indices, operands.sink, *tensors,
                        heads, operands.kv_rows, operands.indices.shape[1], dim,
                        column_chunks=True, HAS_DLSE=has_dlse, WIDE_OFFSETS=operands.wide_offsets,
                        DOT_PRECISION=dot_precision(query.dtype))
    return grad_query, grad_kv[:kv.shape[0]].to(kv.dtype), sink_terms.sum(0).to(sink.dtype)
