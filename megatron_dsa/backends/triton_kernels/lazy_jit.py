"""Decorate kernels on first launch, so that nothing imports Triton before a kernel runs.

Kernel modules keep their kernels as plain functions and launch them through `jitted(fn)`. The
package thus imports and works (through other backends) where Triton is missing.

Interpreted or compiled is fixed per process: `triton.jit` reads `TRITON_INTERPRET` when it
decorates, and Triton decorates its own library functions (`tl.zeros`, `tl.sum`, ...) when
`triton.language` is first imported. The CPU tests therefore run the kernels in a child process
started with `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable


@functools.lru_cache(maxsize=None)
def jitted(fn: Callable[..., None]) -> Any:
    """`triton.jit(fn)`, decorated once on first use."""
    import triton

    return triton.jit(fn)
