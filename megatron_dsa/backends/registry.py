"""Kernel dispatch: per op family, pick a backend that accepts the call.

A backend is a named provider of implementations for some op families. Before it is used for a call
it is asked `decline_reason(op, call)`: `None` means "I can run this", a string says why not
("package cudnn not importable", "head dim 96 unsupported", ...). The call description `call` holds
what the probes need (device, dtype, head_dim, heads, topk, lse_grad, ...) plus `explicit`: True when
the backend was requested by name.

`auto` takes the first backend in priority order that accepts and logs its choice once per
(op, choice, reasons); an explicitly requested backend that declines raises `BackendUnavailableError`
carrying its reason. The choice can be made per op (`HybridAttentionConfig.attention_backend_overrides`).
Every dispatched call increments a counter tests read to prove which path ran.

Choices are remembered per (op, requested name, call description) when the description holds only
plain values (device, dtype, integers, strings; at most `MAX_REMEMBERED_CHOICES`): the probes answer from the call and from what is
installed, which a process does not change, and asking every backend again costs tens of
microseconds per call, a few hundred per layer step. Code that changes what is installed (tests that
fake packages or GPUs) calls `forget_choices()`. Choices made while a CUDA graph is being captured are
not remembered: a probe that must run its kernel once (a self-test) declines during a capture only.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Hashable, Mapping, Optional, Protocol, Union

import torch

from megatron_dsa.device_cache import capturing_now

logger = logging.getLogger("megatron_dsa.backends")

AUTO = "auto"


class OpFamily(str, Enum):
    SPARSE_ATTENTION_FWD = "sparse_attention_fwd"  # (q, kv, indices, sink, scale) -> (out, lse)
    SPARSE_ATTENTION_BWD = "sparse_attention_bwd"  # (..., out, lse, grad_out, grad_lse) -> grads
    INDEXER_SCORES = "indexer_scores"  # (q, k, weights, candidates, scale, visible=None) -> scores [n, C]
    TOPK = "topk"  # (scores [T, C], valid [T, C], k, visible=None) -> columns [T, min(k, C)]
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
    # (q [B,H,D], kv_new [B,D], window [B,R,D], seqlens [B], W, entries, entry_ids, ratio, sink, scale) -> out
    DECODE_ATTENTION = "decode_attention"
    # (q [B,HI,DI], keys [B,C,DI], weights [B,HI], counts [B], scale) -> scores [B, C], -inf past counts[b]
    DECODE_INDEXER_SCORES = "decode_indexer_scores"


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
    cheap (import checks are cached by the backend module) and must never raise. With an empty call
    description (no device) it answers what does not depend on the call: packages, GPU generation.
    `version()` names the package versions the backend runs on (for `megatron_dsa info`).
    """

    name: str
    priority: int  # higher is tried first by `auto`
    ops: dict[OpFamily, Callable[..., Any]] = field(default_factory=dict)
    probe: Callable[[OpFamily, Mapping[str, Any]], Optional[str]] = _accept_all
    version: Callable[[], str] = _no_version
    # Per-op exceptions to `priority`: an op whose kernel measured slower than another backend's ranks
    # below that backend for this op only.
    op_priority: dict[OpFamily, int] = field(default_factory=dict)

    def priority_for(self, op: OpFamily) -> int:
        return self.op_priority.get(op, self.priority)

    def decline_reason(self, op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
        if op not in self.ops:
            return f"no {op.value} implementation"
        try:
            return self.probe(op, call)
        except Exception as error:  # noqa: BLE001 - a probe bug must decline, not crash `auto`
            return f"probe failed ({type(error).__name__}: {error})"


_BACKENDS: dict[str, Backend] = {}
_CALL_COUNTS: Counter = Counter()
_LOGGED_CHOICES: set[tuple[OpFamily, str, tuple[str, ...]]] = set()
_CHOICES: dict[Hashable, tuple[str, Callable[..., Any]]] = {}
# Call-description values a choice may be remembered under: their equality is their meaning.
_PLAIN_VALUES = (type(None), bool, int, str, torch.dtype, torch.device)
# Descriptions with shapes in them (kv rows) vary with packed lengths: the memory is bounded.
MAX_REMEMBERED_CHOICES = 4096


def register_backend(backend: Backend) -> None:
    if backend.name == AUTO:
        raise ValueError(f"'{AUTO}' is reserved and cannot name a backend")
    _BACKENDS[backend.name] = backend
    forget_choices()


def forget_choices() -> None:
    """Drop the remembered choices: the next call of every op asks the backends again (after
    installing a package or faking one in a test)."""
    _CHOICES.clear()


def registered_backends(op: Optional[OpFamily] = None) -> list[Backend]:
    """Backends in the order `auto` tries them for `op` (highest priority first; without `op`, by
    their general priority)."""
    return sorted(_BACKENDS.values(), key=lambda b: -(b.priority if op is None else b.priority_for(op)))


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
    describes the call for capability probes (device, dtype, head_dim, ...).
    """
    op = OpFamily(op)
    name = requested_name(op, requested)
    key = _choice_key(op, name, call)
    chosen = _CHOICES.get(key) if key is not None else None
    if chosen is None:
        chosen = _choose(op, name, call)
        # A probe may decline only for the capture (a self-test reads values back): not remembered.
        if key is not None and not capturing_now():
            if len(_CHOICES) >= MAX_REMEMBERED_CHOICES:
                forget_choices()
            _CHOICES[key] = chosen
    return chosen


def _choice_key(op: OpFamily, name: str, call: Mapping[str, Any]) -> Optional[Hashable]:
    """The key a choice is remembered under, None when the description holds other values (a layout)."""
    if not all(isinstance(value, _PLAIN_VALUES) for value in call.values()):
        return None
    return op, name, tuple(call.items())


def _choose(op: OpFamily, name: str, call: Mapping[str, Any]) -> tuple[str, Callable[..., Any]]:
    if name != AUTO:
        backend = _lookup(name, op)
        reason = backend.decline_reason(op, {**call, "explicit": True})
        if reason is not None:
            raise BackendUnavailableError(f"backend {name!r} cannot run {op.value}: {reason}")
        return backend.name, backend.ops[op]

    declined = []
    for backend in registered_backends(op):
        reason = backend.decline_reason(op, {**call, "explicit": False})
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
    key = (name, OpFamily(op).value)

    def counted(*args: Any, **kwargs: Any) -> Any:
        _CALL_COUNTS[key] += 1
        return impl(*args, **kwargs)

    return counted


# Per op family: backend name → a callable with the family's contract that calls its custom op.
_TRACEABLE: dict[OpFamily, Callable[[str], Callable[..., Any]]] = {}


def register_traceable(op: OpFamily, adaptor: Callable[[str], Callable[..., Any]]) -> None:
    """How `dispatch` calls `op` inside a `torch.compile` trace (`backends.library` registers every family)."""
    _TRACEABLE[op] = adaptor


@dataclass(frozen=True)
class HostLayout:
    """What probes read of a `TokenLayout` (host values only), for choices made while tracing."""

    uniform_shape: Optional[tuple[int, int]]


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
    _CALL_COUNTS[(backend, OpFamily(op).value)] += 1


def backend_op(backend: str, op: OpFamily) -> Callable[..., Any]:
    """`backend`'s implementation of `op` (no probe: the name came from `resolve`)."""
    return _lookup(backend, OpFamily(op)).ops[OpFamily(op)]


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
    reason = backend.decline_reason(op, {"explicit": True})
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
    """`{(backend, op): calls}` since the last reset."""
    return dict(_CALL_COUNTS)


def reset_call_counts() -> None:
    _CALL_COUNTS.clear()


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
            reason = backend.decline_reason(op, {"explicit": False})
            rows.append((backend.name, version, op.value, "yes" if reason is None else reason))
    return rows
