"""Data parallelism of the main job: the outer dimension of the DP × CP × TP grid.

Every DP rank trains on its own rows of the step's global batch (`train.batch_size` rows), in
micro-batches of `train.micro_batch_size` rows; the gradients of all micro-batches on all DP ranks
are combined into the gradient of the global batch's loss, so a DP run follows the single-process
run on the same batches up to summation order. Two modes (`train.data_parallel`):

* `replicate`: every DP rank holds the whole (TP-local) model and optimizer. After the last
  micro-batch's backward the gradients are summed over the DP group in one flat all-reduce and
  scaled by 1 / (DP size × accumulation steps). An explicit all-reduce rather than torch DDP: it
  runs once per optimizer step (not per micro-batch), after the CP / SP reductions of
  `train.finalize_grads` on plain tensors, and leaves the model unwrapped.
* `shard`: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the DP group, per transformer layer
  and at the root: parameters, gradients and AdamW moments are split over DP (dim 0 of each
  TP-local tensor); parameters are all-gathered for each layer's forward and backward and the
  gradients reduce-scattered (averaged over DP) after each micro-batch's backward. It composes with
  our TP and CP because those act on the TP-local tensors FSDP2 gathers, over their own groups.

Gradients are summed over micro-batches and divided by their count afterwards (not loss / count):
the indexer KL loss joins the backward with a fixed gradient scale (`IndexerLossAutoScaler`), so
only a division of the accumulated gradients scales both losses alike.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_dsa.parallel.state import ParallelState

DATA_PARALLEL_MODES = ("replicate", "shard")


def data_parallel_size(world_size: int, tp: int, cp: int, dp: Optional[int] = None) -> int:
    """DP size of a launch of `world_size` processes at `tp` × `cp` (`dp` given: checked)."""
    for name, value in (("--tp", tp), ("--cp", cp), ("--dp", dp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * cp):
        raise ValueError(f"WORLD_SIZE={world_size} is not divisible by --tp {tp} × --cp {cp} = {tp * cp}: the "
                         f"world is a DP × CP × TP grid (launch a multiple of {tp * cp} processes)")
    inferred = world_size // (tp * cp)
    if dp is not None and dp != inferred:
        raise ValueError(f"--dp {dp} × --cp {cp} × --tp {tp} = {dp * cp * tp} processes, but WORLD_SIZE="
                         f"{world_size} (launch torchrun --nproc-per-node {dp * cp * tp})")
    return inferred


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is FSDP2-sharded over DP (`shard_over_data_parallel`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_over_data_parallel(model: nn.Module, state: ParallelState) -> None:
    """FSDP2-shard `model` (an `HybridLM`) over `state.dp_group`: each layer, then the root
    (embedding, final norm). Build the optimizer afterwards: it must see the sharded parameters.

    The tensor-parallel markers our parameters carry (split dim, SP-partial gradient) are copied to
    the sharded parameters, so checkpointing and gradient finalisation still read them."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    markers = {name: dict(vars(param)) for name, param in model.named_parameters()}
    mesh = DeviceMesh.from_group(state.dp_group, next(model.parameters()).device.type)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name, param in model.named_parameters():
        for key, value in markers[name].items():
            setattr(param, key, value)


def local_grad(param: Tensor) -> Optional[Tensor]:
    """This rank's gradient tensor of `param` (its DP shard under FSDP2), None before a backward."""
    grad = param.grad
    return grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad


def reduce_data_parallel_grads(model: nn.Module, state: ParallelState, accumulation_steps: int) -> None:
    """Turn the summed micro-batch gradients into the global batch's gradient: summed over DP
    (replicated mode; FSDP2 already averaged over DP) and divided by the number of summands."""
    grads = [grad for grad in map(local_grad, model.parameters()) if grad is not None]
    if not grads:
        return
    if is_sharded(model) or state.dp_size == 1:
        if accumulation_steps > 1:
            torch._foreach_mul_(grads, 1.0 / accumulation_steps)
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=state.dp_group)
    flat.mul_(1.0 / (state.dp_size * accumulation_steps))
    for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(reduced.view_as(grad))


def reshard_after_evaluation(model: nn.Module) -> None:
    """FSDP2 keeps the root's parameters gathered after a forward without backward: free them."""
    if is_sharded(model):
        model.reshard()
