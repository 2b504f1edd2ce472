"""The shared cache of device-built values and the layouts' kept values: kept per key or object, bounded,
never kept from a CUDA-graph capture by anything that outlives it (the capture itself is exercised by
the CUDA-graph GPU tests of the layer)."""

import torch

from megatron_dsa import device_cache
from megatron_dsa.device_cache import DeviceCache
from megatron_dsa.ops.indices import visible_compressed_entries
from megatron_dsa.ops.layout import TokenLayout

CPU = torch.device("cpu")


def test_a_value_is_built_once_per_key():
    cache: DeviceCache[torch.Tensor] = DeviceCache()
    builds = []

    def build() -> torch.Tensor:
        builds.append(1)
        return torch.zeros(1)

    first = cache.get("a", CPU, build)
    assert cache.get("a", CPU, build) is first and len(builds) == 1
    assert cache.get("b", CPU, build) is not first and len(builds) == 2


def test_the_oldest_entry_goes_first_when_full():
    cache: DeviceCache[int] = DeviceCache(max_entries=2)
    for key in "abc":
        cache.get(key, CPU, lambda key=key: ord(key))
    assert cache.get("a", CPU, lambda: -1) == -1  # evicted, rebuilt
    assert cache.get("c", CPU, lambda: -1) == ord("c")


def test_nothing_built_during_a_capture_is_kept(monkeypatch):
    monkeypatch.setattr(device_cache, "capturing", lambda device: True)
    cache: DeviceCache[torch.Tensor] = DeviceCache()
    built = cache.get("a", CPU, lambda: torch.ones(1))
    assert cache.get("a", CPU, lambda: torch.zeros(1)) is not built
    # The shared uniform layouts follow the same rule.
    assert TokenLayout.uniform(3, 5, CPU) is not TokenLayout.uniform(3, 5, CPU)


def test_capturing_is_false_off_cuda():
    assert not device_cache.capturing(CPU)


def test_a_layout_built_outside_a_capture_keeps_nothing_first_built_inside_it(monkeypatch):
    """A shared layout (built eagerly) whose properties, derived values and kept id rows are first needed
    inside a capture returns them there but does not keep them (their storage would hold values only in
    the graph's replays); after the capture it builds and keeps them as usual. A layout built inside the
    capture keeps its own values: it never leaves the capture."""
    # Built here, not taken from the shared uniform layouts: another test may have filled those.
    shared = TokenLayout.packed(torch.tensor([0, 16, 32]), 32, CPU, max_seqlen=16)
    monkeypatch.setattr(device_cache, "capturing_now", lambda: True)
    assert shared.segment_starts is not shared.segment_starts  # built on every use, kept by nobody
    assert shared.compressed(4) is not shared.compressed(4)
    entries = visible_compressed_entries(shared.compressed(4))  # built in the capture: keeps its own
    assert entries.rows() is entries.rows()
    inside = TokenLayout.packed(torch.tensor([0, 5, 16]), 16, CPU, max_seqlen=11)
    assert inside.segment_starts is inside.segment_starts and inside.compressed(4) is inside.compressed(4)
    monkeypatch.setattr(device_cache, "capturing_now", lambda: False)
    assert shared.segment_starts is shared.segment_starts and shared.compressed(4) is shared.compressed(4)
    assert torch.equal(shared.segment_starts, torch.arange(32) // 16 * 16)


def test_a_compiled_trace_builds_without_asking_cuda_whether_it_captures(monkeypatch):
    """Dynamo cannot trace `torch.cuda.is_current_stream_capturing()` (a torch call returning a bool: a graph
    break, an error under `fullgraph=True`), and on a CUDA build `torch.cuda.is_available()` folds to True,
    so a cache miss on a CUDA device inside a trace must not reach that query. Emulated on CPU: `capturing`
    asks the query as it does for a CUDA device, which answers False as a CUDA build does outside a capture."""
    monkeypatch.setattr(torch.cuda.graphs, "_cuda_isCurrentStreamCapturing", lambda: False)
    monkeypatch.setattr(device_cache, "capturing", lambda device: torch.cuda.is_current_stream_capturing())
    cache: DeviceCache[torch.Tensor] = DeviceCache()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x: x + cache.get("one", x.device, lambda: torch.ones(2)), fullgraph=True,
                                 backend="eager")
        assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert cache.get("one", CPU, lambda: torch.zeros(2)).sum() == 0  # a value built in a trace is not kept


def test_kept_while_unchanged_rebuilds_only_when_a_source_changes():
    """Kept across calls on the same tensors; built again after an in-place write (its version), for another
    tensor, and after a tensor's storage is swapped (`.data = ...`)."""
    from megatron_dsa.device_cache import KeptWhileUnchanged

    builds = []
    kept = KeptWhileUnchanged()
    table = torch.arange(4.0, dtype=torch.float64)

    def convert(t):
        builds.append(1)
        return t.float()

    first = kept.get([table], lambda: convert(table))
    assert kept.get([table], lambda: convert(table)) is first and len(builds) == 1
    table.mul_(2)
    assert torch.equal(kept.get([table], lambda: convert(table)), torch.arange(4.0) * 2) and len(builds) == 2
    other = table.clone()
    kept.get([other], lambda: convert(other))
    assert len(builds) == 3
    other.data = torch.zeros(4, dtype=torch.float64)
    assert torch.equal(kept.get([other], lambda: convert(other)), torch.zeros(4)) and len(builds) == 4
