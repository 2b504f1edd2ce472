"""K = V rows of a W/C/H inference cache kept in e4m3 pages (an FP8 attention-row cache, opt-in:
`LayerCache.for_layer(..., fp8_attention_rows=True)`).

A row `[D] = [nope (D − P) | rope (P)]` is kept as
- its nope columns as e4m3 codes in tiles of `TILE` = 64 columns (one tile of all of them where `D − P` is not a
  multiple of 64), each tile with a power-of-two scale `2^e`, the smallest for which the tile's largest magnitude
  is at most 448 (e4m3's largest finite value), stored as one byte `e + 127` (e8m0); a value is `code · 2^e`;
- its rope columns in bfloat16 (rotated pairs lose too much in e4m3's three mantissa bits).

A page holds the `slots` rows of one sequence: first `slots` rows of `row_bytes = (D − P) + 2P` bytes (codes, then
the rope values), then `slots` groups of `scale_bytes = 8·⌈tiles / 8⌉` scale bytes (unused ones 0), the page padded
to a multiple of `row_bytes`. At DeepSeek-V4's dims (D = 512, P = 64: 448 codes in 7 tiles, 128 rope bytes, 8 scale
bytes) this is the FP8 sparse-decode cache layout FlashMLA's kernel reads, one page per sequence.

Codes and scales are exact functions of the row, so every writer produces the same bytes (a test holds the Triton
writer to these functions byte for byte), and a stored row reads back as exactly `code · 2^e` and its bfloat16 rope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.ops.fp8_linear import FP8 as CODES

TILE = 64
SCALE_GROUP = 8  # scale bytes per row come in groups of 8 (FlashMLA reads them as one 8-byte word)
E8M0_BIAS = 127
ROPE_DTYPE = torch.bfloat16


def tile_width(nope: int) -> int:
    """Columns per scale tile of a row with `nope` e4m3 columns."""
    return TILE if nope % TILE == 0 else nope


@dataclass(frozen=True)
class PagedRows:
    """`pages [B, page_bytes]` uint8, one page of `slots` rows of width `dim` (the last `rope` in bfloat16) per
    sequence (module docstring)."""

    pages: Tensor
    slots: int
    dim: int
    rope: int

    @classmethod
    def empty(cls, batch: int, slots: int, dim: int, rope: int, device: Optional[torch.device] = None) -> "PagedRows":
        check_row_dims(dim, rope)
        return cls(torch.zeros(batch, page_bytes(slots, dim, rope), dtype=torch.uint8, device=device), slots, dim, rope)

    @property
    def batch(self) -> int:
        return self.pages.shape[0]

    @property
    def nope(self) -> int:
        return self.dim - self.rope

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.dim, self.rope)

    @property
    def scale_bytes(self) -> int:
        return scale_bytes(self.dim, self.rope)

    def rows_region(self) -> Tensor:
        """`[B, slots, row_bytes]` the codes and rope bytes of each slot (a view)."""
        return self.pages[:, :self.slots * self.row_bytes].view(self.batch, self.slots, self.row_bytes)

    def scales_region(self) -> Tensor:
        """`[B, slots, scale_bytes]` the scale bytes of each slot (a view)."""
        start = self.slots * self.row_bytes
        return self.pages[:, start:start + self.slots * self.scale_bytes].view(self.batch, self.slots,
                                                                                self.scale_bytes)


def check_row_dims(dim: int, rope: int) -> None:
    if not (isinstance(dim, int) and isinstance(rope, int) and 0 <= rope < dim and rope % 2 == 0):
        raise ValueError(f"FP8 attention rows need an even rope width P with 0 <= P < D, got D = {dim}, P = {rope}")


def row_bytes(dim: int, rope: int) -> int:
    return (dim - rope) + 2 * rope


def scale_bytes(dim: int, rope: int) -> int:
    tiles = (dim - rope) // tile_width(dim - rope)
    return SCALE_GROUP * -(-tiles // SCALE_GROUP)


def page_bytes(slots: int, dim: int, rope: int) -> int:
    used = slots * (row_bytes(dim, rope) + scale_bytes(dim, rope))
    return row_bytes(dim, rope) * -(-used // row_bytes(dim, rope))


def scale_exponents(amax: Tensor) -> Tensor:
    """`[...]` int32 `e`, the smallest with `amax ≤ 448 · 2^e`, within e8m0's [−127, 127]. Exact: with
    `amax = m · 2^E` (`m` in [0.5, 1)), `m · 2^E ≤ 0.875 · 2^(e + 9)` holds from `e = E − 9` when
    `m ≤ 0.875`, else from `E − 8` (no rounded division by 448)."""
    mantissa, exponent = torch.frexp(amax.float())
    e = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    return torch.where(amax > 0, e, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def quantize(rows: Tensor, rope: int) -> tuple[Tensor, Tensor]:
    """`rows [N, D]` → `(row bytes [N, row_bytes], scale bytes [N, scale_bytes])` uint8, as a page keeps them."""
    count, dim = rows.shape
    nope, width = dim - rope, tile_width(dim - rope)
    tiles = rows[:, :nope].float().unflatten(1, (nope // width, width))  # [N, T, w]
    exponents = scale_exponents(tiles.abs().amax(dim=-1))  # [N, T]
    codes = torch.ldexp(tiles, -exponents.unsqueeze(-1)).to(CODES).view(torch.uint8).flatten(1)
    rope_bytes = rows[:, nope:].to(ROPE_DTYPE).contiguous().view(torch.uint8)
    scales = torch.zeros(count, scale_bytes(dim, rope), dtype=torch.uint8, device=rows.device)
    scales[:, :exponents.shape[1]] = (exponents + E8M0_BIAS).to(torch.uint8)
    return torch.cat((codes, rope_bytes), dim=1), scales


def dequantize(row_bytes_: Tensor, scale_bytes_: Tensor, dim: int, rope: int) -> Tensor:
    """`[..., row_bytes]` and `[..., scale_bytes]` uint8 → the rows they stand for, `[..., D]` float32 (exact)."""
    nope, width = dim - rope, tile_width(dim - rope)
    codes = row_bytes_[..., :nope].contiguous().view(CODES).float().unflatten(-1, (nope // width, width))
    exponents = scale_bytes_[..., :nope // width].to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(codes, exponents.unsqueeze(-1).float()).flatten(-2)
    rope_values = row_bytes_[..., nope:].contiguous().view(ROPE_DTYPE).float()
    return torch.cat((values, rope_values), dim=-1)


def round_trip(rows: Tensor, rope: int) -> Tensor:
    """`rows [N, D]` as a page gives them back: `[N, D]` float32."""
    encoded, scales = quantize(rows, rope)
    return dequantize(encoded, scales, rows.shape[1], rope)


def write_rows(paged: PagedRows, sequences: Tensor, slots: Tensor, rows: Tensor) -> None:
    """In place: row `i` of `rows [N, D]` into slot `slots[i]` of page `sequences[i]` (both `[N]` integer)."""
    if rows.dim() != 2 or rows.shape[1] != paged.dim:
        raise ValueError(f"paged rows: rows must be [N, {paged.dim}], got {tuple(rows.shape)}")
    encoded, scales = quantize(rows, paged.rope)
    paged.rows_region()[sequences, slots] = encoded
    paged.scales_region()[sequences, slots] = scales


def read_rows(paged: PagedRows, sequences: Tensor, slots: Tensor) -> Tensor:
    """The rows at `(sequences, slots)` (broadcast integer tensors of one shape `[...]`) → `[..., D]` float32."""
    return dequantize(paged.rows_region()[sequences, slots], paged.scales_region()[sequences, slots], paged.dim,
                      paged.rope)


def all_rows(paged: PagedRows, dtype: torch.dtype = torch.float32) -> Tensor:
    """Every slot's row, `[B, slots, D]` in `dtype` (float32 keeps them exact; bf16 too, but for values below
    2⁻¹³³), dequantized a sequence at a time: a float32 copy of a whole long cache would weigh twice a bf16 cache."""
    out = torch.empty(paged.batch, paged.slots, paged.dim, dtype=dtype, device=paged.pages.device)
    rows, scales = paged.rows_region(), paged.scales_region()
    for b in range(paged.batch):
        out[b] = dequantize(rows[b], scales[b], paged.dim, paged.rope)
    return out


def slot_of(positions: Tensor, ratio: int, slots: int) -> Tensor:
    """The slot a row of `positions` goes to: `(p // ratio) % slots` (ratio 1: a ring of positions; the
    compressor's ratio `r`: entry `p // r`, which the cache's capacity keeps below `slots`)."""
    return torch.div(positions, ratio, rounding_mode="floor") % slots


def write_decode_rows(pages: Tensor, slots: int, dim: int, rope: int, rows: Tensor, positions: Tensor,
                      ratio: int) -> None:
    """The `paged_rows_write` contract, in place: row `b` of `rows [B, D]` into slot `(positions[b] // ratio) %
    slots` of page `b` of `pages [B, page_bytes]` (a decode step's new window row, ratio 1, or its compressor's
    entry, ratio r)."""
    paged = PagedRows(pages, slots, dim, rope)
    check_write_inputs(paged, rows, positions, ratio)
    write_rows(paged, torch.arange(paged.batch, device=pages.device), slot_of(positions, ratio, slots), rows)


def check_write_inputs(paged: PagedRows, rows: Tensor, positions: Tensor, ratio: int) -> None:
    """Shapes, dtypes and devices of a `paged_rows_write` call (every backend checks the same)."""
    check_pages(paged, "pages")
    if rows.shape != (paged.batch, paged.dim) or not rows.is_floating_point():
        raise ValueError(f"paged_rows_write: rows must be a floating [B, D] = [{paged.batch}, {paged.dim}] tensor, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    if positions.shape != (paged.batch,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paged_rows_write: positions must be [B] = [{paged.batch}] int32/int64, got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"paged_rows_write: ratio must be an int >= 1, got {ratio!r}")
    if rows.device != paged.pages.device or positions.device != paged.pages.device:
        raise ValueError(f"paged_rows_write: pages, rows and positions must share a device, got "
                         f"{paged.pages.device}, {rows.device} and {positions.device}")


def check_pages(paged: PagedRows, name: str) -> None:
    """`paged.pages` is the uint8 `[B, page_bytes]` tensor its slots and row dims call for."""
    check_row_dims(paged.dim, paged.rope)
    pages = paged.pages
    if not isinstance(paged.slots, int) or paged.slots < 1:
        raise ValueError(f"{name}: slots must be an int >= 1, got {paged.slots!r}")
    wanted = page_bytes(paged.slots, paged.dim, paged.rope)
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != wanted or pages.stride(1) != 1:
        raise ValueError(f"{name}: pages must be uint8 [B, {wanted}] with contiguous rows (pages of {paged.slots} "
                         f"slots of D = {paged.dim}, P = {paged.rope}), got {pages.dtype} {tuple(pages.shape)}")
