"""Triton KL-backward slots in the CPU interpreter vs their torch form (`backends.cudnn.kl_slots`).

Run by `test_triton_kl_slots.py::test_interpreted_kernels` in a child process with `TRITON_INTERPRET=1`
(see `triton_support.py`). ids and weighted are exact; predict is a float32 softmax whose sum runs in
another order, so it agrees to a few float32 ulps.
"""

import pytest
import torch

from megatron_dsa.backends.cudnn import kl_slots
from megatron_dsa.backends.triton_kernels.kl_slots import kl_slots as triton_kl_slots

from triton_support import interpreter  # noqa: F401  (fixture)
from test_triton_kl_slots import slots_case

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.mark.parametrize("rows,cols,width,keys", [(6, 20, 32, 30), (3, 128, 128, 400), (4, 5, 128, 3), (2, 0, 128, 8)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_matches_the_torch_form(rows, cols, width, keys, dtype):
    candidates, student, target, grad_rows = slots_case(rows, cols, keys)
    got = triton_kl_slots(candidates.to(dtype), keys, student, target, grad_rows, width)
    expected = kl_slots(candidates, keys, student, target, grad_rows, width)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.int32]
    assert torch.equal(got[2], expected[2]) and torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=4e-7, atol=1e-9)
