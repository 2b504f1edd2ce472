"""Whether Triton can run a call here: the package imports, and the tensors live on a CUDA device
(or on the CPU while the Triton interpreter is switched on)."""

from __future__ import annotations

import functools
import importlib
import os
from typing import Optional

import torch

MIN_TRITON_VERSION = (3, 0)


def interpreting() -> bool:
    """True when `TRITON_INTERPRET=1`: kernels run in the CPU interpreter (tests only; slow)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _import_problem() -> Optional[str]:
    try:
        triton = importlib.import_module("triton")
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return f"package triton not importable ({type(error).__name__}: {error})"
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_TRITON_VERSION:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON_VERSION))}"
    return None


def triton_decline_reason(device: Optional[torch.device], explicit: bool = False) -> Optional[str]:
    """None when Triton kernels can run on `device`, else why not (for the dispatcher's log).

    The CPU interpreter is for tests: it serves only calls that asked for `triton` by name
    (`explicit`), so `auto` on a CPU never picks it."""
    problem = _import_problem()
    if problem is not None:
        return problem
    if device is None:
        return None  # availability table: the package is there; per-call checks come later
    device = torch.device(device)
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None if explicit else "CPU interpreter runs only when 'triton' is requested by name"
    return f"tensors on {device.type}, Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"
