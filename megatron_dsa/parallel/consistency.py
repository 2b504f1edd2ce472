"""Checks that every rank of a job agrees, with errors that name the ranks that do not.

A rank-local difference (another YAML, an edited environment) otherwise either runs to the end
with wrong results or aborts inside a collective with a message that names nothing; a rank that
never arrives otherwise leaves the others waiting until some collective times out.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch.distributed as dist

_ABSENT = "<absent>"


class RankMismatchError(ValueError):
    """Ranks of one job disagree on something they must share (the message names fields and ranks)."""


class MissingRanksError(RuntimeError):
    """Ranks did not reach a barrier in time (the message names them)."""


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"lr": 1}}` → `{"train.lr": 1}`."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def gather_objects(value: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """`value` (picklable) of every rank of `group`, in group-rank order; `[value]` without a group
    or without torch.distributed."""
    if group is None and not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def check_same_on_all_ranks(what: str, values: Mapping[str, Any],
                            group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise `RankMismatchError` (on every rank) when `values` (a nested mapping) differs between the
    ranks of `group`; the message names each differing field and which ranks hold which value."""
    if not dist.is_initialized():
        return
    gathered = gather_objects(flatten(values), group)
    ranks = [dist.get_global_rank(group, index) if group is not None else index for index in range(len(gathered))]
    error = mismatch_error(what, gathered, ranks)
    if error is not None:
        raise error


def mismatch_error(what: str, gathered: Sequence[Mapping[str, Any]], ranks: Sequence[int]) -> Optional[RankMismatchError]:
    """The error for flat `gathered[i]` held by rank `ranks[i]`, or None when all agree."""
    keys = sorted(set().union(*gathered))
    differing = [key for key in keys if len({repr(values.get(key, _ABSENT)) for values in gathered}) > 1]
    if not differing:
        return None

    def holders(key: str) -> str:
        by_value: dict[str, list[int]] = {}
        for rank, rank_values in zip(ranks, gathered):
            by_value.setdefault(repr(rank_values.get(key, _ABSENT)), []).append(rank)
        return ", ".join(f"{value} on rank{'s' if len(who) > 1 else ''} {','.join(map(str, who))}"
                         for value, who in by_value.items())

    shown = "; ".join(f"{key}: {holders(key)}" for key in differing[:5])
    more = f" (and {len(differing) - 5} more fields)" if len(differing) > 5 else ""
    return RankMismatchError(f"{what} differs between ranks: {shown}{more}")


def wait_for_all_ranks(group: dist.ProcessGroup, timeout_s: float, what: str) -> None:
    """A barrier that names the ranks that did not arrive within `timeout_s` (`group` must be gloo)."""
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as error:
        raise MissingRanksError(f"{what}: not every rank arrived within {timeout_s:g} s ({error}); the ranks "
                           f"named failed or stalled, see their logs") from error


@contextlib.contextmanager
def naming_stalled_ranks(group: Optional[dist.ProcessGroup], what: str, probe_timeout_s: float) -> Iterator[None]:
    """Inside the block, a collective that timed out (a rank failed or stalled) becomes a
    `MissingRanksError` naming the ranks that do not answer a barrier on `group` (gloo) within
    `probe_timeout_s`; any other error passes unchanged."""
    try:
        yield
    except RuntimeError as error:
        if group is None or isinstance(error, MissingRanksError) or not _is_timeout(error):
            raise
        wait_for_all_ranks(group, probe_timeout_s, f"{what}: a collective timed out ({_first_line(error)}), then")
        raise  # every rank answered: the timeout had another cause


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
