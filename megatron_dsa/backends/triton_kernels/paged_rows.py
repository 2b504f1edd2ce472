"""The FP8 attention-row write as one Triton kernel: the `paged_rows_write` op family (contract and format:
`megatron_dsa.ops.paged_rows`).

In torch the write is a dozen launches (per-tile maxima, exponents, scaling, the e4m3 and bfloat16 casts, byte views,
two indexed stores); here one program per sequence quantizes its row and writes codes, rope values and scale bytes
(`_paged_rows_kernels.py`).
"""

from __future__ import annotations

from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.tiles import on_device, pow2
from megatron_dsa.ops.paged_rows import PagedRows, check_write_inputs, tile_width

WARPS = 4


def write_decode_rows(pages: Tensor, slots: int, dim: int, rope: int, rows: Tensor, positions: Tensor,
                      ratio: int) -> None:
    """The `paged_rows_write` contract (`ops.paged_rows.write_decode_rows`), in place."""
    paged = PagedRows(pages, slots, dim, rope)
    check_write_inputs(paged, rows, positions, ratio)
    require_triton(pages.device, "paged_rows_write", "pages' device")
    nope = dim - rope
    tile = tile_width(nope)
    with on_device(pages.device):
        launcher(_kernels().paged_rows_write_kernel)[(paged.batch,)](
            pages, rows, positions, slots, ratio, pages.stride(0), *rows.stride(),
            NOPE=nope, ROPE=rope, TILE=tile, TILES=nope // tile, TILES_P2=pow2(paged.scale_bytes),
            TILE_P2=pow2(tile), ROPE_P2=pow2(max(rope, 1)), ROW_BYTES=paged.row_bytes, SCALE_BYTES=paged.scale_bytes,
            num_warps=WARPS, **chained_launch(pages.device))


def _kernels():
    from megatron_dsa.backends.triton_kernels import _paged_rows_kernels

    return _paged_rows_kernels
