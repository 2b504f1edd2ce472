"""Tile arithmetic and row layouts shared by the Triton launchers (host side, no Triton import)."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from megatron_dsa.backends.probes import canonical_device

MIN_DOT = 16  # `tl.dot` needs every operand side >= 16
_ZEROS_PER_STREAM: dict[tuple, Tensor] = {}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The CUDA device's streaming multiprocessors (grids aim at a few programs per multiprocessor)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


INTERPRETER_PROGRAMS = 4  # the CPU interpreter runs programs one by one: a few still exercise splits and merges


def programs_in_wave(device: torch.device, per_multiprocessor: int = 1) -> int:
    """The programs a grid aims at to fill the GPU once: `per_multiprocessor` on each multiprocessor of a CUDA
    device; `INTERPRETER_PROGRAMS` interpreted."""
    return per_multiprocessor * multiprocessors(device) if device.type == "cuda" else INTERPRETER_PROGRAMS


def zeros_per_stream(name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """An int32 buffer of `shape` that the kernels on the current stream of `device` find zero and leave zero (they
    zero what they used: tickets, counts): one per (`name`, device, stream), made once and never replaced (a captured
    CUDA graph keeps its address)."""
    device = canonical_device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buffer = _ZEROS_PER_STREAM.get((name, device, stream))
    if buffer is None:
        buffer = _ZEROS_PER_STREAM[(name, device, stream)] = torch.zeros(shape, dtype=torch.int32, device=device)
    return buffer


def pow2(size: int, floor: int = 1, cap: int = 1 << 30) -> int:
    """The smallest power of two >= size, clamped to `[floor, cap]`: a block that covers `size`."""
    return min(cap, max(floor, 1 << max(0, size - 1).bit_length()))


def head_dim_chunks(dim: int) -> tuple[int, int]:
    """`(main, tail)` power-of-two chunks covering `dim` (tail 0: none), e.g. 576 → (512, 64): kernels cover a
    head dim with two power-of-two tiles instead of one of twice the size."""
    main = max(MIN_DOT, 1 << (dim.bit_length() - 1))
    rest = dim - main
    return main, (pow2(rest, MIN_DOT) if rest > 0 else 0)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launches inside run on `device` (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: float32 follows torch's own matmul setting (exact unless TF32 is
    allowed there); 16-bit inputs ignore it."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def kernel_rows(x: Tensor) -> Tensor:
    """`x [..., D]` as the row kernels read it: `[R, D]` rows with a unit column stride, their row stride
    passed to the kernel. A 2-D x whose rows are that already (a column slice of a wider tensor, like the
    layer's stacked projections) is read in place; anything else is made contiguous."""
    if x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= x.shape[1]:
        return x
    return x.contiguous().view(-1, x.shape[-1])


def fresh_rows(x: Tensor) -> Tensor:
    """A new contiguous tensor of x's shape, dtype and device (the kernels' outputs and input gradients)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
