"""The main job's checkpoints: sharded, resharding on load, asynchronous and atomic.

    <out_dir>/checkpoints/step-000100/   one torch.distributed.checkpoint directory per saved step
    <out_dir>/checkpoints/latest         the name of the newest complete checkpoint

Every rank writes its own shards. Tensor-parallel parameters and their optimizer moments are saved
as DTensors sharded over the TP group, so a checkpoint saved at one TP / CP / DP size loads at
another (replicas, e.g. the CP and replicated DP ranks' copies, are written once). Under FSDP2 (sharded data
parallelism) the parameters and moments are DTensors split over DP already; a TP-split one is saved
as a DTensor over the (TP, DP) mesh, so the files do not depend on the DP mode either. `save` copies the state to host memory and
returns; the files are written by a background thread while training goes on, over a gloo group of
their own so the writer's collectives never interleave with the training's NCCL ones. A save is
committed (`step-N.partial` renamed to `step-N`, `latest` replaced, the older checkpoint removed)
only after every rank finished writing, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from megatron_dsa.parallel.sharding import partition_dims
from megatron_dsa.parallel.state import ParallelState

CHECKPOINTS_DIR = "checkpoints"
LATEST_NAME = "latest"
PARTIAL_SUFFIX = ".partial"


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    """The newest committed checkpoint under `out_dir`, or None."""
    pointer = Path(out_dir) / CHECKPOINTS_DIR / LATEST_NAME
    if not pointer.is_file():
        return None
    return pointer.parent / pointer.read_text().strip()


def _world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _Sharding:
    """Wraps a rank's TP-split tensors as DTensors over the TP group (identity without TP)."""

    def __init__(self, model: nn.Module, state: Optional[ParallelState]):
        self.dims = partition_dims(model)
        self.state = state
        self.mesh = None
        if state is not None and state.tp_size > 1:
            from torch.distributed.device_mesh import DeviceMesh

            device = next(model.parameters()).device.type
            self.mesh = DeviceMesh.from_group(state.tp_group, device)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return {key: self._dtensor(value, self.dims.get(key)) for key, value in model.state_dict().items()}

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name; moments shaped like their parameter are split with it."""
        state = get_optimizer_state_dict(model, optimizer)
        state["state"] = {name: {key: self._dtensor(value, self.dims.get(name))
                                 if isinstance(value, Tensor) and value.dim() > 0 else value
                                 for key, value in moments.items()}
                          for name, moments in state["state"].items()}
        return state

    def _dtensor(self, value: Any, dim: Optional[int]) -> Any:
        if self.mesh is None or dim is None or not isinstance(value, Tensor):
            return value
        from torch.distributed.tensor import DTensor, Shard

        if isinstance(value, DTensor):  # FSDP2's DP shard of this rank's TP part
            return self._over_tp_and_dp(value, dim)
        shape = list(value.shape)
        shape[dim] *= self.mesh.size()
        return DTensor.from_local(value, self.mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())


    def _over_tp_and_dp(self, value: Any, dim: int) -> Any:
        """`value` (FSDP2: dim 0 of this rank's TP part split over DP) as one DTensor over the
        (TP, DP) mesh: TP splits `dim` first, DP then splits dim 0 of each TP part, in mesh order."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if not hasattr(self, "tp_dp_mesh"):
            rank = dist.get_rank()
            tp_ranks = dist.get_process_group_ranks(self.state.tp_group)
            dp_ranks = dist.get_process_group_ranks(self.state.dp_group)
            # Megatron order: rank = dp_rank·cp·tp + cp_rank·tp + tp_rank, so offsets add up.
            grid = torch.tensor([[t + d - rank for d in dp_ranks] for t in tp_ranks])
            self.tp_dp_mesh = DeviceMesh.from_group([self.state.tp_group, self.state.dp_group],
                                                    value.device_mesh.device_type, mesh=grid,
                                                    mesh_dim_names=("tp", "dp"))
        shape = list(value.shape)
        shape[dim] *= self.state.tp_size
        return DTensor.from_local(value.to_local(), self.tp_dp_mesh, [Shard(dim), *value.placements],
                                  run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())


def _local(value: Any, like: Any) -> Any:
    """`value` as the model / optimizer hold it (`like`, recursing into dicts): a DTensor's local
    shard, or under FSDP2 that shard as a DTensor over DP again."""
    if isinstance(value, dict):
        return {key: _local(item, like[key]) for key, item in value.items()}
    if not hasattr(value, "to_local"):
        return value
    if hasattr(like, "to_local"):
        if value.device_mesh == like.device_mesh:
            return value
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.to_local(), like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    return value.to_local()


class CheckpointWriter:
    """Saves `{model, optimizer, extra}` under `<out_dir>/checkpoints` (see the module docstring).

    `save` returns once the state is copied to host memory; `wait` finishes the pending save and
    commits it (every rank calls both, in the same order)."""

    def __init__(self, out_dir: Path, state: Optional[ParallelState]):
        self.root = Path(out_dir) / CHECKPOINTS_DIR
        self.state = state
        # The background writer's collectives run on their own gloo group (every rank takes part).
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: Optional[tuple[Future, Path, float]] = None
        self.last_save_seconds: Optional[float] = None  # wall time of the last committed save

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
        self.wait()
        started = time.perf_counter()
        partial = self.root / (checkpoint_dir_name(step) + PARTIAL_SUFFIX)
        if _world_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crashed earlier attempt
            partial.mkdir(parents=True)
        if self.group is not None:
            dist.barrier(group=self.group)
        sharding = _Sharding(model, self.state)
        # `extra` travels as one JSON string: nested lists would be flattened into per-item keys.
        state = {"model": sharding.model_state(model), "optimizer": sharding.optimizer_state(model, optimizer),
                 "extra": json.dumps(extra)}
        torch.save(_rng_state(), partial / f"rng-rank{_world_rank()}.pt")
        with _single_process_quiet():
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
        self.pending = (getattr(future, "upload_completion", future), partial, started)

    def wait(self) -> Optional[Path]:
        """Finish the pending save (if any) and commit it; returns the committed directory."""
        if self.pending is None:
            return None
        future, partial, started = self.pending
        self.pending = None
        future.result()  # on rank 0 this includes the metadata, written after every rank's shards
        final = partial.with_name(partial.name[:-len(PARTIAL_SUFFIX)])
        if _world_rank() == 0:
            self._commit(partial, final)
        if self.group is not None:
            dist.barrier(group=self.group)  # nobody looks for `latest` before it names this save
        self.last_save_seconds = time.perf_counter() - started
        return final

    def _commit(self, partial: Path, final: Path) -> None:
        previous = latest_checkpoint(self.root.parent)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        pointer = self.root / LATEST_NAME
        staged = pointer.with_suffix(PARTIAL_SUFFIX)
        staged.write_text(final.name + "\n")
        os.replace(staged, pointer)
        if previous is not None and previous != final:
            shutil.rmtree(previous, ignore_errors=True)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: Optional[ParallelState]) -> dict[str, Any]:
    """Load a checkpoint directory into `model` and `optimizer` at this run's TP / CP layout and
    return the `extra` it was saved with (JSON: dict keys come back as strings). The RNG state is
    restored when this rank saved one and the world size is the same."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (a checkpoint directory holds "
                                f"'.metadata'; the newest is named in <out>/{CHECKPOINTS_DIR}/{LATEST_NAME})")
    sharding = _Sharding(model, state)
    model_state = sharding.model_state(model)
    optimizer_state = sharding.optimizer_state(model, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state, "extra": ""}
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    with _single_process_quiet():
        dcp.load(loaded, checkpoint_id=str(path), process_group=group)
    model.load_state_dict(_local(loaded["model"], model.state_dict()))
    set_optimizer_state_dict(model, optimizer, _local(loaded["optimizer"], get_optimizer_state_dict(model, optimizer)))
    extra = json.loads(loaded["extra"])
    rng = path / f"rng-rank{_world_rank()}.pt"
    if rng.is_file() and extra.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1):
        _set_rng_state(torch.load(rng, weights_only=True))
    return extra


@contextlib.contextmanager
def _single_process_quiet():
    """Without torch.distributed the checkpoint API warns that it assumes one process: it does."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(saved: dict[str, Any]) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
