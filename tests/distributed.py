"""Run a test body on N real processes (gloo on CPU, NCCL on GPUs) without ever hanging.

Every rank runs `body(rank, world_size, *args)` inside an initialised default process group. A rank
that fails records its traceback; then all ranks all-reduce a failure flag (MAX) so the healthy ones
stop at the same point instead of waiting in a collective. The parent joins with a timeout, kills
stragglers and raises one AssertionError with every failing rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import traceback
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world_size: int, store_file: str, backend: str, timeout_s: float,
               body: Callable[..., Any], args: tuple, errors: Any) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A file store, not a TCP port: a port probed free and released before rank 0 binds it (seconds later,
    # after spawning and importing torch) can be taken meanwhile by any other process's socket.
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    failure = ""
    try:
        body(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent below
        failure = traceback.format_exc()
    if failure:  # report first: the flag exchange below may itself fail on a broken group
        errors.put((rank, failure))
    try:
        flag = torch.tensor([1.0 if failure else 0.0], device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        if not failure:
            errors.put((rank, "failure-flag exchange failed:\n" + traceback.format_exc()))


def run_distributed(body: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 240.0, collective_timeout_s: Optional[float] = None) -> None:
    """Run `body` on `world_size` ranks; raise AssertionError listing every failing rank. The ranks
    are killed after `timeout_s` (+30 s); a collective gives up after `collective_timeout_s`
    (default: `timeout_s`)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="megatron_dsa_store_")
    try:
        _run_ranks(ctx, errors, os.path.join(store_dir, "store"), body, world_size, args, backend, timeout_s,
                   collective_timeout_s or timeout_s)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def _run_ranks(ctx: Any, errors: Any, store_file: str, body: Callable[..., Any], world_size: int,
               args: tuple, backend: str, timeout_s: float, collective_timeout_s: float) -> None:
    procs = [ctx.Process(target=_rank_main,
                         args=(rank, world_size, store_file, backend, collective_timeout_s, body, args, errors))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s + 30)
    for p in procs:
        p.join(max(1.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    crashed = [rank for rank, p in enumerate(procs) if p.exitcode not in (0, None) and rank not in hung]
    if failures or hung or crashed:
        report = [f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures)]
        if hung:
            report.append(f"ranks {hung} did not finish within {timeout_s:.0f}s (killed)")
        if crashed:
            report.append(f"ranks {crashed} exited with codes {[procs[r].exitcode for r in crashed]}")
        raise AssertionError("distributed test failed:\n" + "\n".join(report))


def need_gpus(count: int) -> None:
    """Skip a test whose process group needs `count` CUDA GPUs on a machine with fewer (the `multigpu` marker
    only asks for two)."""
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA GPUs")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """`‖actual − expected‖ / ‖expected‖` in float64 (a norm-scale error shows here, not in cosine)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))


def assert_bf16_parity(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], tag: str) -> None:
    """bf16 parallel run vs bf16 single-device run (spec tolerance tier T5).

    Both sides are bf16, so only the order of reductions differs: cosine > 0.999 and a norm ratio
    within 2e-2. A sharding error (a missing head, a doubled gradient) gives a cosine far below 0.99
    or a norm off by 2×. Indexer parameters are trained only by the KL loss, whose gradient
    `pred − target` is a difference of nearly equal bf16-rounded probabilities, so its relative
    error is amplified: cosine > 0.99 there.
    """
    for what, actual, expected in pairs:
        actual, expected = actual.detach().float(), expected.detach().float()
        bound = 0.99 if "indexer" in what else 0.999
        assert torch.isfinite(actual).all(), f"{tag} {what}: not finite"
        assert cosine(actual, expected) > bound, f"{tag} {what}: cosine {cosine(actual, expected)}"
        ratio = abs(actual.norm() / expected.norm().clamp_min(1e-30) - 1)
        assert ratio < 2e-2, f"{tag} {what}: norm ratio off by {ratio:.2e}"
