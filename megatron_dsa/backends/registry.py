"""Kernel dispatch: per op family, pick a backend that accepts the call.

A backend is a named provider of implementations for some op families. Before it is used for a call
it is asked `decline_reason(op, call)`: `None` means "I can run this", a string says why not
("package cudnn not importable", "head dim 96 unsupported", ...).

Three tables here say how a call is dispatched:

* `AUTO_ORDER`: per op family, the backends `auto` asks, first to last; the first that accepts runs the
  call. It is the only place the order is set (`set_auto_order` changes it; a backend a family's row
  does not name runs that family only when requested by name).
* `CALL_KEYS` and `FAMILY_KEYS`: the call description of each family, the keyword arguments of
  `dispatch`/`resolve` the probes read (device, dtype, head_dim, heads, topk, lse_grad, ...). A key the
  family does not declare, or a value of the wrong type, is a `CallDescriptionError` naming the key and
  the family, both at the call and inside a probe that reads it. Probes also see `explicit`: True when
  the backend was requested by name.

`auto` logs its choice once per (op, choice, reasons); an explicitly requested backend that declines
raises `BackendUnavailableError` carrying its reason. The choice can be made per op
(`HybridAttentionConfig.attention_backend_overrides`). Every dispatched call increments a counter per
(backend, op) that tests read to prove which path ran (`call_counts`); a backend with several kernels
for one family also counts which one ran (`variant_counts`).

Choices are remembered per (op, requested name, call description) when the description holds only
plain values (device, dtype, integers, strings, a layout's `HostLayout`; at most `MAX_REMEMBERED_CHOICES`):
the probes answer from the call and from what is installed, which a process does not change, and asking
every backend again costs tens of microseconds per call, a few hundred per layer step. Code that changes
what is installed (tests that fake packages or GPUs) calls `forget_choices()`. Choices made while a CUDA
graph is being captured are not remembered: a probe that must run its kernel once (a self-test) declines
during a capture only.
"""

from __future__ import annotations

import difflib
import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Hashable, Mapping, Optional, Protocol, Union

import torch

from megatron_dsa.device_cache import capturing_now
from megatron_dsa.ops.layout import TokenLayout

logger = logging.getLogger("megatron_dsa.backends")

AUTO = "auto"


class OpFamily(str, Enum):
    SPARSE_ATTENTION_FWD = "sparse_attention_fwd"  # (q, kv, indices, sink, scale) -> (out, lse)
    SPARSE_ATTENTION_BWD = "sparse_attention_bwd"  # (..., out, lse, grad_out, grad_lse) -> grads
    INDEXER_SCORES = "indexer_scores"  # (q, k, weights, candidates, scale, visible=None) -> scores [n, C]
    TOPK = "topk"  # (scores [T, C], valid [T, C], k, visible=None, counts=None, ordered=True) -> columns [T, min(k, C)]
    # (columns [n, K], scores [n, C], entries, rows, window [n, W], kv_offset) -> ops.indices.SelectionRows
    SELECTION_ROWS = "selection_rows"
    INDEXER_LOSS = "indexer_loss"
    INDEXER_KL_BWD = "indexer_kl_bwd"  # (q, k, weights, candidates, target, student, grad_rows, scale) -> grads
    # (kv, gate [T, coff·Dc] projections, ape, norm_weight, eps, layout, inv_freq, rotate) -> [capacity, Dc]
    COMPRESSOR = "compressor"
    ROPE = "rope"
    NORM_ROPE = "norm_rope"  # (x, positions, inv_freq, eps, weight=None) -> rope(rms_norm(x, weight, eps), ...)
    RMS_NORM = "rms_norm"  # (x [..., D], weight [D] or None, eps) -> y, as ops.norms.rms_norm
    DENSE_ATTENTION = "dense_attention"  # causal attention of the `M` kind
    # One (query piece, key piece) block of the `M` kind's context-parallel ring: the diagonal block
    # (`causal`) or a fully visible earlier one. (q [n,H,Dqk], k [m,G,Dqk], v [m,G,Dv], scale, causal)
    # -> (out [n,H,Dv], lse [n,H] natural log), both in the compute dtype, merged over blocks by their LSE.
    DENSE_ATTENTION_BLOCK_FWD = "dense_attention_block_fwd"
    # (q, k, v, out, lse (merged over all blocks), grad_out, scale, causal) -> (dq, dk, dv) of this block,
    # in the compute dtype
    DENSE_ATTENTION_BLOCK_BWD = "dense_attention_block_bwd"
    # (q [B,H,D], kv_new [B,D], window [B,R,D], seqlens [B], W, entries, entry_ids, ratio, sink, scale,
    # inverse_rope_freq=None) -> out [B,H,D], its RoPE columns turned back where inverse_rope_freq is given
    DECODE_ATTENTION = "decode_attention"
    # (q [B,HI,DI], keys [B,C,DI], weights [B,HI], counts [B], scale) -> scores [B, C], -inf past counts[b]
    DECODE_INDEXER_SCORES = "decode_indexer_scores"
    # (state [B,K,2·coff·Dc], new_rows [B,2·coff·Dc], positions [B], ape, norm_weight, eps, inv_freq, rotate,
    # store [B,C,Dc], scales [B,C] or None, counts [B] or None) -> None: the new tokens join their compressor's
    # pending slots, their groups' entries are written to the store and the entries each sees to counts, in place
    # (ops.decode_compressor)
    DECODE_COMPRESSOR = "decode_compressor"
    # (buffer [B,R,D], rows [B,D], seqlens [B]) -> None: buffer[b, seqlens[b] % R] = rows[b], then seqlens += 1,
    # in place: a decode step's last write (ops.decode_append)
    DECODE_APPEND = "decode_append"
    # (q [B,H,D], window PagedRows (W slots, the new row in them), seqlens [B], W, entries PagedRows or None,
    # entry_ids, ratio, sink, scale, inverse_rope_freq=None) -> out [B,H,D]: DECODE_ATTENTION over an FP8
    # attention-row cache (ops.paged_rows, ops.decode_attention.paged_decode_attention)
    PAGED_DECODE_ATTENTION = "paged_decode_attention"
    # (pages [B, page_bytes], slots, dim, rope, rows [B,D], positions [B], ratio) -> None: row b quantized into
    # slot (positions[b] // ratio) % slots of page b, in place (ops.paged_rows.write_decode_rows)
    PAGED_ROWS_WRITE = "paged_rows_write"
    # (a [M, K], b [N, K], out_dtype) -> a·bᵀ [M, N], each row of a and b rounded to FP8 e4m3 with its own
    # scale (ops.fp8_linear): the projections' GEMMs under `projection_precision="fp8"`
    FP8_GEMM = "fp8_gemm"


# ---------------------------------------------------------------- the order `auto` tries, per family
# Read a row as "first that accepts the call runs it". The reasons are measurements (docs/performance.md,
# 'Kernels'); rules that depend on the call (a GPU generation, a head dim, a layout) are the backends'
# decline reasons, not places in this table.
AUTO_ORDER: dict[OpFamily, tuple[str, ...]] = {
    # FlashMLA: the fastest sparse forward on Hopper (bf16). cuDNN's forward is built for SM100 only (unmeasured
    # there; also fp16) and goes before Triton, whose fast (Gluon) kernels are Hopper-only.
    OpFamily.SPARSE_ATTENTION_FWD: ("flashmla", "cudnn", "triton", "unfused"),
    OpFamily.SPARSE_ATTENTION_BWD: ("cudnn", "triton", "unfused"),  # Triton's Gluon backward: 73-76% of cuDNN's
    OpFamily.INDEXER_SCORES: ("cudnn", "triton", "unfused"),
    # One Triton launch beats cuDNN's frontend call plus its ordering kernel while the GPU waits for the host.
    OpFamily.TOPK: ("triton", "cudnn", "unfused"),
    OpFamily.SELECTION_ROWS: ("triton", "unfused"),
    # cuDNN's teacher measured slower than Triton's on an H200 (S = 4096, 64 heads, 512 slots: 0.42 against
    # 0.35 ms in the C layer; benchmarks/indexer_loss.py 0.68 against 0.59 ms).
    OpFamily.INDEXER_LOSS: ("triton", "cudnn", "unfused"),
    OpFamily.INDEXER_KL_BWD: ("cudnn", "triton", "unfused"),
    OpFamily.COMPRESSOR: ("triton", "unfused"),
    OpFamily.ROPE: ("triton", "unfused"),
    OpFamily.NORM_ROPE: ("triton", "unfused"),
    OpFamily.RMS_NORM: ("triton", "unfused"),
    # FlashAttention-4: the fastest dense option measured on an H200 (FA2 on Hopper and Blackwell leaves
    # whole-sequence batches to cuDNN SDPA: flash_attn's decline rule). Our Triton kernels take every head
    # dim up to 576 (the vendors stop at 256: dsv4's M kind has qk 576 / v 512). torch SDPA (its
    # memory-efficient kernel) is slow on Hopper for head dims 192/128: the last fused choice.
    OpFamily.DENSE_ATTENTION: ("flash_attn", "cudnn", "triton", "torch_sdpa", "unfused"),
    OpFamily.DENSE_ATTENTION_BLOCK_FWD: ("flash_attn", "triton", "torch_sdpa", "unfused"),
    OpFamily.DENSE_ATTENTION_BLOCK_BWD: ("flash_attn", "triton", "torch_sdpa", "unfused"),
    OpFamily.DECODE_ATTENTION: ("triton", "unfused"),
    OpFamily.DECODE_INDEXER_SCORES: ("triton", "unfused"),
    OpFamily.DECODE_COMPRESSOR: ("triton", "unfused"),
    OpFamily.DECODE_APPEND: ("triton", "unfused"),
    # FlashMLA's FP8 sparse decode where built (its attention kernel: 22.8 + 7.4 µs at B = 32, 128k, H200), then the
    # Triton decode kernel reading the pages.
    OpFamily.PAGED_DECODE_ATTENTION: ("flashmla", "triton", "unfused"),
    OpFamily.PAGED_ROWS_WRITE: ("triton", "unfused"),
    # Triton's few-rows GEMM for a decode step's handful of rows (its probe declines more than 64): cuBLASLt's
    # rowwise FP8 GEMM has a floor of ~13 µs per call there. The reference rounds to FP8 and multiplies in
    # float32: the same numbers, without FP8 tensor cores.
    OpFamily.FP8_GEMM: ("triton", "torch_scaled_mm", "unfused"),
}


# ---------------------------------------------------------------- call descriptions, per family
@dataclass(frozen=True)
class HostLayout:
    """What probes see of a `TokenLayout` (host values only): the same in eager calls and while tracing, and
    the part of a layout a choice is remembered under."""

    uniform_shape: Optional[tuple[int, int]]


@dataclass(frozen=True)
class CallKey:
    """One key of a call description: the types its value may take (None, "not known", always may) and
    what it says."""

    types: tuple[type, ...]
    meaning: str


_INT = (int, torch.SymInt)  # sizes are symbolic while tracing with dynamic shapes
CALL_KEYS: dict[str, CallKey] = {
    "device": CallKey((torch.device,), "the device of the call's tensors"),
    "dtype": CallKey((torch.dtype,), "the dtype of the call's (query) tensors"),
    "heads": CallKey(_INT, "query heads on this rank"),
    "groups": CallKey(_INT, "key/value heads (query heads share them in groups)"),
    "head_dim": CallKey(_INT, "the query/key head dim"),
    "v_head_dim": CallKey(_INT, "the value head dim"),
    "topk": CallKey(_INT, "selected slots (index columns) per query row"),
    "kv_rows": CallKey(_INT, "rows of the kv latent the indices point into"),
    "columns": CallKey(_INT, "candidate columns per row the top-k chooses from"),
    "rows": CallKey(_INT, "rows of the call's first operand (the top-k's rows), when the caller knows them (a decode "
                   "step's batch)"),
    "ratio": CallKey(_INT, "the compression ratio"),
    "tp_size": CallKey(_INT, "tensor-parallel ranks the heads are split over"),
    "lse_grad": CallKey((bool,), "a gradient flows through the returned LSE"),
    "dense": CallKey((bool,), "the indexer loss scores every visible entry (not a top-k selection)"),
    "visible": CallKey((bool,), "the visible-entry structure (uniform batch or row segments) comes with the call"),
    "selected": CallKey((bool,), "decoding attends selected compressed entries"),
    "key_dtype": CallKey((torch.dtype,), "the dtype of cached keys, where it is not the query's (an FP8 cache)"),
    "rotate": CallKey((bool,), "the compressor's entries go through the Hadamard transform (the indexer's keys)"),
    "layout": CallKey((TokenLayout, HostLayout), "the rows' TokenLayout (probes see its HostLayout)"),
}
EXPLICIT = "explicit"  # set by the dispatcher, never by a caller: True when the backend was named

_DEVICE = ("device", "dtype")
_SPARSE = (*_DEVICE, "head_dim", "heads", "topk", "kv_rows")
_DENSE = (*_DEVICE, "head_dim", "v_head_dim", "heads", "groups", "lse_grad")
FAMILY_KEYS: dict[OpFamily, frozenset[str]] = {family: frozenset(keys) for family, keys in {
    OpFamily.SPARSE_ATTENTION_FWD: _SPARSE,
    OpFamily.SPARSE_ATTENTION_BWD: (*_SPARSE, "lse_grad"),
    OpFamily.INDEXER_SCORES: (*_DEVICE, "heads", "head_dim", "visible", "ratio"),
    OpFamily.TOPK: (*_DEVICE, "topk", "columns", "rows"),
    OpFamily.SELECTION_ROWS: _DEVICE,
    OpFamily.INDEXER_LOSS: (*_DEVICE, "heads", "head_dim", "topk", "dense", "tp_size"),
    OpFamily.INDEXER_KL_BWD: (*_DEVICE, "heads", "head_dim", "topk", "dense"),
    OpFamily.COMPRESSOR: (*_DEVICE, "ratio"),
    OpFamily.ROPE: _DEVICE,
    OpFamily.NORM_ROPE: _DEVICE,
    OpFamily.RMS_NORM: _DEVICE,
    OpFamily.DENSE_ATTENTION: (*_DENSE, "layout"),
    OpFamily.DENSE_ATTENTION_BLOCK_FWD: _DENSE,
    OpFamily.DENSE_ATTENTION_BLOCK_BWD: _DENSE,
    OpFamily.DECODE_ATTENTION: (*_DEVICE, "heads", "head_dim", "selected"),
    OpFamily.DECODE_INDEXER_SCORES: (*_DEVICE, "heads", "head_dim", "key_dtype"),
    OpFamily.DECODE_COMPRESSOR: (*_DEVICE, "ratio", "head_dim", "rotate", "key_dtype"),
    OpFamily.DECODE_APPEND: _DEVICE,
    OpFamily.PAGED_DECODE_ATTENTION: (*_DEVICE, "heads", "head_dim", "selected"),
    OpFamily.PAGED_ROWS_WRITE: (*_DEVICE, "head_dim"),
    OpFamily.FP8_GEMM: (*_DEVICE, "rows"),
}.items()}


class CallDescriptionError(TypeError):
    """A call description names a key its op family does not declare, or a value of the wrong type."""


def _unknown_key(op: OpFamily, key: str, where: str) -> CallDescriptionError:
    declared = sorted(FAMILY_KEYS[op])
    close = difflib.get_close_matches(key, declared, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return CallDescriptionError(f"{where} names key {key!r}, which the {op.value} call description does not "
                                f"declare{hint}; it takes {', '.join(declared)}")


def checked_call(op: OpFamily, call: Mapping[str, Any], explicit_allowed: bool = False) -> dict[str, Any]:
    """`call` after checking every key against `op`'s declared keys and every value's type, with a layout as
    its `HostLayout` (`explicit` passes only where `explicit_allowed`: the dispatcher sets it)."""
    checked = {}
    for key, value in call.items():
        if key == EXPLICIT:
            if not explicit_allowed:
                raise CallDescriptionError(f"the {op.value} call description may not set {EXPLICIT!r}: the "
                                           "dispatcher sets it (True when the backend is requested by name)")
        elif key not in FAMILY_KEYS[op]:
            raise _unknown_key(op, key, "the call")
        elif value is not None and not isinstance(value, CALL_KEYS[key].types):
            wanted = " or ".join(kind.__name__ for kind in CALL_KEYS[key].types)
            raise CallDescriptionError(f"the {op.value} call description's {key!r} must be {wanted} "
                                       f"({CALL_KEYS[key].meaning}), got {type(value).__name__}")
        checked[key] = _host_layout(value) if key == "layout" else value
    return checked


def _host_layout(layout: Any) -> Any:
    """A `TokenLayout` as its `HostLayout`; anything else as it is (the type check names a wrong one)."""
    return HostLayout(layout.uniform_shape) if isinstance(layout, TokenLayout) else layout


class CallDescription(dict):
    """A checked call description as a probe reads it: reading a key its family does not declare raises
    `CallDescriptionError` (a misspelt key in a probe must not read as "not known")."""

    __slots__ = ("family",)

    def __init__(self, family: OpFamily, call: Mapping[str, Any]):
        super().__init__(call)
        self.family = family

    @classmethod
    def of(cls, family: OpFamily, call: Mapping[str, Any]) -> "CallDescription":
        """`call` (which may hold `explicit`) as the description of a `family` call, checked."""
        if isinstance(call, CallDescription) and call.family is family:
            return call
        return cls(family, checked_call(family, call, explicit_allowed=True))

    def _check(self, key: str) -> None:
        if key != EXPLICIT and key not in FAMILY_KEYS[self.family]:
            raise _unknown_key(self.family, key, "a probe")

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            return dict.__getitem__(self, key)
        self._check(key)
        return default

    def __missing__(self, key: str) -> Any:
        self._check(key)
        raise KeyError(key)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the call; the message says why."""


class BackendSelector(Protocol):
    """Anything that names a backend per op (the layer config does)."""

    def backend_for(self, op: str) -> str: ...


Requested = Union[str, BackendSelector]


def _accept_all(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    return None


def _no_version() -> str:
    return "-"


@dataclass
class Backend:
    """A named set of op implementations with a capability probe.

    `probe(op, call)` returns None when the backend accepts the call, else a reason string. It must be
    cheap (import checks are cached by the backend module) and should not raise (an exception declines,
    except `CallDescriptionError`: reading a key the family does not declare is a bug, not a decline).
    `call` is the family's `CallDescription` (with `explicit`); with an empty one (no device) the probe
    answers what does not depend on the call: packages, GPU generation. `version()` names the package versions the backend runs
    on (for `megatron_dsa info`). Where `auto` tries it is `AUTO_ORDER`'s business, not the backend's.
    """

    name: str
    ops: dict[OpFamily, Callable[..., Any]] = field(default_factory=dict)
    probe: Callable[[OpFamily, Mapping[str, Any]], Optional[str]] = _accept_all
    version: Callable[[], str] = _no_version

    def decline_reason(self, op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
        """None when this backend runs `call` of `op`, else why not. `call` is checked against the family's
        keys (`CallDescriptionError`); a probe that reads an undeclared key raises that error too, any
        other exception in a probe declines."""
        if op not in self.ops:
            return f"no {op.value} implementation"
        call = CallDescription.of(op, call)
        try:
            return self.probe(op, call)
        except CallDescriptionError:
            raise
        except Exception as error:  # noqa: BLE001 - a probe bug must decline, not crash `auto`
            return f"probe failed ({type(error).__name__}: {error})"


_BACKENDS: dict[str, Backend] = {}
_CALL_COUNTS: Counter = Counter()
_VARIANT_COUNTS: Counter = Counter()
_LOGGED_CHOICES: set[tuple[OpFamily, str, tuple[str, ...]]] = set()
_CHOICES: dict[Hashable, tuple[str, Callable[..., Any]]] = {}
# Call-description values a choice may be remembered under: their equality is their meaning.
_PLAIN_VALUES = (type(None), bool, int, str, torch.dtype, torch.device, HostLayout)
# Descriptions with shapes in them (kv rows) vary with packed lengths: the memory is bounded.
MAX_REMEMBERED_CHOICES = 4096


def register_backend(backend: Backend) -> None:
    """Make `backend` requestable by name. `auto` tries it for a family only where `AUTO_ORDER` names it
    (`set_auto_order`)."""
    if backend.name == AUTO:
        raise ValueError(f"'{AUTO}' is reserved and cannot name a backend")
    _BACKENDS[backend.name] = backend
    forget_choices()


def forget_choices() -> None:
    """Drop the remembered choices: the next call of every op asks the backends again (after
    installing a package or faking one in a test)."""
    _CHOICES.clear()


def auto_order(op: OpFamily) -> tuple[str, ...]:
    """The backends `auto` asks for `op`, first to last (`AUTO_ORDER`'s row)."""
    return AUTO_ORDER[as_family(op)]


def set_auto_order(op: OpFamily, names: tuple[str, ...]) -> None:
    """Let `auto` ask the backends `names` for `op`, in this order (a registered backend that implements
    `op` may be left out: it then runs `op` only when requested by name)."""
    op = as_family(op)
    names = tuple(names)
    problems = []
    for name in names:
        if name not in _BACKENDS:
            problems.append(f"{name!r} is not a registered backend")
        elif op not in _BACKENDS[name].ops:
            problems.append(f"backend {name!r} has no {op.value} implementation")
    if len(set(names)) != len(names):
        problems.append("a backend is named twice")
    if problems:
        raise ValueError(f"auto order for {op.value} {list(names)}: {'; '.join(problems)}")
    AUTO_ORDER[op] = names
    forget_choices()


def check_auto_order() -> None:
    """Every built-in backend in its place: each `AUTO_ORDER` row names registered backends that implement
    the family, and every registered backend implementing a family is in its row (the package checks this
    once its backends are registered, before any plug-in)."""
    for op in OpFamily:
        set_auto_order(op, AUTO_ORDER[op])
        missing = sorted(name for name, backend in _BACKENDS.items() if op in backend.ops and name not in AUTO_ORDER[op])
        if missing:
            raise ValueError(f"AUTO_ORDER[{op.value}] leaves out {missing}, which implement it")


def registered_backends(op: Optional[OpFamily] = None) -> list[Backend]:
    """Backends in the order `auto` tries them for `op`; without `op`, every registered backend in the
    order of registration."""
    if op is None:
        return list(_BACKENDS.values())
    return [_BACKENDS[name] for name in AUTO_ORDER[as_family(op)] if name in _BACKENDS]


def backend_named(name: str) -> Optional[Backend]:
    """The registered backend called `name`, None if there is none (an adapter asking about another
    backend goes through here, never through its module)."""
    return _BACKENDS.get(name)


def as_family(op: "OpFamily | str") -> OpFamily:
    """`op` as an `OpFamily` without calling the enum on a member: code `torch.compile` traces runs this,
    and Dynamo (torch 2.11, Python 3.12) cannot trace an enum's construction (it breaks the graph)."""
    return op if isinstance(op, OpFamily) else OpFamily(op)


def requested_name(op: OpFamily, requested: Requested) -> str:
    """The backend name (or `auto`) `requested` asks for `op`."""
    return requested if isinstance(requested, str) else requested.backend_for(op.value)


def _lookup(name: str, op: OpFamily) -> Backend:
    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown backend {name!r} for {op.value}; "
                         f"choose '{AUTO}' or one of {sorted(_BACKENDS)}")
    return backend


def resolve(op: OpFamily, requested: Requested = AUTO, **call: Any) -> tuple[str, Callable[..., Any]]:
    """Pick the backend for one call of `op`: returns `(backend name, implementation)`.

    `requested` is `auto`, a backend name, or a selector (the config) naming one per op. `call`
    describes the call for capability probes with the keys `FAMILY_KEYS[op]` declares (device, dtype,
    head_dim, ...); any other key raises `CallDescriptionError`.
    """
    op = as_family(op)
    name = requested_name(op, requested)
    key = _choice_key(op, name, call)
    chosen = _CHOICES.get(key) if key is not None else None
    if chosen is None:
        chosen = _choose(op, name, checked_call(op, call))
        # A probe may decline only for the capture (a self-test reads values back): not remembered.
        if key is not None and not capturing_now():
            if len(_CHOICES) >= MAX_REMEMBERED_CHOICES:
                forget_choices()
            _CHOICES[key] = chosen
    return chosen


def _choice_key(op: OpFamily, name: str, call: Mapping[str, Any]) -> Optional[Hashable]:
    """The key a choice is remembered under (a layout as its `HostLayout`, all probes see of it); None
    when the description holds other values (symbolic sizes). A key is checked once, when first seen."""
    if "layout" in call:
        call = {**call, "layout": _host_layout(call["layout"])}
    if not all(isinstance(value, _PLAIN_VALUES) for value in call.values()):
        return None
    return op, name, tuple(call.items())


def _choose(op: OpFamily, name: str, call: dict[str, Any]) -> tuple[str, Callable[..., Any]]:
    if name != AUTO:
        backend = _lookup(name, op)
        reason = backend.decline_reason(op, CallDescription(op, {**call, EXPLICIT: True}))
        if reason is not None:
            raise BackendUnavailableError(f"backend {name!r} cannot run {op.value}: {reason}")
        return backend.name, backend.ops[op]

    description = CallDescription(op, {**call, EXPLICIT: False})
    declined = []
    for backend in registered_backends(op):
        reason = backend.decline_reason(op, description)
        if reason is None:
            _log_choice_once(op, backend.name, declined)
            return backend.name, backend.ops[op]
        declined.append(f"{backend.name}: {reason}")
    raise BackendUnavailableError(f"no backend can run {op.value}: " + "; ".join(declined))


def dispatch(op: OpFamily, requested: Requested = AUTO, **call: Any) -> Callable[..., Any]:
    """Resolve `op` and return its implementation wrapped with the call counter.

    Under `torch.compile` the backend is chosen while tracing and the returned callable (same contract)
    calls the family's custom op (`backends.library`), which counts the call when it runs."""
    if torch.compiler.is_compiling():
        return _TRACEABLE[as_family(op)](traced_choice(op, requested, **call))
    name, impl = resolve(op, requested, **call)
    key = (name, as_family(op).value)

    def counted(*args: Any, **kwargs: Any) -> Any:
        _CALL_COUNTS[key] += 1
        return impl(*args, **kwargs)

    return counted


# Per op family: backend name → a callable with the family's contract that calls its custom op.
_TRACEABLE: dict[OpFamily, Callable[[str], Callable[..., Any]]] = {}


def register_traceable(op: OpFamily, adaptor: Callable[[str], Callable[..., Any]]) -> None:
    """How `dispatch` calls `op` inside a `torch.compile` trace (`backends.library` registers every family)."""
    _TRACEABLE[op] = adaptor


def traced_choice(op: OpFamily, requested: Requested = AUTO, **call: Any) -> str:
    """The backend `resolve` picks for this call, as a constant of the graph being traced.

    The probes import packages and may run self-tests, which the tracer cannot follow: they run at trace
    time on the call description's host values (a layout passes as its `HostLayout`), and the compiled
    graph keeps the answer. The description's values must be trace-time constants (shapes are, unless
    compiled with dynamic shapes)."""
    op = as_family(op)
    layouts = tuple((key, value.uniform_shape) for key, value in call.items() if hasattr(value, "uniform_shape"))
    plain = tuple((key, value) for key, value in call.items() if not hasattr(value, "uniform_shape"))
    return _constant_choice(op.value, requested_name(op, requested), plain, layouts)


@torch.compiler.assume_constant_result
def _constant_choice(op: str, requested: str, plain: tuple[tuple[str, Any], ...],
                     layouts: tuple[tuple[str, Optional[tuple[int, int]]], ...]) -> str:
    call = {**dict(plain), **{key: HostLayout(shape) for key, shape in layouts}}
    return resolve(OpFamily(op), requested, **call)[0]


def count_call(backend: str, op: OpFamily) -> None:
    """Count one call of `op` run by `backend` (what `dispatch`'s callable does per call)."""
    _CALL_COUNTS[(backend, as_family(op).value)] += 1


def count_variant(backend: str, op: OpFamily, variant: str) -> None:
    """Count one run of `backend`'s `variant` kernel for `op` (a backend with several kernels for a family
    calls this where it picks one: Triton's Gluon-Hopper or portable sparse attention, a FlashAttention
    generation, ...)."""
    _VARIANT_COUNTS[(backend, as_family(op).value, variant)] += 1


def backend_op(backend: str, op: OpFamily) -> Callable[..., Any]:
    """`backend`'s implementation of `op` (no probe: the name came from `resolve`)."""
    return _lookup(backend, as_family(op)).ops[as_family(op)]


def check_backend_choice(default: str, overrides: Mapping[str, str]) -> None:
    """Fail early on a backend choice that can never work (at layer construction, not at forward).

    Unknown op or backend names raise `ValueError` naming them. An explicitly named backend whose
    packages or GPU are missing raises `BackendUnavailableError` with its reason (bug class A10.1:
    the error names the missing package before any forward, never an ImportError from deep inside).
    Checks that depend on the call (dtype, head dim, ...) still happen per call.
    """
    ops = {op.value: op for op in OpFamily}
    unknown_ops = sorted(set(overrides) - set(ops))
    if unknown_ops:
        raise ValueError(f"attention_backend_overrides names unknown op families {unknown_ops}; "
                         f"choose from {sorted(ops)}")
    choices = {f"override for {op}": name for op, name in overrides.items()}
    choices["attention_backend"] = default
    unknown = sorted({name for name in choices.values() if name != AUTO and name not in _BACKENDS})
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose '{AUTO}' or one of {sorted(_BACKENDS)}")
    for op_name, name in overrides.items():
        if name != AUTO:
            _require_runnable(_BACKENDS[name], ops[op_name], required=True)
    if default != AUTO:
        backend = _BACKENDS[default]
        for op in backend.ops:
            if op.value not in overrides:
                _require_runnable(backend, op, required=False)


def _require_runnable(backend: Backend, op: OpFamily, required: bool) -> None:
    if op not in backend.ops and not required:
        return
    reason = backend.decline_reason(op, {EXPLICIT: True})
    if reason is not None:
        raise BackendUnavailableError(f"backend {backend.name!r} cannot run {op.value}: {reason}")


def _log_choice_once(op: OpFamily, chosen: str, declined: list[str]) -> None:
    """Log once per distinct (op, choice, decline reasons): a new reason is worth a new line."""
    key = (op, chosen, tuple(declined))
    if key in _LOGGED_CHOICES:
        return
    _LOGGED_CHOICES.add(key)
    why = f" (declined: {'; '.join(declined)})" if declined else ""
    logger.info("megatron_dsa: %s uses backend %r%s", op.value, chosen, why)


def call_counts() -> dict[tuple[str, str], int]:
    """`{(backend, op): calls}` since the last reset: every dispatched call, once."""
    return dict(_CALL_COUNTS)


def variant_counts() -> dict[tuple[str, str, str], int]:
    """`{(backend, op, variant): runs}` since the last reset, for backends with several kernels for one
    family (`count_variant`): which kernel ran. Kernels called directly (tests, benchmarks) count here too,
    so a variant's runs need not add up to `call_counts()`'s dispatched calls."""
    return dict(_VARIANT_COUNTS)


def reset_call_counts() -> None:
    """Zero `call_counts()` and `variant_counts()`."""
    _CALL_COUNTS.clear()
    _VARIANT_COUNTS.clear()


def availability_table() -> list[tuple[str, str, str, str]]:
    """Rows `(backend, versions, op, "yes" | reason)` probed with an empty call description here.

    Backends whose answer depends on the call (dtype, head dim, ...) decline per call at run time;
    this table shows what does not depend on it (packages, GPU generation).
    """
    rows = []
    for backend in registered_backends():
        version = backend.version()
        for op in OpFamily:
            if op not in backend.ops:
                continue  # the table lists what a backend offers, not what it never implements
            reason = backend.decline_reason(op, {EXPLICIT: False})
            rows.append((backend.name, version, op.value, "yes" if reason is None else reason))
    return rows

