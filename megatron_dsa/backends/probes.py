"""Shared capability checks of the vendor-kernel backends: optional packages (imported lazily, once),
package versions, the GPU generation, dtypes, one-time self-tests, and the decline rules several
backends share (dense head dims, batched layouts, fixed head dims). Every check returns None ("fine") or a
reason string. Backends share rules through this module and the registry, never by importing each other."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
from types import ModuleType
from typing import Any, Callable, Hashable, Iterable, Mapping, Optional

import torch

from megatron_dsa.device_cache import capturing

logger = logging.getLogger(__name__)
_SELF_TEST_VERDICTS: dict[Hashable, Optional[str]] = {}


@functools.lru_cache(maxsize=None)
def import_problem(module: str, install_hint: str) -> Optional[str]:
    """None when `module` imports, else why not, with how to install it (bug class A10.1)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return f"package {module} not importable ({type(error).__name__}: {error}); {install_hint}"
    return None


def load(module: str) -> ModuleType:
    """The vendor module (only called after `import_problem` said it imports)."""
    return importlib.import_module(module)


def distribution_version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions_line(*distributions: str) -> str:
    """`name version` of each installed distribution, `name -` for a missing one."""
    return ", ".join(f"{name} {distribution_version(name) or '-'}" for name in distributions)


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def cuda_capability(device: Optional[torch.device]) -> Optional[tuple[int, int]]:
    """Compute capability of `device` (the current CUDA device for None), None when not on CUDA."""
    if not torch.cuda.is_available():
        return None
    if device is None:
        return torch.cuda.get_device_capability()
    device = torch.device(device)
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor cores and conversions: Ada, Hopper and later


def fp8_capability_problem(device: Optional[torch.device], what: str) -> Optional[str]:
    """Why `what` (e.g. "FP8 GEMMs") cannot run on the CUDA `device` for want of FP8 tensor cores; None on a GPU
    that has them, and off CUDA (other rules decide there)."""
    capability = cuda_capability(device)
    if capability is None or capability >= FP8_MIN_CAPABILITY:
        return None
    return (f"{what} need compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} (FP8 tensor cores: "
            f"Ada, Hopper or later), this GPU is {capability[0]}.{capability[1]}")


def canonical_device(device: Optional[torch.device]) -> Optional[torch.device]:
    """`cuda` as `cuda:<current>`, so a call description and its tensors name one call class."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def gpu_problem(call: Mapping[str, Any], majors: Iterable[int], what: str) -> Optional[str]:
    """None when the call's device is a CUDA GPU of one of the `majors` generations (9 = SM90)."""
    capability = cuda_capability(call.get("device"))
    majors = tuple(majors)
    if capability is None:
        where = call.get("device")
        return f"{what} needs a CUDA GPU" + (f" (tensors on {torch.device(where).type})" if where else "")
    if capability[0] not in majors:
        wanted = "/".join(f"SM{major}x" for major in majors)
        return f"{what} needs {wanted}, this GPU is SM{capability[0]}{capability[1]}"
    return None


def dtype_problem(call: Mapping[str, Any], allowed: Iterable[torch.dtype]) -> Optional[str]:
    dtype = call.get("dtype")
    allowed = tuple(allowed)
    if dtype is not None and dtype not in allowed:
        return f"dtype {dtype} unsupported (needs one of {[str(d) for d in allowed]})"
    return None


# The fused dense kernels (FlashAttention, cuDNN SDPA, torch SDPA on the GPU): head dims up to 256 in
# 16-byte steps of bf16/fp16.
DENSE_MAX_HEAD_DIM = 256
DENSE_HEAD_DIM_ALIGNMENT = 8


def dense_problem(call: Mapping[str, Any], max_head_dim: int = DENSE_MAX_HEAD_DIM,
                  alignment: int = DENSE_HEAD_DIM_ALIGNMENT) -> Optional[str]:
    """Shape rules shared by the dense fused kernels: no LSE gradient, head dims ≤ `max_head_dim` (the
    vendors': 256) and a multiple of `alignment` (theirs: 16 bytes), G | H."""
    if call.get("lse_grad"):
        return "the kernel's lse carries no gradient (lse_grad needed)"
    for name in ("head_dim", "v_head_dim"):
        dim = call.get(name)
        if dim is not None and (dim > max_head_dim or dim % alignment):
            return f"{name} {dim} unsupported (needs <= {max_head_dim} and a multiple of {alignment})"
    heads, groups = call.get("heads"), call.get("groups")
    if heads is not None and groups is not None and heads % groups:
        return f"{groups} kv groups do not divide {heads} heads"
    return None


def batched_layout_problem(call: Mapping[str, Any]) -> Optional[str]:
    """Kernels on batched `[B, H, S, D]` tensors (cuDNN and torch SDPA) take whole sequences of one
    length only: the layout must be uniform."""
    layout = call.get("layout")
    if layout is not None and layout.uniform_shape is None:
        return "packed/padded layouts unsupported (batched kernel: whole sequences of one length only)"
    return None


def head_dim_problem(call: Mapping[str, Any], needed: int, what: str = "head dim") -> Optional[str]:
    """None unless the call's head dim is known and not `needed` (kernels built for one head dim)."""
    head_dim = call.get("head_dim")
    if head_dim is not None and head_dim != needed:
        return f"{what} {head_dim} unsupported (needs {needed})"
    return None



def first_problem(*problems: Optional[str]) -> Optional[str]:
    return next((problem for problem in problems if problem is not None), None)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def max_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got − expected| in float32, for the self-tests of adapters we could not run on their GPUs:
    equal infinities count as 0 (an lse of −inf on a row without keys), NaN and any other non-finite
    difference as inf."""
    got, expected = got.detach().float(), expected.detach().float()
    difference = torch.where(got == expected, 0.0, (got - expected).abs())
    return float(difference.nan_to_num(nan=float("inf"), posinf=float("inf")).max())



def kept_self_test(what: str, key: Hashable, device: torch.device, run: Callable[[], Optional[str]],
                   context: str = "") -> Optional[str]:
    """The verdict of `what`'s self-test for the call class `key`: None (passed) or why it failed.

    `run` runs once per key and its verdict is kept. A verdict kept before a CUDA-graph capture answers
    inside it; without one, a call during a capture declines (the test reads values back on the host)
    and nothing is kept. An exception from `run` is a failing verdict naming its first line (vendor
    errors run long). A failing verdict is logged once as a warning, with `context` (the call class)."""
    if key in _SELF_TEST_VERDICTS:
        return _SELF_TEST_VERDICTS[key]
    if capturing(device):
        return f"{what} cannot run its one-time self-test while a CUDA graph is captured (run one step before capturing)"
    try:
        verdict = run()
    except Exception as error:  # noqa: BLE001 - a self-test must decline, never raise
        lines = str(error).strip().splitlines()
        verdict = f"{what} failed its self-test ({type(error).__name__}{': ' + lines[0] if lines else ''}); please report"
    if verdict is not None:
        logger.warning("megatron_dsa: %s%s", verdict, f" ({context})" if context else "")
    _SELF_TEST_VERDICTS[key] = verdict
    return verdict


def forget_self_tests() -> None:
    """Drop the kept self-test verdicts (tests that fake packages or GPUs)."""
    _SELF_TEST_VERDICTS.clear()
