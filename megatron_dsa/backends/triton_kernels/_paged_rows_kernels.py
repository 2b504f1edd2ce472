"""Triton kernel of the FP8 attention-row write (see `paged_rows.py` for the entry point, `megatron_dsa.ops.paged_rows`
for the format): one program per sequence quantizes its new row into its page. Plain function: `lazy_jit.jitted`
decorates it on first launch."""

import triton.language as tl

from megatron_dsa.backends.triton_kernels._fp8_quantize_kernels import round_to_e4m3
from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel


def paged_rows_write_kernel(pages_ptr, rows_ptr, positions_ptr, SLOTS, RATIO, PAGE_BYTES, ROWS_STRIDE_B,
                            ROWS_STRIDE_D, NOPE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr,
                            TILES: tl.constexpr, TILES_P2: tl.constexpr, TILE_P2: tl.constexpr,
                            ROPE_P2: tl.constexpr, ROW_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                            CHAINED: tl.constexpr):
    """Sequence b: row `rows[b]` into slot `(positions[b] // RATIO) % SLOTS` of page b: e4m3 codes of each nope tile
    scaled by `2^−e` (`e` the smallest with amax ≤ 448·2^e, computed from amax's bits as
    `ops.paged_rows.scale_exponents` does from its frexp), the rope columns in bfloat16, the biased exponents as
    scale bytes (0 in the unused ones). `TILES_P2` covers `SCALE_BYTES`, so tile t's exponent is scale byte t."""
    wait_for_previous_kernel(CHAINED)
    b = tl.program_id(0).to(tl.int64)
    slot = (tl.load(positions_ptr + b).to(tl.int64) // RATIO) % SLOTS
    page = pages_ptr + b * PAGE_BYTES
    row = page + slot * ROW_BYTES
    source = rows_ptr + b * ROWS_STRIDE_B

    tile = tl.arange(0, TILES_P2)
    column = tl.arange(0, TILE_P2)
    inside = (tile[:, None] < TILES) & (column[None, :] < TILE)
    offsets = tile[:, None] * TILE + column[None, :]
    x = tl.load(source + offsets * ROWS_STRIDE_D, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    bits = amax.to(tl.int32, bitcast=True)
    # amax = 1.M · 2^(E'−127) = (1.M / 2) · 2^(E'−126): e = E' − 126 − 9, one more where 1.M / 2 > 0.875.
    exponent = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.where(amax > 0, exponent, -127)
    exponent = tl.minimum(tl.maximum(exponent, -127), 127)
    # 2^−e from its bits: e stays within [−127, 120] for float32 rows, so 2^−e is a normal float32.
    inverse_scale = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    # Rounded first (ties to even) so the cast is exact: the interpreter's own e4m3 cast rounds wrongly.
    codes = round_to_e4m3(x * inverse_scale[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(row + offsets, codes, mask=inside)

    rope = tl.arange(0, ROPE_P2)
    rope_values = tl.load(source + (NOPE + rope) * ROWS_STRIDE_D, mask=rope < ROPE, other=0.0).to(tl.float32)
    # bfloat16 bits rounded to nearest even on the float32 bits (the interpreter's own cast truncates), NaN kept
    value_bits = rope_values.to(tl.int32, bitcast=True)
    rope_bits = (value_bits + 0x7FFF + ((value_bits >> 16) & 1)) >> 16
    rope_bits = tl.where(rope_values != rope_values, 0x7FC0, rope_bits & 0xFFFF)
    # Two bytes a value, little-endian (a bfloat16 pointer into a uint8 page would be the same bytes).
    tl.store(row + NOPE + 2 * rope, (rope_bits & 0xFF).to(tl.uint8), mask=rope < ROPE)
    tl.store(row + NOPE + 2 * rope + 1, (rope_bits >> 8).to(tl.uint8), mask=rope < ROPE)

    scale_bytes = tl.where(tile < TILES, exponent + 127, 0).to(tl.uint8)
    tl.store(page + SLOTS * ROW_BYTES + slot * SCALE_BYTES + tile, scale_bytes, mask=tile < SCALE_BYTES)
