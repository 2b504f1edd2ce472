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
