"""Triton kernel of a decode step's last write (see `decode_append.py` for the entry point,
`megatron_dsa.ops.decode_append` for the contract): one program per sequence copies its new row into slot
`seqlens[b] % R` of the buffer, then counts the token in. Plain function: `lazy_jit.jitted` decorates it on first
launch."""

import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel


def decode_append_kernel(buffer_ptr, rows_ptr, seqlens_ptr, R, D, BUFFER_STRIDE_B, BUFFER_STRIDE_R,
                         BUFFER_STRIDE_D, ROWS_STRIDE_B, ROWS_STRIDE_D, BLOCK_D: tl.constexpr,
                         CHAINED: tl.constexpr):
    """Sequence b: `buffer[b, seqlens[b] % R, :D] = rows[b, :D]`, then `seqlens[b] += 1` (int64 offsets: a dense
    latent cache of 32 × 128k rows passes 2³¹ elements)."""
    wait_for_previous_kernel(CHAINED)
    b = tl.program_id(0).to(tl.int64)
    position = tl.load(seqlens_ptr + b)
    destination = buffer_ptr + b * BUFFER_STRIDE_B + (position % R) * BUFFER_STRIDE_R
    for start in range(0, D, BLOCK_D):
        columns = start + tl.arange(0, BLOCK_D)
        inside = columns < D
        values = tl.load(rows_ptr + b * ROWS_STRIDE_B + columns * ROWS_STRIDE_D, mask=inside)
        tl.store(destination + columns * BUFFER_STRIDE_D, values, mask=inside)
    tl.store(seqlens_ptr + b, position + 1)
