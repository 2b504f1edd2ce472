"""The main job's checkpoints: sharded, resharding on load, asynchronous, atomic and verified.

    <out_dir>/checkpoints/step-000100/   one torch.distributed.checkpoint directory per saved step
    <out_dir>/checkpoints/latest         the name of the newest complete checkpoint

Every rank writes its own shards. Tensor-parallel parameters and their optimizer moments are saved
as DTensors sharded over the TP group, so a checkpoint saved at one TP / CP / DP size loads at
another (replicas, e.g. the CP and replicated DP ranks' copies, are written once). Under FSDP2
(sharded data parallelism) the parameters and moments are DTensors split over DP already; a
TP-split one is saved as a DTensor over the (TP, DP) mesh, so the files do not depend on the DP
mode either.

`save` refuses non-finite state, then starts copying the state into host buffers that are reused
from save to save (pinned, filled on a side CUDA stream; `prepare` allocates them in the
background ahead of the first save) and returns: the next forward and backward
overlap the copy, and only the next optimizer update waits for it. A background thread writes the
files once the copy is done, over a gloo group of its own so the writer's collectives never
interleave with the training's NCCL ones, and hashes what this rank wrote. The same thread commits
the save (`manifest.json` written, `step-N.partial` renamed to `step-N`, `latest` replaced, the
older checkpoint removed) as soon as every rank finished writing, and not before, so a crash
mid-save leaves the previous checkpoint intact.

`manifest.json` holds the step, the config and its fingerprint, the saving layout (world, TP and
CP sizes, each rank's TP / CP rank) and every file's size and SHA-256. `load_checkpoint` checks the
files against it (each rank a share of them) and that every rank loads the same checkpoint before
any state is read.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import random
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megatron_dsa.parallel.consistency import gather_objects
from megatron_dsa.parallel.sharding import partition_dims
from megatron_dsa.parallel.state import ParallelState

CHECKPOINTS_DIR = "checkpoints"
LATEST_NAME = "latest"
PARTIAL_SUFFIX = ".partial"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read safely (the message names the file or tensor)."""


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    """The newest committed checkpoint under `out_dir`, or None."""
    pointer = Path(out_dir) / CHECKPOINTS_DIR / LATEST_NAME
    if not pointer.is_file():
        return None
    return pointer.parent / pointer.read_text().strip()


def fingerprint(value: Any) -> str:
    """SHA-256 of `value`'s canonical JSON (key order does not matter)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _group_rank_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _map_tensors(value: Any, function: Callable[[str, Tensor], Any], path: str = "") -> Any:
    """`value` (nested dicts) with every tensor `t` at key path `path` replaced by `function(path, t)`."""
    if isinstance(value, dict):
        return {key: _map_tensors(item, function, f"{path}/{key}") for key, item in value.items()}
    return function(path, value) if isinstance(value, Tensor) else value


def _tensors(value: Any) -> dict[str, Tensor]:
    """`{key path: tensor}` of a nested dict."""
    found: dict[str, Tensor] = {}
    _map_tensors(value, found.__setitem__)
    return found


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's model and optimizer state (its TP shards), the optimizer's keyed by parameter name."""
    return {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}


class _Sharding:
    """Wraps a rank's TP-split tensors (and the moments shaped like them) as DTensors over the TP
    group; the identity without TP."""

    def __init__(self, model: nn.Module, state: Optional[ParallelState], device_type: str):
        self.dims = partition_dims(model)
        self.state = state
        self.mesh = None
        if state is not None and state.tp_size > 1:
            self.mesh = DeviceMesh.from_group(state.tp_group, device_type)

    def wrap(self, local: dict[str, Any]) -> dict[str, Any]:
        optimizer = dict(local["optimizer"])
        optimizer["state"] = {name: {key: self._dtensor(value, self.dims.get(name))
                                     if isinstance(value, Tensor) and value.dim() > 0 else value
                                     for key, value in moments.items()}
                              for name, moments in optimizer["state"].items()}
        return {"model": {key: self._dtensor(value, self.dims.get(key)) for key, value in local["model"].items()},
                "optimizer": optimizer}

    def _dtensor(self, value: Any, dim: Optional[int]) -> Any:
        if self.mesh is None or dim is None or not isinstance(value, Tensor):
            return value
        if isinstance(value, DTensor):  # FSDP2's DP shard of this rank's TP part
            return self._over_tp_and_dp(value, dim)
        shape = list(value.shape)
        shape[dim] *= self.mesh.size()
        return DTensor.from_local(value, self.mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def _over_tp_and_dp(self, value: Any, dim: int) -> Any:
        """`value` (FSDP2: dim 0 of this rank's TP part split over DP) as one DTensor over the
        (TP, DP) mesh: TP splits `dim` first, DP then splits dim 0 of each TP part, in mesh order."""
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
        return DTensor.from_local(value.to_local(), like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    return value.to_local()


def _local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of `tensor` (a DTensor's local shard, a plain tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def non_finite_tensors(state: dict[str, Any]) -> list[str]:
    """Key paths of the tensors of `state` whose local part holds NaN or inf."""
    floating = {path: _local_tensor(tensor) for path, tensor in _tensors(state).items() if tensor.is_floating_point()}
    # One host sync per device: a sum is non-finite when any element is (or, rarely, when it overflows).
    sums: dict[torch.device, list[Tensor]] = {}
    for tensor in floating.values():
        sums.setdefault(tensor.device, []).append(tensor.detach().sum(dtype=torch.float64))
    if all(bool(torch.stack(values).isfinite().all()) for values in sums.values()):
        return []
    return [path.strip("/") for path, tensor in floating.items() if not torch.isfinite(tensor).all()]


class _HostStaging:
    """Host copies of the state's tensors, allocated once and reused (pinned for CUDA tensors).

    CUDA tensors are copied on a side stream: `copied` is recorded after the last copy; the writer
    waits for it on the host, and an optimizer update waits for it on the GPU (`hold_updates`).
    A DTensor (FSDP2's DP shard) is staged as its local shard, wrapped again over a host mesh of the
    same ranks (a DTensor's local tensor lives on its mesh's device type)."""

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}
        self.host_meshes: dict[int, DeviceMesh] = {}
        self.copied: Optional[torch.cuda.Event] = None
        self.allocated_bytes = 0

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        cuda = [local for local in map(_local_tensor, _tensors(state).values()) if local.is_cuda]
        if not cuda:
            return _map_tensors(state, self._copy)
        stream = torch.cuda.Stream(cuda[0].device)
        stream.wait_stream(torch.cuda.current_stream(cuda[0].device))
        for tensor in cuda:  # the allocator must not hand their memory out while the side stream reads
            tensor.record_stream(stream)
        with torch.cuda.stream(stream):
            staged = _map_tensors(state, self._copy)
        self.copied = torch.cuda.Event()
        self.copied.record(stream)
        return staged

    def allocate(self, specs: dict[str, tuple[torch.Size, torch.dtype, bool]]) -> None:
        """Make the buffers for `{key path: (shape, dtype, pinned)}` (pinning gigabytes takes seconds)."""
        for path, (shape, dtype, pinned) in specs.items():
            buffer = self.buffers.get(path)
            if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
                self.buffers[path] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
                self.allocated_bytes += self.buffers[path].numel() * self.buffers[path].element_size()

    def _copy(self, path: str, tensor: Tensor) -> Tensor:
        local = _local_tensor(tensor)
        self.allocate({path: (local.shape, local.dtype, local.is_cuda)})
        buffer = self.buffers[path]
        buffer.copy_(local.detach(), non_blocking=local.is_cuda)
        if not isinstance(tensor, DTensor):
            return buffer
        return DTensor.from_local(buffer, self._host_mesh(tensor.device_mesh), tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())

    def _host_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        if mesh.device_type == "cpu":
            return mesh
        if mesh.ndim != 1:
            raise NotImplementedError(f"staging a DTensor over a {mesh.ndim}-D device mesh")
        if id(mesh) not in self.host_meshes:
            self.host_meshes[id(mesh)] = DeviceMesh.from_group(mesh.get_group(), "cpu")
        return self.host_meshes[id(mesh)]

    def hold_updates(self, *unused: Any) -> None:
        """Optimizer step pre-hook: the update waits (on the GPU) until the copy has read the state."""
        if self.copied is not None:
            torch.cuda.current_stream().wait_event(self.copied)
            self.copied = None


class CheckpointWriter:
    """Saves `{model, optimizer, extra}` under `<out_dir>/checkpoints` (see the module docstring).

    `save` returns once the copy to host memory is under way; the save commits itself in the
    background once every rank wrote it; `wait` waits for that (every rank calls both, in the same
    order). `extra` must be JSON; its `config` entry, if any, is in the manifest with its fingerprint.
    `timeout`: how long the writer's collectives wait for a stalled rank (the job's `--dist-timeout`)."""

    def __init__(self, out_dir: Path, state: Optional[ParallelState],
                 timeout: Optional[datetime.timedelta] = None):
        self.root = Path(out_dir) / CHECKPOINTS_DIR
        self.state = state
        # The background writer's collectives run on their own gloo group (every rank takes part).
        self.group = _checkpoint_group(timeout)
        self.staging = _HostStaging()
        self.hooked: set[int] = set()  # optimizers whose updates wait for the staging copy
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.preparing: Optional[Future] = None  # the background allocation of `prepare`
        self.pending: Optional[Future] = None  # the background write (and commit) of the last save
        self.last_staging_seconds: Optional[float] = None  # host time `save` took
        self.last_save_seconds: Optional[float] = None  # wall time of the last committed save

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Allocate the host buffers for this state in the background (call it once the optimizer
        has its state, e.g. after the first step), so the first `save` does not wait for them."""
        specs = {path: (local.shape, local.dtype, local.is_cuda)
                 for path, local in ((path, _local_tensor(tensor))
                                     for path, tensor in _tensors(_local_state(model, optimizer)).items())}
        self.preparing = self.executor.submit(self.staging.allocate, specs)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
        self.wait()
        started = time.perf_counter()
        if self.preparing is not None:
            self.preparing.result()
            self.preparing = None
        local = _local_state(model, optimizer)
        self._check_finite(local, step)
        partial = self.root / (checkpoint_dir_name(step) + PARTIAL_SUFFIX)
        if _world_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crashed earlier attempt
            partial.mkdir(parents=True)
        if self.group is not None:
            dist.barrier(group=self.group)
        if id(optimizer) not in self.hooked:
            optimizer.register_step_pre_hook(self.staging.hold_updates)
            self.hooked.add(id(optimizer))
        staged = _Sharding(model, self.state, "cpu").wrap(self.staging.stage(local))
        # `extra` travels as one JSON string: nested lists would be flattened into per-item keys.
        staged["extra"] = json.dumps(extra)
        torch.save(_rng_state(), partial / _rng_name(_world_rank()))
        manifest = {"format": MANIFEST_FORMAT, "step": step, "config": extra.get("config"),
                    "config_fingerprint": fingerprint(extra["config"]) if "config" in extra else None,
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "tp_size": self.state.tp_size if self.state else 1,
                    "cp_size": self.state.cp_size if self.state else 1}
        layout = {"rank": _world_rank(), "tp_rank": self.state.tp_rank if self.state else 0,
                  "cp_rank": self.state.cp_rank if self.state else 0}
        self.pending = self.executor.submit(self._write, staged, partial, self.staging.copied,
                                            {"manifest": manifest, "layout": layout}, started)
        self.last_staging_seconds = time.perf_counter() - started

    def _check_finite(self, local: dict[str, Any], step: int) -> None:
        """Every rank raises when any rank's shards hold NaN or inf (no rank is left in a barrier)."""
        bad = non_finite_tensors(local)
        everyone = gather_objects(bad, self.group)
        if any(everyone):
            named = [f"{path} (rank {rank})" for rank, paths in enumerate(everyone) for path in paths]
            raise CheckpointError(f"refusing to checkpoint step {step}: non-finite values in {named[:3]}"
                                  + (f" and {len(named) - 3} more tensors" if len(named) > 3 else ""))

    def _write(self, staged: dict[str, Any], partial: Path, copied: Optional[torch.cuda.Event],
               described: dict[str, Any], started: float) -> Path:
        """Background thread: write this rank's shards, hash the files it wrote and, once every rank
        has, commit the save (this thread is the only user of the writer's group)."""
        if copied is not None:
            copied.synchronize()
        with _single_process_quiet():
            dcp.save(staged, checkpoint_id=str(partial), process_group=self.group)
        rank = _world_rank()
        mine = sorted(partial.glob(f"__{rank}_*.distcp")) + [partial / _rng_name(rank)]
        if rank == 0:
            mine.append(partial / ".metadata")  # written by the coordinator once every rank's shards are
        files = {path.name: _file_digest(path) for path in mine}
        written = gather_objects({"files": files, **described["layout"]}, self.group)
        final = partial.with_name(partial.name[:-len(PARTIAL_SUFFIX)])
        if rank == 0:
            manifest = dict(described["manifest"],
                            ranks=[{key: value for key, value in entry.items() if key != "files"} for entry in written],
                            files={name: digest for entry in written for name, digest in entry["files"].items()})
            _write_atomically(partial / MANIFEST_NAME, json.dumps(manifest, indent=1))
            self._commit(partial, final)
        if self.group is not None:
            dist.barrier(group=self.group)  # nobody looks for `latest` before it names this save
        self.last_save_seconds = time.perf_counter() - started
        return final

    def wait(self) -> Optional[Path]:
        """Wait for the pending save (if any), committed as soon as every rank wrote it; returns its
        directory. Raises what the background write raised."""
        if self.pending is None:
            return None
        future, self.pending = self.pending, None
        return future.result()

    def _commit(self, partial: Path, final: Path) -> None:
        previous = latest_checkpoint(self.root.parent)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _write_atomically(self.root / LATEST_NAME, final.name + "\n")
        if previous is not None and previous != final:
            shutil.rmtree(previous, ignore_errors=True)


def _rng_name(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def _write_atomically(path: Path, text: str) -> None:
    staged = path.with_name(path.name + PARTIAL_SUFFIX)
    staged.write_text(text)
    os.replace(staged, path)


def _file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def verify_checkpoint(path: Path, group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """Check the files of the checkpoint directory `path` against its manifest, each rank of `group`
    a share of them, and that every rank names the same checkpoint; returns the manifest. Raises
    `CheckpointError` naming the damaged files (on every rank)."""
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    rank, size = _group_rank_size(group)
    problems = [problem for name in sorted(files)[rank::size]
                if (problem := _file_problem(path / name, files[name])) is not None]
    problems = [problem for share in gather_objects(problems, group) for problem in share]
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems[:3])
                              + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    readers = gather_objects((str(path.resolve()), fingerprint(manifest)), group)
    if len(set(readers)) > 1:
        raise CheckpointError("the ranks resume from different checkpoints: "
                              + ", ".join(f"rank {index}: {where}" for index, (where, _) in enumerate(readers)))
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory `path` (step, config, layout, files), unverified."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (a checkpoint directory holds "
                                f"'.metadata'; the newest is named in <out>/{CHECKPOINTS_DIR}/{LATEST_NAME})")
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("step"), int):
            raise ValueError("no 'files' or 'step' entry")
    except (OSError, ValueError, AttributeError) as error:
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST_NAME} is missing or damaged ({error}); "
                              f"it cannot be verified") from error
    return manifest


def _file_problem(path: Path, expected: dict[str, Any]) -> Optional[str]:
    if not path.is_file():
        return f"{path.name} is missing"
    found = _file_digest(path)
    if found["bytes"] != expected["bytes"]:
        return f"{path.name} has {found['bytes']} bytes, the manifest says {expected['bytes']} (truncated?)"
    if found["sha256"] != expected["sha256"]:
        return f"{path.name} does not match its SHA-256 in the manifest (corrupted)"
    return None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: Optional[ParallelState], timeout: Optional[datetime.timedelta] = None) -> dict[str, Any]:
    """Verify the checkpoint directory `path` (see `verify_checkpoint`), load it into `model` and
    `optimizer` at this run's TP / CP layout and return the `extra` it was saved with (JSON: dict
    keys come back as strings). The RNG state is restored when this rank saved one and the world
    size is the same. `timeout`: how long the load's collectives wait for a stalled rank."""
    path = Path(path)
    group = _checkpoint_group(timeout)
    manifest = verify_checkpoint(path, group)
    device_type = next(model.parameters()).device.type
    loaded = dict(_Sharding(model, state, device_type).wrap(_local_state(model, optimizer)), extra="")
    with _single_process_quiet():
        dcp.load(loaded, checkpoint_id=str(path), process_group=group)
    extra = json.loads(loaded["extra"])
    if extra.get("step", manifest["step"]) != manifest["step"] or (
            "config" in extra and fingerprint(extra["config"]) != manifest["config_fingerprint"]):
        raise CheckpointError(f"checkpoint {path}: its state does not match its manifest (step "
                              f"{extra.get('step')} vs {manifest['step']}, or another config)")
    model.load_state_dict(_local(loaded["model"], model.state_dict()))
    set_optimizer_state_dict(model, optimizer, _local(loaded["optimizer"], get_optimizer_state_dict(model, optimizer)))
    rng = path / _rng_name(_world_rank())
    if rng.is_file() and manifest["world_size"] == (dist.get_world_size() if dist.is_initialized() else 1):
        _set_rng_state(torch.load(rng, weights_only=True))
    return extra


def _checkpoint_group(timeout: Optional[datetime.timedelta]) -> Optional[dist.ProcessGroup]:
    """A gloo group of every rank for a save's or a load's collectives (None without
    torch.distributed); `timeout` None is torch's default for new groups, not the default group's."""
    return dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None


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
