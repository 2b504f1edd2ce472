"""The shared cache of device-built values: kept per key, bounded, never kept while a CUDA graph is being
captured (the capture itself is exercised by the CUDA-graph GPU test of the layer)."""

import torch

from megatron_dsa.ops import device_cache
from megatron_dsa.ops.device_cache import DeviceCache
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
