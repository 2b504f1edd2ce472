"""The job's data: the corpus, each step's seeded batch, a DP rank's micro-batch rows and a CP rank's
part of every row."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dsa.data import (Batch, CorpusError, CorpusSplit, load_corpus_bytes, make_batch, pack_documents,
                               seeded_generator, split_corpus)
from megatron_dsa.job.config import JobConfig, TrainConfig
from megatron_dsa.job.errors import JobStopped
from megatron_dsa.model import HybridLM
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel.context import shard_sequence


def load_corpus(train: TrainConfig) -> CorpusSplit:
    """`train.corpus` (at most `corpus_max_bytes`) split into train / validation text."""
    try:
        return split_corpus(load_corpus_bytes(train.corpus, train.corpus_max_bytes))
    except CorpusError as error:
        raise JobStopped(str(error)) from error


def train_batch(job: JobConfig, text: torch.Tensor, step: int) -> tuple[Batch, Optional[PackedSeqParams]]:
    """The step's batch; with `train.pack` also the documents' boundaries in the packed stream."""
    train = job.train
    generator = seeded_generator(train.seed, "train", step)
    batch = make_batch(text, job.retrieval_task(), train.batch_size, train.retrieval_rows, generator)
    if not train.pack:
        return batch, None
    batch, cu_seqlens = pack_documents(batch, generator)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    packed = PackedSeqParams(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))
    return Batch(batch.inputs.reshape(1, -1), batch.targets, batch.loss_mask, batch.is_retrieval), packed


def shard_for_context_parallel(batch: Batch, model: HybridLM) -> Batch:
    """This CP rank's part of every row (the model's partition); the whole batch without CP."""
    state = model.parallel_state
    return context_parallel_batch(batch, state.cp_size, state.cp_rank, model.attention_config.cp_partition)


def context_parallel_batch(batch: Batch, cp_size: int, cp_rank: int, partition: str) -> Batch:
    """CP rank `cp_rank`'s part of every row `[B, S]` → `[B, S/cp]` in `partition` (the batch itself
    for one rank)."""
    if cp_size == 1:
        return batch
    shard = lambda t: shard_sequence(t, cp_size, cp_rank, partition, dim=1)  # noqa: E731
    return Batch(shard(batch.inputs), shard(batch.targets), shard(batch.loss_mask), batch.is_retrieval)


def batch_rows(batch: Batch, packed: Optional[PackedSeqParams], rows: slice, device: torch.device
               ) -> tuple[Batch, Optional[PackedSeqParams]]:
    """Rows `rows` of the `[B, S]` batch, on `device`. Of a packed batch (`inputs [1, B·S]`): those
    rows' documents, with `cu_seqlens` rebased to them (documents never cross rows)."""
    count, seq_len = batch.targets.shape
    inputs = batch.inputs.reshape(count, seq_len)[rows]
    part = Batch(inputs if packed is None else inputs.reshape(1, -1), batch.targets[rows], batch.loss_mask[rows],
                 batch.is_retrieval[rows]).to(device)
    if packed is None:
        return part, None
    boundaries = packed.cu_seqlens_q.cpu()
    first, last = rows.start * seq_len, rows.stop * seq_len
    cu_seqlens = boundaries[(boundaries >= first) & (boundaries <= last)] - first
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu_seqlens = cu_seqlens.to(device)
    return part, PackedSeqParams(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
