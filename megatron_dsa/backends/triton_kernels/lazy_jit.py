"""Decorate kernels on first launch, so that nothing imports Triton before a kernel runs, and launch them
with little host time.

Kernel modules keep their kernels as plain functions and launch them as `launcher(fn)[grid](*args)`. The
package thus imports and works (through other backends) where Triton is missing.

Interpreted or compiled is fixed per process: `triton.jit` reads `TRITON_INTERPRET` when it
decorates, and Triton decorates its own library functions (`tl.zeros`, `tl.sum`, ...) when
`triton.language` is first imported. The CPU tests therefore run the kernels in a child process
started with `TRITON_INTERPRET=1`.

Direct launches. On every launch Triton's `JITFunction.run` binds the arguments, works out their
specialization (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16), builds a cache-key
string from the options, checks the kernel's global values and builds launch metadata for hooks. Inside
a layer step that costs 25-40 µs of host time per launch on an H200 host, against about 15 µs for the
launch itself, and an eager step is bound by its host time. `KernelLauncher` keeps Triton's own argument
binder, so the specialization (hence the compiled kernel) is exactly the one Triton would pick, and after
the first launch of each (device, specialization, options), which goes through Triton and compiles or
finds the kernel, hands the bound arguments straight to the compiled kernel's launcher. It does so only
on Triton versions whose launch path it mirrors (`DIRECT_LAUNCH_VERSIONS`, read in their source and run
on GPUs), with no launch hooks installed (profilers such as proton install them) and no pre-run hooks;
everything else, and `MEGATRON_DSA_TRITON_DIRECT_LAUNCH=0`, takes Triton's path.

Chained launches. A decode step runs ~35 short kernels back to back, each normally placed on the GPU only once
the one before it has finished. A kernel launched with `chained_launch(device)`'s options on a Hopper or later
GPU (programmatic dependent launch) is placed on the SMs while the kernel before it still runs and waits there,
in its first statement (`_grid_dependency.wait_for_previous_kernel`), for that kernel's end and writes: its
launch and start overlap the previous kernel (a C decode step 2–4% faster on an H200, docs/performance.md).
Only inside `chained_launches()`, which a layer's calls through an inference cache enter: one process, one stream,
kernels in order (a cache refuses context and sequence parallelism). Training steps keep plain launches: chaining
next to the context-parallel ring's side streams and events was not validated on GPUs.
`MEGATRON_DSA_TRITON_CHAINED_LAUNCH=0` turns it off (benchmarks compare both).
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections import Counter
from contextvars import ContextVar
from typing import Any, Callable, Hashable, Iterator, Optional, Union

import torch

from megatron_dsa.backends import probes

# Triton versions (major, minor) whose `JITFunction.run` this module's direct launch mirrors: the
# binder in `device_caches[device][4]`, the `debug` and `instrumentation_mode` options it adds, and
# `CompiledKernel.run(grid..., stream, function, packed_metadata, metadata, enter, exit, *args)`.
DIRECT_LAUNCH_VERSIONS = frozenset({(3, 6)})
# Read once; tests and benchmarks switch it per process (or patch it) to compare both paths.
DIRECT_LAUNCH = os.environ.get("MEGATRON_DSA_TRITON_DIRECT_LAUNCH", "1") != "0"
# Launches per path ("direct" or "triton"), and of them the "chained" ones: the GPU tests check these paths ran.
LAUNCHES: Counter = Counter()
# Read once, as DIRECT_LAUNCH.
CHAINED_LAUNCH = os.environ.get("MEGATRON_DSA_TRITON_CHAINED_LAUNCH", "1") != "0"
CHAINED_LAUNCH_MIN_CAPABILITY = (9, 0)  # griddepcontrol: Hopper and later
_CHAINING: ContextVar[bool] = ContextVar("megatron_dsa_chained_launches", default=False)


@contextlib.contextmanager
def chained_launches() -> Iterator[None]:
    """Within it, kernels that take `CHAINED` are launched chained where the GPU has it (`chained_launch`; module
    docstring). For code whose kernels run on one stream in order: an inference cache's calls."""
    token = _CHAINING.set(True)
    try:
        yield
    finally:
        _CHAINING.reset(token)


def chained_launch(device: torch.device) -> dict[str, bool]:
    """Launch options of a kernel that takes the constexpr `CHAINED` and begins with
    `_grid_dependency.wait_for_previous_kernel(CHAINED)` (module docstring): inside `chained_launches()` a chained
    launch on CUDA GPUs that have it; `CHAINED=False` (no code) elsewhere and under the interpreter."""
    chained = CHAINED_LAUNCH and _CHAINING.get() and device.type == "cuda" and _chains_on(device.index)
    return {"CHAINED": True, "launch_pdl": True} if chained else {"CHAINED": False}


@functools.lru_cache(maxsize=None)
def _chains_on(index: Optional[int]) -> bool:
    capability = probes.cuda_capability(torch.device("cuda", index) if index is not None else None)
    return capability is not None and capability >= CHAINED_LAUNCH_MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def jitted(fn: Callable[..., None]) -> Any:
    """`triton.jit(fn)`, decorated once on first use."""
    import triton

    return triton.jit(fn)


@functools.lru_cache(maxsize=None)
def launcher(fn: Union[Callable[..., None], Any]) -> "KernelLauncher":
    """The launcher of `fn`: a plain kernel function (decorated by `jitted`) or one already jitted (a
    Gluon kernel). Index it like a kernel: `launcher(fn)[grid](*args, **constexprs_and_options)`."""
    return KernelLauncher(jitted(fn) if isinstance(fn, types.FunctionType) else fn)


@functools.lru_cache(maxsize=None)
def _version_mirrored() -> bool:
    import triton

    return probes.version_tuple(triton.__version__)[:2] in DIRECT_LAUNCH_VERSIONS


def _no_launch_hooks(knobs: Any) -> bool:
    """True when no launch hook is installed (a hook chain without calls; anything unknown counts as a hook)."""
    return not (getattr(knobs.runtime.launch_enter_hook, "calls", True)
                or getattr(knobs.runtime.launch_exit_hook, "calls", True))


_MISSING = object()


def _globals_unchanged(kernel: Any) -> bool:
    """Triton's per-launch check: every global value the kernel read when compiled is still the same."""
    return all(scope.get(name, _MISSING) == value for (name, _), (value, scope) in kernel.used_global_vals.items())


class KernelLauncher:
    """A jitted kernel (`kernel`) launched as `launcher[grid](*args, **options)`, as the kernel itself is,
    directly through the compiled kernel after the first launch of each specialization (module docstring).
    Under the interpreter or where the direct path does not apply, every launch is Triton's."""

    def __init__(self, kernel: Any):
        from triton.runtime.jit import JITFunction

        self.kernel = kernel
        # An interpreted kernel is no JITFunction.
        self._direct = isinstance(kernel, JITFunction) and _version_mirrored()
        self._compiled: dict[Hashable, Any] = {}
        if self._direct:
            from triton import knobs
            from triton.runtime.driver import driver

            self._knobs, self._driver = knobs, driver

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self._launch, grid)

    def _launch(self, grid: Any, *args: Any, **options: Any) -> Any:
        kernel = self.kernel
        if options.get("launch_pdl"):
            LAUNCHES["chained"] += 1
        if (not (DIRECT_LAUNCH and self._direct) or kernel.pre_run_hooks or not _no_launch_hooks(self._knobs)
                or not _globals_unchanged(kernel)):  # Triton's path raises for a changed global
            return self._triton_launch(grid, args, options)
        device = self._driver.active.get_current_device()
        bound, key = self._bind(device, args, options)
        compiled = self._compiled.get(key) if key is not None else None
        if compiled is None:
            return self._through_triton(device, key, grid, args, options)
        if callable(grid):
            grid = grid(bound)
        LAUNCHES["direct"] += 1
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     self._driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *bound.values())
        return compiled

    def _bind(self, device: int, args: tuple, options: dict) -> tuple[Optional[dict], Optional[Hashable]]:
        """`(bound arguments, key of the compiled kernel)` by Triton's binder for `device`, with the options
        Triton's `run` adds, so that the key names the kernel Triton compiled; `(None, None)` before the
        first launch on `device` (Triton makes the binder then)."""
        caches = self.kernel.device_caches.get(device)
        if caches is None:
            return None, None
        knobs = self._knobs
        bound, specialization, bound_options = caches[4](
            *args, **{**options, "debug": options.get("debug", self.kernel.debug) or knobs.runtime.debug,
                      "instrumentation_mode": knobs.compilation.instrumentation_mode})
        return bound, (device, tuple(specialization), tuple(bound_options.items()))

    def _through_triton(self, device: int, key: Optional[Hashable], grid: Any, args: tuple, options: dict) -> Any:
        """Triton's launch (it compiles or finds the kernel); its compiled kernel serves `key` from now on."""
        compiled = self._triton_launch(grid, args, options)
        if key is None:
            key = self._bind(device, args, options)[1]
        if key is not None and compiled is not None and not hasattr(compiled, "result"):
            self._compiled[key] = compiled
        return compiled

    def _triton_launch(self, grid: Any, args: tuple, options: dict) -> Any:
        LAUNCHES["triton"] += 1
        return self.kernel[grid](*args, **options)
