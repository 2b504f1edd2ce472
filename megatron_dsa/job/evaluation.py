"""Validation LM loss and retrieval answer accuracy."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dsa.data import Batch, make_batch, seeded_generator
from megatron_dsa.data_parallel import reshard_after_evaluation
from megatron_dsa.job.batches import batch_rows, shard_for_context_parallel
from megatron_dsa.job.config import JobConfig
from megatron_dsa.job.records import EvalStats
from megatron_dsa.job.steps import autocast, compute_loss
from megatron_dsa.model import HybridLM


def answer_hits(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """`(correct, counted)`: how many masked targets the arg-max of `logits [B, S, V]` predicts
    exactly, and how many masked targets there are (for a retrieval batch: the answer bytes)."""
    correct = ((logits.argmax(-1) == batch.targets) & batch.loss_mask).sum()
    return correct, batch.loss_mask.sum()


@torch.no_grad()
def evaluate(model: HybridLM, job: JobConfig, validation_text: torch.Tensor, device: torch.device,
             completed_steps: int) -> EvalStats:
    """Validation LM loss and retrieval answer accuracy on fixed (seed-derived) batches of
    `batch_size` rows; each DP rank evaluates its rows of every batch, in micro-batches."""
    train, task = job.train, job.retrieval_task()
    state = model.parallel_state
    cp_group = state.cp_group if state.cp_size > 1 else None
    model.eval()
    # Sums of the LM rows' losses, answer bytes right and answer bytes, on the model's device (NCCL
    # groups reduce only CUDA tensors); each CP rank holds part of every row, so all three add up.
    totals = torch.zeros(3, device=device, dtype=torch.float64)
    for index in range(train.eval_batches):
        lm_batch = make_batch(validation_text, task, train.batch_size, 0, seeded_generator(train.seed, "val-lm", index))
        retrieval_batch = make_batch(validation_text, task, train.batch_size, train.batch_size,
                                     seeded_generator(train.seed, "val-retrieval", index))
        for rows in train.micro_batch_rows(state.dp_size, state.dp_rank):
            lm = shard_for_context_parallel(batch_rows(lm_batch, None, rows, device)[0], model)
            with autocast(device, train.dtype):
                totals[0] += compute_loss(model(lm.inputs), lm, cp_group).row_losses[0].double()
            retrieval = shard_for_context_parallel(batch_rows(retrieval_batch, None, rows, device)[0], model)
            with autocast(device, train.dtype):
                hits, asked = answer_hits(model(retrieval.inputs), retrieval)
            totals[1] += hits
            totals[2] += asked
    for group in (cp_group, state.dp_group if state.dp_size > 1 else None):
        if group is not None:
            dist.all_reduce(totals, group=group)
    model.train()
    reshard_after_evaluation(model)
    return EvalStats(step=completed_steps, val_lm_loss=float(totals[0]) / (train.eval_batches * train.batch_size),
                     retrieval_accuracy=float(totals[1] / totals[2]))
