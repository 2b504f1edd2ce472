"""Ranks that disagree or do not arrive are named: a configuration differing on one rank, a job
whose ranks were given other configs, and a rank that stalls before a barrier."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch.distributed as dist

from distributed import run_distributed
from megatron_dsa.parallel.consistency import (MissingRanksError, RankMismatchError, check_same_on_all_ranks,
                                               wait_for_all_ranks)


def mismatch_body(rank: int, world: int) -> None:
    values = {"attention": {"csa_window_size": 16 if rank < 2 else 8, "num_layers": 4},
              "train": {"lr": 1e-3, "seed": rank if rank == 1 else 0}}
    expected = ("the config differs between ranks: attention.csa_window_size: 16 on ranks 0,1, 8 on ranks 2,3; "
                "train.seed: 0 on ranks 0,2,3, 1 on rank 1")
    with pytest.raises(RankMismatchError) as raised:
        check_same_on_all_ranks("the config", values)
    assert str(raised.value) == expected
    check_same_on_all_ranks("the config", {"a": {"b": 1}})  # agreeing ranks pass


def test_a_field_differing_between_ranks_is_named_with_its_ranks() -> None:
    run_distributed(mismatch_body, 4)


def job_mismatch_body(rank: int, world: int, out: str) -> None:
    from megatron_dsa import train as job_module

    os.environ["WORLD_SIZE"] = str(world)  # as torchrun sets it
    job = job_module.JobConfig.from_yaml("configs/tiny.yaml", steps=1, out_dir=out)
    if rank == 1:
        job = dataclasses.replace(job, attention=job.attention.replace(csa_window_size=8))
    with pytest.raises(RankMismatchError, match=r"attention.csa_window_size: 16 on rank 0, 8 on rank 1"):
        job_module.run(job, tp=2)


def test_a_job_whose_ranks_hold_different_configs_stops_before_training(tmp_path) -> None:
    run_distributed(job_mismatch_body, 2, str(tmp_path / "run"))


def stall_body(rank: int, world: int) -> None:
    group = dist.new_group(backend="gloo")
    if rank == 2:
        time.sleep(6)  # stalled: arrives after the others gave up
        return
    started = time.perf_counter()
    with pytest.raises(MissingRanksError, match="job start: not every rank arrived within 2 s") as raised:
        wait_for_all_ranks(group, 2.0, "job start")
    assert time.perf_counter() - started < 5
    if rank == 0:  # the coordinator knows who is missing
        assert "2" in str(raised.value).split("arrived within")[1]


def test_a_stalled_rank_is_named_within_the_timeout() -> None:
    run_distributed(stall_body, 3, timeout_s=60)


def stalled_step_body(rank: int, world: int, out: str) -> None:
    """Rank 1 stalls while fetching its first batch; rank 0's TP all-reduce times out (the group's 8 s),
    and its error must name rank 1. Both ranks leave with os._exit: the group is broken by design."""
    from megatron_dsa import train as job_module
    from megatron_dsa.job import loop

    os.environ["WORLD_SIZE"] = str(world)
    job = job_module.JobConfig.from_yaml("configs/tiny.yaml", steps=2, out_dir=out, seq_len=64, batch_size=2,
                                         retrieval_pairs=1, retrieval_queries=2, eval_batches=1, corpus_max_bytes=200_000)
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, max_seq_len=64))
    if rank == 1:
        original = loop.train_batch  # where the training loop looks it up
        loop.train_batch = lambda *args: (time.sleep(30), original(*args))[1]
        try:
            job_module.run(job, tp=2, dist_timeout_s=8.0)
        finally:
            os._exit(0)
    started = time.perf_counter()
    with pytest.raises(MissingRanksError) as raised:
        job_module.run(job, tp=2, dist_timeout_s=8.0)
    message = str(raised.value)
    assert message.startswith("step 1: a collective timed out") and "1" in message.split("arrived within 8 s")[1], message
    assert time.perf_counter() - started < 28, "named after the timeout and the probe, not when rank 1 woke"
    os._exit(0)


def test_a_rank_stalling_mid_training_is_named_within_the_timeout(tmp_path) -> None:
    run_distributed(stalled_step_body, 2, str(tmp_path / "run"), timeout_s=120, collective_timeout_s=8)
