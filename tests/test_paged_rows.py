"""FP8 attention rows (`ops.paged_rows`) and their Triton writer (`backends/triton_kernels/paged_rows.py`).

The format's facts at DeepSeek-V4's dims (the bytes FlashMLA's FP8 sparse decode reads: 448 e4m3 codes in 7 tiles of
64, 64 bfloat16 RoPE values, 7 e8m0 scale bytes and a pad byte per row, a page's scales after its rows), the scale
rule (the smallest power of two that keeps a tile within ±448), exact read-back (`code · 2^e`), the round trip's
error bound, and the errors. The Triton writer runs in the interpreter in a child process
(`interp_triton_paged_rows.py`): byte for byte the reference's pages. On a GPU: the same at dsv4 shapes, eagerly and
replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.ops import paged_rows
from megatron_dsa.ops.paged_rows import PagedRows, read_rows, round_trip, scale_exponents, write_decode_rows
from triton_support import compile_for_sm90, ptxas_report, run_interpreted  # noqa: F401

D, P = 512, 64


def test_at_dsv4_dims_a_row_is_flashmlas_584_bytes_and_a_page_is_padded_to_576():
    assert paged_rows.row_bytes(D, P) == 448 + 128
    assert paged_rows.scale_bytes(D, P) == 8
    assert paged_rows.page_bytes(128, D, P) == 130 * 576  # 128 · 584 = 74752 bytes used: 129.8 rows of 576
    assert paged_rows.page_bytes(128, D, P) % 576 == 0
    # a tiny model's row that 64 does not divide: one tile of all its e4m3 columns
    assert paged_rows.tile_width(24) == 24 and paged_rows.scale_bytes(32, 8) == 8


def test_the_scale_is_the_smallest_power_of_two_that_keeps_a_tile_within_448():
    amax = torch.tensor([448.0, 448.0 * (1 + 2 ** -20), 1.0, 0.875 * 2 ** -3, 3.0e38, 0.0, 1e-45])
    e = scale_exponents(amax)
    assert e.tolist()[:3] == [0, 1, -8]  # 448 = 448·2⁰; just above it needs 2¹; 1 ≤ 448·2⁻⁸ = 1.75
    finite = amax[:5]
    assert (finite <= 448.0 * torch.pow(2.0, e[:5].double())).all()
    assert (finite > 448.0 * torch.pow(2.0, e[:5].double() - 1)).all()
    assert e[5] == -127 and e[6] == -127  # zero and subnormal tiles: the smallest e8m0 scale


def test_bytes_lay_out_codes_then_rope_then_scales():
    rows = torch.zeros(1, D)
    rows[0, :64] = 3.0  # tile 0: amax 3 → e = −7, codes 3·2⁷ = 384 (e4m3 0x7C)
    rows[0, 64:128] = -0.5  # tile 1: e = −9, codes −256 (0xF8)
    rows[0, 448:] = torch.arange(64) + 0.5  # rope, exact in bf16
    page = PagedRows.empty(1, 4, D, P)
    write_decode_rows(page.pages, 4, D, P, rows, torch.tensor([6]), 1)  # position 6 → slot 2
    row = page.pages[0, 2 * 576:3 * 576]
    assert (row[:64] == 0x7C).all() and (row[64:128] == 0xF8).all() and (row[128:448] == 0).all()
    assert torch.equal(row[448:].view(torch.bfloat16).float(), rows[0, 448:])
    scales = page.pages[0, 4 * 576 + 2 * 8:4 * 576 + 3 * 8]
    assert scales.tolist() == [127 - 7, 127 - 9] + [0] * 5 + [0]  # zero tiles: e = −127, byte 0; the pad byte 0
    assert (page.pages[0, :2 * 576] == 0).all()  # nothing else written
    assert torch.equal(read_rows(page, torch.tensor([0]), torch.tensor([2])), rows)


@pytest.mark.parametrize("dim, rope", [(512, 64), (32, 8)])
def test_rows_read_back_as_code_times_scale_within_half_an_e4m3_step(dim, rope):
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-6, 6, 6, dtype=torch.float64)[:, None]
    rows = torch.randn(6, dim, generator=g, dtype=torch.float64) * magnitudes
    back = round_trip(rows, rope).double()
    nope = dim - rope
    width = paged_rows.tile_width(nope)
    tiles = rows[:, :nope].float().double().unflatten(1, (-1, width))
    scale = torch.pow(2.0, scale_exponents(tiles.abs().amax(-1).float()).double()).unsqueeze(-1)
    codes = back[:, :nope].unflatten(1, (-1, width)) / scale
    assert torch.equal(codes, codes.to(torch.float8_e4m3fn).double())  # exactly e4m3 values times the scale
    # e4m3 keeps 3 mantissa bits: half a step is ≤ 2⁻⁴ of the value's binade (and 2⁻¹⁰ · scale below 2⁻⁶)
    error = (back[:, :nope].unflatten(1, (-1, width)) - tiles).abs()
    assert (error <= torch.maximum(tiles.abs() * 2 ** -4, scale * 2 ** -10)).all()
    assert torch.equal(back[:, nope:], rows[:, nope:].to(torch.bfloat16).double())


def test_writes_by_position_and_ratio_go_to_their_slots():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 32, generator=g)
    page = PagedRows.empty(3, 5, 32, 8)
    write_decode_rows(page.pages, 5, 32, 8, rows, torch.tensor([3, 17, 40]), 4)  # entries 0, 4, 10 → slots 0, 4, 0
    expected = round_trip(rows, 8)
    slots = torch.tensor([0, 4, 0])
    assert torch.equal(read_rows(page, torch.arange(3), slots), expected)
    others = paged_rows.all_rows(page)
    others[torch.arange(3), slots] = 0
    assert (others == 0).all()


@pytest.mark.parametrize("change, error, message", [
    (dict(rows=torch.zeros(2, 16)), ValueError, r"rows must be a floating \[B, D\] = \[2, 32\]"),
    (dict(positions=torch.zeros(2)), ValueError, "positions must be"),
    (dict(ratio=0), ValueError, "ratio must be an int >= 1"),
    (dict(pages=torch.zeros(2, 7, dtype=torch.uint8)), ValueError, r"pages must be uint8 \[B, 480\]"),
    (dict(rope=3), ValueError, "even rope width"),
], ids=["row_width", "positions_dtype", "ratio", "page_bytes", "odd_rope"])
def test_bad_writes_are_named(change, error, message):
    args = dict(pages=PagedRows.empty(2, 10, 32, 8).pages, slots=10, dim=32, rope=8, rows=torch.zeros(2, 32),
                positions=torch.zeros(2, dtype=torch.long), ratio=1)
    args.update(change)
    with pytest.raises(error, match=message):
        write_decode_rows(**args)


def test_interpreter_cases():
    """The Triton writer against the reference, byte for byte (interpreter, in a child process)."""
    run_interpreted("interp_triton_paged_rows.py")


def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    from megatron_dsa.backends.triton_kernels import _paged_rows_kernels as kernels
    from megatron_dsa.backends.triton_kernels.paged_rows import WARPS

    signature = dict(pages_ptr="*u8", rows_ptr="*bf16", positions_ptr="*i64", SLOTS="i32", RATIO="i32",
                     PAGE_BYTES="i32", ROWS_STRIDE_B="i32", ROWS_STRIDE_D="i32", NOPE="constexpr", ROPE="constexpr",
                     TILE="constexpr", TILES="constexpr", TILES_P2="constexpr", TILE_P2="constexpr",
                     ROPE_P2="constexpr", ROW_BYTES="constexpr", SCALE_BYTES="constexpr", CHAINED="constexpr")
    compiled = compile_for_sm90(kernels, "paged_rows_write_kernel", signature,
                                dict(NOPE=448, ROPE=64, TILE=64, TILES=7, TILES_P2=8, TILE_P2=64, ROPE_P2=64,
                                     ROW_BYTES=576, SCALE_BYTES=8, CHAINED=True), WARPS)
    assert "0 bytes spill stores" in ptxas_report(compiled.asm["ptx"], tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("slots, ratio", [(128, 1), (32768, 4)], ids=["window_ring", "C_entries_128k"])
def test_dsv4_shapes_match_the_reference_eagerly_and_in_a_graph(slots, ratio):
    """dsv4-flash's FP8 window ring (128 slots) and a C layer's 128k entry pages at B = 32, bf16 rows of mixed
    magnitudes: the kernel's pages equal the reference's byte for byte; a captured write replayed for new rows and
    positions too."""
    from megatron_dsa.backends.triton_kernels.paged_rows import write_decode_rows as triton_write

    g = torch.Generator(device="cuda").manual_seed(0)
    batch = 32
    scale = torch.logspace(-8, 8, batch, device="cuda")[:, None]
    rows = (torch.randn(batch, D, device="cuda", generator=g) * scale).bfloat16()
    positions = torch.randint(0, slots * ratio, (batch,), device="cuda", generator=g)
    expected, got = PagedRows.empty(batch, slots, D, P, "cuda"), PagedRows.empty(batch, slots, D, P, "cuda")
    write_decode_rows(expected.pages, slots, D, P, rows, positions, ratio)
    triton_write(got.pages, slots, D, P, rows, positions, ratio)
    assert torch.equal(got.pages, expected.pages)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        triton_write(got.pages.clone(), slots, D, P, rows, positions, ratio)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_write(got.pages, slots, D, P, rows, positions, ratio)
    rows.copy_(torch.randn(batch, D, device="cuda", generator=g).bfloat16())
    positions.add_(ratio)
    write_decode_rows(expected.pages, slots, D, P, rows, positions, ratio)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.pages, expected.pages)
