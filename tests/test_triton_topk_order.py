"""Triton ordering of top-k picks (`backends.triton_kernels.topk_order`), used by the cuDNN top-k adapter.

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_topk_order.py`).
GPU: dsv4-flash shapes (4096 rows, 1024 columns, top-512) against the torch ordering, exactly.
"""

import pytest
import torch

from megatron_dsa.backends.cudnn import _in_reference_order
from megatron_dsa.backends.triton_kernels.topk_order import order_picks
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)


def test_interpreted_kernels():
    run_interpreted("interp_triton_topk_order.py")


def test_bad_inputs_name_the_rule():
    picked, ranked, valid = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match="float32 ranked"):
        order_picks(picked, ranked.double(), valid)
    with pytest.raises(ValueError, match="narrower than valid"):
        order_picks(picked, ranked[:, :2], valid)
    with pytest.raises(ValueError, match="at most"):
        order_picks(torch.zeros(2, 5000, dtype=torch.long), ranked, valid)


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on picked's device"):
        order_picks(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.gpu
def test_gpu_matches_torch_ordering_at_dsv4_shapes():
    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, cols, width = 4096, 1024, 512
    ranked = torch.randn(rows, cols, device="cuda", generator=gen).round(decimals=1)  # many exact ties
    valid = torch.rand(rows, cols, device="cuda", generator=gen) < 0.9
    picked = torch.rand(rows, cols, device="cuda", generator=gen).argsort(1)[:, :width].to(torch.int32)
    picked[:, ::37] = -1
    assert torch.equal(order_picks(picked, ranked, valid), _in_reference_order(picked.long(), ranked, valid))
