"""The model, its optimizer, the loss, the learning-rate schedule and one optimizer step (micro-batches,
gradient reductions over CP / TP / DP, clipping)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_dsa.data import Batch
from megatron_dsa.data_parallel import is_sharded, local_grad, reduce_data_parallel_grads
from megatron_dsa.job.batches import batch_rows, shard_for_context_parallel
from megatron_dsa.job.config import JobConfig, TrainConfig
from megatron_dsa.job.errors import NonFiniteTrainingError
from megatron_dsa.job.records import StepStats
from megatron_dsa.model import SEQUENCE_PARALLEL_GRAD, HybridLM
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel import ParallelState
from megatron_dsa.parallel.sharding import partition_dim


def build_model(job: JobConfig, device: torch.device, state: Optional[ParallelState] = None) -> HybridLM:
    """A freshly initialised model; the init is a function of `train.seed` only, whatever the
    parallel layout: each rank's tensor-parallel shards are the slices of the TP = 1 model built
    with the same seed (`parallel.sharding.tensor_parallel_parameter`)."""
    torch.manual_seed(job.train.seed)
    return HybridLM(job.attention, job.model, parallel_state=state).to(device)


def build_optimizer(model: HybridLM, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm gains and attention sinks are not shrunk)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2))


def learning_rate(step: int, train: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine to `min_lr` at `decay_horizon`, constant after."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    decay_steps = max(1, train.decay_horizon - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LossParts:
    """`total` (scalar) carries the gradient. `row_losses` `[2]` (detached) sums the per-row losses of
    the LM rows and of the retrieval rows, `row_counts` `[2]` counts those rows: both add up over
    micro-batches and DP ranks (`row_losses` over CP ranks too) to the global batch's."""

    total: torch.Tensor
    row_losses: torch.Tensor
    row_counts: torch.Tensor


def compute_loss(logits: torch.Tensor, batch: Batch, cp_group: Optional[dist.ProcessGroup] = None
                 ) -> LossParts:
    """Cross entropy averaged per row over its masked targets, then over rows.

    Per-row averaging gives a retrieval row (a couple of answer bytes) the weight of an LM row.
    Under context parallelism `logits`/`batch` hold this rank's part of every row: the per-row
    target counts are summed over CP, so the CP ranks' losses add up to the full-sequence loss.
    """
    token_loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
    mask = batch.loss_mask.to(token_loss.dtype)
    sums, counts = (token_loss.view_as(mask) * mask).sum(1), mask.sum(1)
    if cp_group is not None:
        dist.all_reduce(counts, group=cp_group)
    per_row = sums / counts.clamp_min(1)
    kinds = torch.stack((~batch.is_retrieval, batch.is_retrieval)).to(per_row.dtype)  # [2, B]
    return LossParts(per_row.mean(), kinds @ per_row.detach(), kinds.sum(1))


def row_mean(row_losses: torch.Tensor, row_counts: torch.Tensor) -> Optional[float]:
    """Mean per-row loss of a kind of rows (None when the batch has none of them)."""
    return float(row_losses / row_counts) if float(row_counts) > 0 else None


def autocast(device: torch.device, dtype: str) -> torch.autocast:
    """bf16 runs matmuls in bfloat16 with float32 master weights; fp32 disables autocast."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def train_step(model: HybridLM, optimizer: torch.optim.Optimizer, batch: Batch, step: int,
               train: TrainConfig, device: torch.device,
               packed: Optional[PackedSeqParams] = None) -> StepStats:
    """One optimizer step on the global `batch` (the same `[B, S]` rows on every rank; with
    `packed`, its documents' host `cu_seqlens`): this DP rank's rows in micro-batches, gradients
    accumulated and made the global batch's, clipped, applied. The indexer KL joins the backward
    inside the C layers. The statistics are the global batch's, identical on every rank."""
    started = time.perf_counter()
    state = model.parallel_state
    lr = learning_rate(step, train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    micro_batches = train.micro_batch_rows(state.dp_size, state.dp_rank)
    optimizer.zero_grad(set_to_none=True)
    # Summed over micro-batches: the loss, the LM and retrieval rows' losses, then each C layer's KL.
    losses, counts, indexer = torch.zeros(3, device=device, dtype=torch.float64), 0, {}
    for rows in micro_batches:
        part, part_packed = batch_rows(batch, packed, rows, device)
        local = shard_for_context_parallel(part, model)
        with autocast(device, train.dtype):
            logits = model(local.inputs, part_packed)
        # A packed batch is one [1, B·S] sequence: view its logits as the [B, S] rows it was made of.
        parts = compute_loss(logits.reshape(*local.targets.shape, -1), local,
                             state.cp_group if state.cp_size > 1 else None)
        parts.total.backward()
        losses += torch.cat((parts.total.detach().reshape(1), parts.row_losses)).double()
        counts = counts + parts.row_counts.double()
        for layer, value in model.indexer_losses().items():
            indexer[layer] = indexer.get(layer, 0.0) + value
    finalize_grads(model, len(micro_batches))
    grad_norm = clip_grad_norm(model, train.grad_clip or float("inf"))
    # The norm is global (summed over TP, after the CP and DP reductions): every rank stops together.
    if not math.isfinite(float(grad_norm)):
        raise NonFiniteTrainingError(
            f"step {step + 1}: the gradient norm is {float(grad_norm)} (loss {float(losses[0]) / len(micro_batches):.4g} "
            f"on this rank); stopped before the update, so the parameters and the last checkpoint stay finite. Lower "
            f"train.lr ({lr:.3g} at this step) or set train.grad_clip, then --resume or --overwrite")
    optimizer.step()
    elapsed = time.perf_counter() - started
    layers = sorted(indexer)
    sums = torch.cat((losses, torch.tensor([indexer[n] for n in layers], dtype=torch.float64, device=device)))
    if state.cp_size > 1:  # each CP rank holds part of every row: the pieces add up
        dist.all_reduce(sums, group=state.cp_group)
    totals = torch.cat((sums, counts))
    if state.dp_size > 1:
        dist.all_reduce(totals, group=state.dp_group)
    # Every micro-batch of every DP rank has the same number of rows: the global mean is the mean of means.
    summands = state.dp_size * len(micro_batches)
    return StepStats(step=step, loss=float(totals[0]) / summands, lm_loss=row_mean(totals[1], totals[-2]),
                     retrieval_loss=row_mean(totals[2], totals[-1]),
                     indexer_losses={n: float(totals[3 + i]) / summands for i, n in enumerate(layers)},
                     grad_norm=float(grad_norm), lr=lr,
                     tokens_per_s=batch.inputs.numel() / elapsed)


def finalize_grads(model: HybridLM, accumulation_steps: int = 1) -> None:
    """Make every rank's gradients the global batch's gradients of its parameters (of its DP shard
    of them under FSDP2), from the gradients summed over `accumulation_steps` micro-batches.

    CP: each rank saw part of every sequence, so gradients are summed over CP. SP: norm weights saw
    only this rank's rows, so their gradients are summed over TP (the rest is already complete).
    DP: see `data_parallel.reduce_data_parallel_grads`.
    """
    state = model.parallel_state
    for param in model.parameters():
        grad = local_grad(param)
        if grad is None:
            continue
        if state.cp_size > 1:
            dist.all_reduce(grad, group=state.cp_group)
        if state.tp_size > 1 and getattr(param, SEQUENCE_PARALLEL_GRAD, False):
            dist.all_reduce(grad, group=state.tp_group)
    reduce_data_parallel_grads(model, state, accumulation_steps)


def clip_grad_norm(model: HybridLM, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole (unsharded) gradient: TP-split parameters contribute their
    squares summed over TP, replicated ones once; under FSDP2 every DP shard adds its squares."""
    state = model.parallel_state
    grads = [(local_grad(p), partition_dim(p) is not None) for p in model.parameters()
             if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0][0].device
    dtype = torch.promote_types(grads[0][0].dtype, torch.float32)  # bf16 gradients add up in fp32
    zero = torch.zeros((), device=device, dtype=dtype)
    split = sum((g.to(dtype).pow(2).sum() for g, is_split in grads if is_split), zero)
    whole = sum((g.to(dtype).pow(2).sum() for g, is_split in grads if not is_split), zero)
    if state.tp_size > 1:
        dist.all_reduce(split, group=state.tp_group)
    squares = split + whole
    if is_sharded(model):
        dist.all_reduce(squares, group=state.dp_group)
    norm = squares.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad, _ in grads:
        grad.mul_(scale)
    return norm
