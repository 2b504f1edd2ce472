"""Programs of one launch that meet through a ticket (the few-rows FP8 GEMM's K splits, the top-k select's chunks of a
row): each leaves its partial result in global memory and takes a ticket; the program that draws the last one reads
every partial back from L2 and puts the ticket back to zero, so the next launch (or a captured graph's replay) finds
it zero. Decorated here: this module imports triton and is imported only by kernel modules."""

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(ticket_ptr, arrivals):
    """Whether this program is the last of `arrivals` to take the ticket at `ticket_ptr`. Acquire-release: this
    program's partial is written before its ticket, and the last program sees every partial written before theirs."""
    return tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == arrivals - 1


@triton.jit
def load_partial(ptrs, mask):
    """Another program's partial, from L2 (`.cg`): never a stale line of this multiprocessor's L1."""
    return tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")


@triton.jit
def put_ticket_back(ticket_ptr):
    tl.atomic_xchg(ticket_ptr, 0)
