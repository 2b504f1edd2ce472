"""Whether Triton can run a call here: the package imports, and the tensors live on a CUDA device
(or on the CPU while the Triton interpreter is switched on)."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from megatron_dsa.backends import probes

MIN_TRITON_VERSION = (3, 0)
INSTALL_HINT = "install the [triton] extra (pip install 'megatron_dsa[triton]')"


def interpreting() -> bool:
    """True when `TRITON_INTERPRET=1`: kernels run in the CPU interpreter (tests only; slow)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _package_problem() -> Optional[str]:
    problem = probes.import_problem("triton", INSTALL_HINT)
    if problem is not None:
        return problem
    version = probes.load("triton").__version__
    if probes.version_tuple(version) < MIN_TRITON_VERSION:
        return f"triton {version} is older than {'.'.join(map(str, MIN_TRITON_VERSION))}; {INSTALL_HINT}"
    return None


def triton_decline_reason(device: Optional[torch.device], explicit: bool = False) -> Optional[str]:
    """None when Triton kernels can run on `device`, else why not (for the dispatcher's log).

    The CPU interpreter is for tests: it serves only calls that asked for `triton` by name
    (`explicit`), so `auto` on a CPU never picks it."""
    problem = _package_problem()
    if problem is not None:
        return problem
    # No device named (the availability table): this machine's default accelerator, as for the
    # vendor probes.
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None if explicit else "CPU interpreter runs only when 'triton' is requested by name"
    return f"tensors on {device.type}, Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"


def require_triton(device: torch.device, op: str, where: str) -> None:
    """Raise a `ValueError` naming `op` and its tensors (`where`, e.g. "x's device") when Triton kernels
    cannot run on `device` (an explicit call: the CPU interpreter counts)."""
    reason = triton_decline_reason(device, explicit=True)
    if reason is not None:
        raise ValueError(f"triton {op} cannot run on {where}: {reason}")
