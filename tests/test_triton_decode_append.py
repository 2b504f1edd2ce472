"""The `decode_append` family's Triton kernel (`backends/triton_kernels/decode_append.py`): a decode step's last
write, the new row into its slot and the lengths counted up, in one launch.

The CPU cases run in the Triton interpreter in a child process (`interp_triton_decode_append.py`); here: the
sm_90a compile (chained, as a Hopper launch), the errors, and on a GPU the dsv4 shapes against the reference bit for
bit, eagerly and replayed in a CUDA graph (each replay writes the next slot and counts once more).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.backends.triton_kernels import decode_append
from megatron_dsa.ops.decode_append import append_rows as reference_append
from triton_support import compile_for_sm90, ptxas_report, run_interpreted, without_interpreter  # noqa: F401


def test_interpreter_cases():
    """The kernel against the reference op, and W / C / H / M decode steps through it against the reference decode
    (interpreter), in a child process."""
    run_interpreted("interp_triton_decode_append.py")


def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    from megatron_dsa.backends.triton_kernels import _decode_append_kernels as kernels

    signature = dict(buffer_ptr="*bf16", rows_ptr="*bf16", seqlens_ptr="*i64", R="i32", D="i32",
                     BUFFER_STRIDE_B="i32", BUFFER_STRIDE_R="i32", BUFFER_STRIDE_D="i32", ROWS_STRIDE_B="i32",
                     ROWS_STRIDE_D="i32", BLOCK_D="constexpr", CHAINED="constexpr")
    compiled = compile_for_sm90(kernels, "decode_append_kernel", signature,
                                dict(BLOCK_D=512, CHAINED=True), decode_append.WARPS)  # a Hopper launch is chained
    assert "0 bytes spill stores" in ptxas_report(compiled.asm["ptx"], tmp_path)


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="triton decode_append cannot run on buffer's device"):
        decode_append.append_rows(torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("buffer, rows, seqlens, error, message", [
    ((2, 4, 8), (2, 6), (2,), ValueError, r"rows \(2, 6\) and seqlens \(2,\) do not match buffer \(2, 4, 8\)"),
    ((2, 4, 8), (3, 8), (3,), ValueError, "do not match buffer"),
    ((2, 0, 8), (2, 8), (2,), ValueError, "at least one slot"),
    ((2, 4), (2, 8), (2,), ValueError, r"buffer must be \[B, R, D\]"),
], ids=["width", "batch", "no_slots", "buffer_rank"])
def test_bad_shapes_are_named(buffer, rows, seqlens, error, message):
    for append in (reference_append, decode_append.append_rows):
        with pytest.raises(error, match=message):
            append(torch.zeros(buffer), torch.zeros(rows), torch.zeros(seqlens, dtype=torch.long))


def test_bad_dtypes_are_named():
    with pytest.raises(TypeError, match="rows dtype torch.float64 differs from buffer dtype torch.float32"):
        reference_append(torch.zeros(2, 4, 8), torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="seqlens must be int64, got torch.int32"):
        reference_append(torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch, slots, width", [(32, 127, 512), (4, 4096, 576)], ids=["C_window", "M_latent"])
def test_dsv4_shapes_match_the_reference_eagerly_and_in_a_graph(batch, slots, width):
    """dsv4-flash's window ring (W − 1 = 127 slots of 512) at B = 32 and an M latent cache (576 wide) at B = 4, bf16:
    bit for bit the reference's writes and lengths; captured once, three replays append three rows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    buffer = torch.randn(batch, slots, width, device="cuda", generator=g).bfloat16()
    rows = torch.randn(batch, width, device="cuda", generator=g).bfloat16()
    seqlens = torch.randint(0, 3 * slots, (batch,), device="cuda", generator=g)
    expected_buffer, expected_lengths = buffer.clone(), seqlens.clone()
    reference_append(expected_buffer, rows, expected_lengths)
    decode_append.append_rows(buffer, rows, seqlens)
    assert torch.equal(buffer, expected_buffer) and torch.equal(seqlens, expected_lengths)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up off the capture (the first launch compiles)
        decode_append.append_rows(buffer.clone(), rows, seqlens.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_append.append_rows(buffer, rows, seqlens)
    for _ in range(3):
        reference_append(expected_buffer, rows, expected_lengths)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buffer, expected_buffer) and torch.equal(seqlens, expected_lengths)
