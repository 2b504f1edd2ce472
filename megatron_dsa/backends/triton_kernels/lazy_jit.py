"""Decorate kernels on first use, once per execution mode.

`triton.jit` fixes at decoration time whether a kernel runs compiled or in the CPU interpreter (it
reads `TRITON_INTERPRET` then). Kernel modules therefore keep their kernels as plain functions and
launch them through `jitted(fn)`, which decorates on the first call in each mode. A test can switch
the interpreter on for itself alone (set the variable, call, unset), and nothing imports Triton
before a kernel is actually launched, so the package works where Triton is missing.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from megatron_dsa.backends.triton_kernels.availability import interpreting


@functools.lru_cache(maxsize=None)
def _decorated(fn: Callable[..., None], interpret: bool) -> Any:
    del interpret  # part of the cache key only: triton.jit reads the mode from the environment
    import triton

    return triton.jit(fn)


def jitted(fn: Callable[..., None]) -> Any:
    """`triton.jit(fn)` for the current mode (compiled, or interpreted under `TRITON_INTERPRET=1`)."""
    return _decorated(fn, interpreting())
