"""Whole-layer parity with every Triton kernel, run in the CPU interpreter (child process)."""

from triton_support import run_interpreted


def test_layer_with_triton_kernels_in_interpreter():
    run_interpreted("interp_triton_layer.py")
