"""Data parallelism of the main job: DP 2 (alone, × TP 2 + SP, × CP 2), replicated and FSDP2-sharded,
with gradient accumulation, against one process on the same global batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dsa import train as job_module
from megatron_dsa.data_parallel import data_parallel_size

TIGHT = dict(rtol=1e-9, atol=1e-12)  # fp64: the runs differ only in summation order
# The model returns fp32 logits (also when its weights are fp64): losses carry fp32 rounding. A
# mis-weighted aggregation (per-rank means averaged, a rank's rows counted twice) is off by ~1e-2.
STATS = dict(rtol=1e-6, atol=1e-9)


def tiny_job(tp: int, **train: object) -> job_module.JobConfig:
    from megatron_dsa.config import HybridAttentionConfig
    from megatron_dsa.model import ModelConfig

    attention = HybridAttentionConfig.from_preset("tiny", num_layers=2, layer_pattern="CW", csa_window_size=8,
                                                  dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.1)
    # 4 rows, the last a retrieval row: DP ranks see different mixes of LM and retrieval rows.
    settings = dict(seq_len=32, batch_size=4, retrieval_pairs=2, retrieval_queries=2, retrieval_fraction=0.25, warmup_steps=1, seed=5,
                    eval_batches=1)
    return job_module.JobConfig(attention.replace(sequence_parallel=tp > 1),
                                ModelConfig(ffn_hidden_size=64, max_seq_len=32),
                                job_module.TrainConfig(**{**settings, **train}))


def full_tensor(value: torch.Tensor, dim, state) -> torch.Tensor:
    """The TP = 1, unsharded tensor of a parameter or gradient (gathered over DP, then TP)."""
    import torch.distributed as dist

    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    if dim is None or state.tp_size == 1:
        return value
    parts = [torch.empty_like(value) for _ in range(state.tp_size)]
    dist.all_gather(parts, value.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim)


def assert_same_stats(got, expected, what: str) -> None:
    for name in ("loss", "lm_loss", "retrieval_loss", "grad_norm", "val_lm_loss", "retrieval_accuracy"):
        if hasattr(expected, name):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), **STATS, msg=lambda m: f"{what}: {name}: {m}")
    if hasattr(expected, "indexer_losses"):
        assert got.indexer_losses.keys() == expected.indexer_losses.keys()
        for layer, value in expected.indexer_losses.items():
            torch.testing.assert_close(got.indexer_losses[layer], value, **STATS, msg=lambda m: f"{what}: indexer L{layer}: {m}")


def data_parallel_training_body(rank: int, world: int, tp: int, cp: int, micro_batch_size: int, pack: bool,
                                checkpoint_root: str) -> None:
    """Two steps of the main job's model at DP × CP × TP, replicated and sharded, against one process
    on the same global batches: every statistic, every gathered gradient and parameter equal; the
    replicas identical on all ranks; evaluation equal. Then the sharded model's checkpoint loads into
    one process and a third step matches it."""
    import torch.distributed as dist

    from megatron_dsa.checkpointing import CheckpointWriter, load_checkpoint
    from megatron_dsa.data_parallel import shard_over_data_parallel
    from megatron_dsa.parallel import initialize_parallel_state
    from megatron_dsa.parallel.sharding import partition_dims

    cpu = torch.device("cpu")
    state = initialize_parallel_state(tp_size=tp, cp_size=cp)
    assert state.dp_size == world // (tp * cp) == 2
    job = tiny_job(tp, micro_batch_size=micro_batch_size, pack=pack)
    single_job = dataclasses.replace(tiny_job(1, pack=pack), attention=job.attention.replace(sequence_parallel=False))
    text = torch.randint(32, 127, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def build(mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = job_module.build_model(single_job if mode == "single" else job, cpu,
                                       None if mode == "single" else state).double()
        if mode == "shard":
            shard_over_data_parallel(model, state)
        return model, job_module.build_optimizer(model, job.train)

    runs = {mode: build(mode) for mode in ("single", "replicate", "shard")}
    dims = partition_dims(runs["replicate"][0])

    def compare(step: int, stats: dict) -> None:
        for mode in ("replicate", "shard"):
            assert_same_stats(stats[mode], stats["single"], f"step {step} {mode}")
            single_grads = dict(runs["single"][0].named_parameters())
            for name, param in runs[mode][0].named_parameters():
                grad = full_tensor(param.grad, dims[name], state)
                torch.testing.assert_close(grad, single_grads[name].grad, **TIGHT, msg=lambda m: f"step {step} {mode}: {name}: {m}")
                value = full_tensor(param.detach(), dims[name], state)
                torch.testing.assert_close(value, single_grads[name].detach(), **TIGHT, msg=lambda m: f"{mode}: {name}: {m}")
                if mode == "replicate":  # replicas are bit-identical, not just close
                    copies = [torch.empty_like(value) for _ in range(world)]
                    dist.all_gather(copies, value.contiguous())
                    assert all(torch.equal(copies[0], c) for c in copies), f"step {step}: {name} differs between ranks"

    for step in range(2):
        batch, packed = job_module.train_batch(job, text, step)
        compare(step, {mode: job_module.train_step(model, optimizer, batch, step, job.train, cpu, packed)
                       for mode, (model, optimizer) in runs.items()})
    evals = {mode: job_module.evaluate(model, job, text, cpu, 2) for mode, (model, _) in runs.items()}
    for mode in ("replicate", "shard"):
        assert_same_stats(evals[mode], evals["single"], f"evaluation {mode}")
    assert all(hasattr(p, "to_local") for p in runs["shard"][0].parameters()), "evaluation left FSDP unsharded"

    # The sharded model's checkpoint, loaded by one process, continues it.
    out = Path(checkpoint_root) / f"tp{tp}-cp{cp}"
    writer = CheckpointWriter(out, state)
    writer.save(2, *runs["shard"], {"step": 2})
    saved = writer.wait()
    runs["single"] = build("single")
    load_checkpoint(saved, *runs["single"], None)
    batch, packed = job_module.train_batch(job, text, 2)
    compare(2, {mode: job_module.train_step(model, optimizer, batch, 2, job.train, cpu, packed)
                for mode, (model, optimizer) in runs.items()})


@pytest.mark.parametrize("tp,cp,micro_batch_size,pack", [
    (1, 1, 1, True),  # DP 2 × 2 micro-batches of packed documents
    (2, 1, 2, False),  # DP 2 × TP 2 + SP
    (1, 2, 1, False),  # DP 2 × CP 2, 2 micro-batches
])
def test_data_parallel_training_equals_one_process(tmp_path, tp: int, cp: int, micro_batch_size: int,
                                                   pack: bool) -> None:
    from distributed import run_distributed

    run_distributed(data_parallel_training_body, 2 * tp * cp, tp, cp, micro_batch_size, pack, str(tmp_path))


def test_gradient_accumulation_equals_one_micro_batch() -> None:
    """One process: batch 4 as 4 micro-batches of 1 row == one micro-batch of 4 (fp64)."""
    cpu = torch.device("cpu")
    text = torch.randint(32, 127, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    runs = {}
    for micro in (4, 1):
        job = tiny_job(1, micro_batch_size=micro)
        model = job_module.build_model(job, cpu).double()
        optimizer = job_module.build_optimizer(model, job.train)
        stats = [job_module.train_step(model, optimizer, job_module.train_batch(job, text, step)[0], step, job.train,
                                       cpu) for step in range(2)]
        runs[micro] = stats, {name: (p.detach(), p.grad) for name, p in model.named_parameters()}
    for got, expected in zip(runs[1][0], runs[4][0]):
        assert_same_stats(got, expected, f"step {expected.step}")
    for name, (value, grad) in runs[4][1].items():
        torch.testing.assert_close(runs[1][1][name][1], grad, **TIGHT, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(runs[1][1][name][0], value, **TIGHT, msg=lambda m: f"{name}: {m}")


def test_batch_split_rules() -> None:
    train = job_module.TrainConfig(batch_size=8, micro_batch_size=2)
    assert train.accumulation_steps(2) == 2 and train.accumulation_steps(4) == 1
    assert train.micro_batch_rows(2, 1) == [slice(4, 6), slice(6, 8)]
    assert job_module.TrainConfig(batch_size=8).micro_batch_rows(4, 3) == [slice(6, 8)]
    with pytest.raises(ValueError, match=r"train.batch_size \(8\) must be divisible by train.micro_batch_size \(2\) × DP size \(8\)"):
        train.accumulation_steps(8)
    with pytest.raises(ValueError, match=r"train.batch_size \(8, the global batch\) must be divisible by the DP size 3"):
        job_module.TrainConfig(batch_size=8).accumulation_steps(3)
    with pytest.raises(ValueError, match=r"train.micro_batch_size \(3\) must divide train.batch_size"):
        job_module.TrainConfig(batch_size=8, micro_batch_size=3)
    with pytest.raises(ValueError, match="train.data_parallel must be one of"):
        job_module.TrainConfig(data_parallel="zero3")
    with pytest.raises(ValueError, match="micro_batch_size must be an integer"):
        job_module.TrainConfig(micro_batch_size="2")


def test_data_parallel_size_rules() -> None:
    assert data_parallel_size(8, 2, 2) == 2 and data_parallel_size(8, 2, 2, 2) == 2 and data_parallel_size(1, 1, 1) == 1
    with pytest.raises(ValueError, match=r"WORLD_SIZE=6 is not divisible by --tp 2 × --cp 2 = 4"):
        data_parallel_size(6, 2, 2)
    with pytest.raises(ValueError, match=r"--dp 4 × --cp 1 × --tp 2 = 8 processes, but WORLD_SIZE=4"):
        data_parallel_size(4, 2, 1, 4)
    assert job_module.layout_suffix(2, True, 1, 2) == "-tp2-sp-dp2"
    assert job_module.layout_suffix(1, False, 2, 2, True) == "-cp2-dp2-shard"
