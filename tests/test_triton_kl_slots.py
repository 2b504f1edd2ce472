"""Triton per-slot inputs of the cuDNN indexer backward (`backends.triton_kernels.kl_slots`).

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_kl_slots.py`).
GPU: dsv4-flash shapes (4096 rows, top-512) against the torch form.
"""

import pytest
import torch

from megatron_dsa.backends.cudnn import kl_slots
from megatron_dsa.backends.triton_kernels.kl_slots import kl_slots as triton_kl_slots
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)


def slots_case(rows: int, cols: int, keys: int, device: str = "cpu"):
    """Candidates with −1, ids past the keys and duplicates; student scores with −inf at −1 (as the
    selection gives them), a row without any valid slot; a normalised target and row weights."""
    gen = torch.Generator(device=device).manual_seed(0)
    candidates = torch.randint(-1, keys + 3, (rows, cols), generator=gen, device=device)
    if rows > 1:
        candidates[1] = -1
    student = torch.randn(rows, cols, generator=gen, device=device) * 4
    student = torch.where(candidates >= 0, student, float("-inf"))
    target = torch.rand(rows, cols, generator=gen, device=device)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-6)
    grad_rows = torch.rand(rows, generator=gen, device=device)
    return candidates, student, target, grad_rows


def test_interpreted_kernels():
    run_interpreted("interp_triton_kl_slots.py")


def test_bad_inputs_name_the_rule():
    candidates, student, target, grad_rows = slots_case(3, 8, 10)
    with pytest.raises(ValueError, match="width must cover"):
        triton_kl_slots(candidates, 10, student, target, grad_rows, 4)
    with pytest.raises(TypeError, match="float32 student"):
        triton_kl_slots(candidates, 10, student.double(), target, grad_rows, 8)
    with pytest.raises(ValueError, match="grad_rows must be"):
        triton_kl_slots(candidates, 10, student, target, grad_rows[:2], 8)


def test_cpu_without_interpreter_is_refused(without_interpreter):
    candidates, student, target, grad_rows = slots_case(3, 8, 10)
    with pytest.raises(ValueError, match="cannot run on candidates' device"):
        triton_kl_slots(candidates, 10, student, target, grad_rows, 8)


@pytest.mark.gpu
def test_gpu_matches_the_torch_form_at_dsv4_shapes():
    pytest.importorskip("triton")
    candidates, student, target, grad_rows = slots_case(4096, 512, 1024, device="cuda")
    got = triton_kl_slots(candidates, 1024, student, target, grad_rows, 512)
    expected = kl_slots(candidates, 1024, student, target, grad_rows, 512)
    assert torch.equal(got[2], expected[2]) and torch.equal(got[0], expected[0])
    # Triton's exp on a GPU is exp2 of a rounded product (ex2.approx): its relative error grows with
    # |logit − max|, up to ~30 here, to a few 1e-6; torch's softmax calls expf.
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-9)
