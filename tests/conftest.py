"""Shared test setup: GPU markers skip cleanly on machines without CUDA; deterministic seeds; every test
starts with the dispatcher asking the backends afresh (tests fake packages and GPUs)."""

import pytest
import torch

from megatron_dsa.backends import registry


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs >= 2 CUDA GPUs"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _fresh_backend_choices():
    registry.forget_choices()
    yield
    registry.forget_choices()
