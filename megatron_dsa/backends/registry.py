"""Kernel dispatch: per op family, pick a backend that accepts the call.

A backend is a named provider of implementations for some op families. Before it is used for a call
it is asked `decline_reason(op, call)`: `None` means "I can run this", a string says why not
("package cudnn not importable", "head dim 96 unsupported", ...). `auto` takes the first backend in
priority order that accepts and logs its choice once per (op, choice); an explicitly requested backend
that declines raises `BackendUnavailableError` carrying its reason. Every dispatched call increments a
counter tests read to prove which path ran.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Optional

logger = logging.getLogger("megatron_dsa.backends")

AUTO = "auto"


class OpFamily(str, Enum):
    SPARSE_ATTENTION = "sparse_attention"  # forward + backward over index rows, with sink
    INDEXER_SCORES = "indexer_scores"
    TOPK = "topk"
    INDEXER_LOSS = "indexer_loss"
    COMPRESSOR = "compressor"
    ROPE = "rope"
    DENSE_ATTENTION = "dense_attention"  # causal attention of the `M` kind


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the call; the message says why."""


@dataclass
class Backend:
    """A named set of op implementations with a capability probe.

    `probe(op, call)` returns None when the backend accepts the call, else a reason string. It must be
    cheap (import checks are cached by the backend module) and must never raise.
    """

    name: str
    priority: int  # higher is tried first by `auto`
    ops: dict[OpFamily, Callable[..., Any]] = field(default_factory=dict)
    probe: Callable[[OpFamily, Mapping[str, Any]], Optional[str]] = lambda op, call: None

    def decline_reason(self, op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
        if op not in self.ops:
            return f"no {op.value} implementation"
        return self.probe(op, call)


_BACKENDS: dict[str, Backend] = {}
_CALL_COUNTS: Counter = Counter()
_LOGGED_CHOICES: set[tuple[OpFamily, str, tuple[str, ...]]] = set()


def register_backend(backend: Backend) -> None:
    if backend.name == AUTO:
        raise ValueError(f"'{AUTO}' is reserved and cannot name a backend")
    _BACKENDS[backend.name] = backend


def registered_backends() -> list[Backend]:
    """Backends in the order `auto` tries them (highest priority first)."""
    return sorted(_BACKENDS.values(), key=lambda b: -b.priority)


def resolve(op: OpFamily, requested: str = AUTO, **call: Any) -> tuple[str, Callable[..., Any]]:
    """Pick the backend for one call of `op`: returns `(backend name, implementation)`.

    `call` describes the call for capability probes (device, dtype, head_dim, ...).
    """
    op = OpFamily(op)
    if requested != AUTO:
        backend = _BACKENDS.get(requested)
        if backend is None:
            raise ValueError(f"unknown backend {requested!r} for {op.value}; "
                             f"choose '{AUTO}' or one of {sorted(_BACKENDS)}")
        reason = backend.decline_reason(op, call)
        if reason is not None:
            raise BackendUnavailableError(f"backend {requested!r} cannot run {op.value}: {reason}")
        return backend.name, backend.ops[op]

    declined = []
    for backend in registered_backends():
        reason = backend.decline_reason(op, call)
        if reason is None:
            _log_choice_once(op, backend.name, declined)
            return backend.name, backend.ops[op]
        declined.append(f"{backend.name}: {reason}")
    raise BackendUnavailableError(f"no backend can run {op.value}: " + "; ".join(declined))


def dispatch(op: OpFamily, requested: str = AUTO, **call: Any) -> Callable[..., Any]:
    """Resolve `op` and return its implementation wrapped with the call counter."""
    name, impl = resolve(op, requested, **call)
    key = (name, OpFamily(op).value)

    def counted(*args: Any, **kwargs: Any) -> Any:
        _CALL_COUNTS[key] += 1
        return impl(*args, **kwargs)

    return counted


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


def availability_table() -> list[tuple[str, str, str]]:
    """Rows `(backend, op, "yes" | reason)` probed with an empty call description on this machine.

    Backends whose answer depends on the call (dtype, head dim, ...) decline per call at run time;
    this table shows what does not depend on it (packages, GPU generation).
    """
    rows = []
    for backend in registered_backends():
        for op in OpFamily:
            reason = backend.decline_reason(op, {})
            rows.append((backend.name, op.value, "yes" if reason is None else reason))
    return rows
