"""The in-kernel half of a chained launch (`lazy_jit.chained_launch`, programmatic dependent launch on Hopper and
later): a kernel launched while the kernel before it on the stream still runs waits here, before its first
memory access, until that kernel has finished and its writes are visible, then lets the kernel after it be
launched in turn. Decorated here: this module imports triton and is imported only by kernel modules."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(CHAINED: tl.constexpr):
    """First statement of a kernel that takes `CHAINED` (`lazy_jit.chained_launch`'s constexpr); no code when
    it is False (other GPUs, the interpreter)."""
    if CHAINED:
        gdc_wait()
        gdc_launch_dependents()
