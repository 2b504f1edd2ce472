"""Module names say what a module is: each Triton launcher `<op>.py` is paired with its kernels
`_<op>_kernels.py` (a variant of them `_<op>_<variant>_kernels.py`), so the file that launches a kernel
and the file that holds it are found from each other's names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TRITON_KERNELS = Path(__file__).resolve().parents[1] / "megatron_dsa" / "backends" / "triton_kernels"
# Host-side helpers shared by every launcher: no kernels of their own.
HELPERS = {"__init__", "availability", "lazy_jit", "tiles"}
# In-kernel helpers shared by kernel modules (the in-kernel half of `lazy_jit`'s chained launch, the last-program
# tickets): no kernels either.
KERNEL_HELPERS = {"_grid_dependency", "_tickets"}
LAUNCHERS = sorted(p.stem for p in TRITON_KERNELS.glob("*.py") if not p.stem.startswith("_") and p.stem not in HELPERS)
KERNEL_MODULES = sorted(p.stem for p in TRITON_KERNELS.glob("_*.py") if p.stem not in {"__init__", *KERNEL_HELPERS})


def kernel_modules_named_in(stem: str) -> set[str]:
    return set(re.findall(r"\b(_[a-z0-9_]+_kernels)\b", (TRITON_KERNELS / f"{stem}.py").read_text())) & set(KERNEL_MODULES)


def owner(kernel_module: str) -> str:
    """The launcher a kernel module's name pairs it with: the longest `<op>` with `_<op>_..._kernels`."""
    owners = [op for op in LAUNCHERS if re.fullmatch(rf"_{op}(_[a-z0-9_]+)?_kernels", kernel_module)]
    return max(owners, key=len, default="")


@pytest.mark.parametrize("kernel_module", KERNEL_MODULES)
def test_every_kernel_module_is_named_after_the_launcher_that_launches_it(kernel_module: str) -> None:
    launcher = owner(kernel_module)
    assert launcher, f"{kernel_module}.py is not named _<op>[_<variant>]_kernels.py for a launcher <op>.py"
    assert kernel_module in kernel_modules_named_in(launcher), f"{launcher}.py does not launch {kernel_module}"


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_launches_only_its_own_kernels(launcher: str) -> None:
    assert f"_{launcher}_kernels" in KERNEL_MODULES, f"{launcher}.py has no _{launcher}_kernels.py"
    strangers = {module for module in kernel_modules_named_in(launcher) if owner(module) != launcher}
    assert not strangers, f"{launcher}.py launches kernels named after another op: {sorted(strangers)}"
