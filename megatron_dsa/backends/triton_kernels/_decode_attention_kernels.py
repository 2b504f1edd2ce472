"""Triton kernel bodies of decode attention (contract: `megatron_dsa.ops.decode_attention`).

Left undecorated, like the sparse-attention kernels: `decode_attention.py` decorates them on first use
(`lazy_jit.launcher`), so the CPU interpreter's switch is read at call time.

Each sequence's keys form one virtual list of `L = 1 + R + E` slots: slot 0 is its new row `kv_new[b]`,
slots `1 … R` the ring `window[b]`, the rest its compressed entries (the selected entry numbers
`ids[b, e]`, or every entry `e`). A slot's row comes from one of the three tensors by a pointer select, so
each index block is one masked gather. With `PAGED` the ring and the entries are FP8 pages (`ops.paged_rows`:
e4m3 codes times a power of two per 64 columns, bf16 RoPE columns) and the new row is already in the ring of `W`
slots: `L = R + E`, and a row is read as its codes, their tiles' scale bytes and its RoPE bytes.
Flash-decoding: program `(b·head_blocks + hb, split)` runs the online softmax over the split's slots for a block
of heads (the heads are the M side of `tl.dot`, all sharing the gathered rows) and leaves `(max, sum, acc)` in
float32; `decode_combine_kernel` merges the splits with the sink in the denominator. With one split the first kernel
normalises and writes the output itself.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel
from megatron_dsa.backends.triton_kernels._rope_kernels import rotate_pairs
from megatron_dsa.backends.triton_kernels._sparse_attention_kernels import LOG2E, MAX_FLOOR, online_softmax_step, row_tile


@triton.jit
def paged_tile(row_ptrs, scale_ptrs, cols, row_ok, D: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr,
               dtype: tl.constexpr):
    """`[R, C]` in `dtype`: the FP8 page rows at byte pointers `row_ptrs [R]` (their scale bytes at `scale_ptrs
    [R]`) at the columns `cols [C]`, zero where masked: `code · 2^(byte − 127)` below `NOPE`, the bfloat16 RoPE
    values (two bytes each) from `NOPE` to `D`. The scale is the float whose exponent bits are the scale byte (a
    zero byte, a tile of zeros or of values below 2⁻¹¹⁸, reads as 0 where the reference keeps 2⁻¹²⁷). In bfloat16
    (float32's exponent range: the product is exact) the tile never exists in float32, which halves its registers."""
    is_code = (cols < NOPE)[None, :]
    code_ok = row_ok[:, None] & is_code
    codes = tl.load(row_ptrs[:, None] + cols[None, :], mask=code_ok, other=0).to(tl.float8e4nv, bitcast=True)
    scale_bytes = tl.load(scale_ptrs[:, None] + (cols // TILE)[None, :], mask=code_ok, other=0)
    rope_bytes = row_ptrs[:, None] + NOPE + 2 * (cols - NOPE)[None, :]
    rope_ok = row_ok[:, None] & ((cols >= NOPE) & (cols < D))[None, :]
    rope = (tl.load(rope_bytes, mask=rope_ok, other=0).to(tl.uint16)
            | (tl.load(rope_bytes + 1, mask=rope_ok, other=0).to(tl.uint16) << 8)).to(tl.bfloat16, bitcast=True)
    if dtype == tl.bfloat16:
        scales = (scale_bytes.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
        return tl.where(is_code, codes.to(tl.bfloat16) * scales, rope)
    scales = (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.where(is_code, codes.to(tl.float32) * scales, rope.to(tl.float32)).to(dtype)


@triton.jit
def paged_tile_by_tiles(row_ptrs, scale_ptrs, first, BLOCK: tl.constexpr, row_ok, NOPE: tl.constexpr,
                        TILE: tl.constexpr, dtype: tl.constexpr):
    """`paged_tile` of the columns `first … first + BLOCK` where the RoPE columns are one last tile of `TILE` (dsv4:
    7 tiles of codes, then 64 RoPE values) and `TILE` a power of two: the codes loaded whole rows at a time (the
    RoPE tile's bytes too, then replaced: row masks only, so the loads are vectors), one scale byte a tile, the RoPE
    values as bfloat16, the tile `[R, BLOCK / TILE, TILE]` scaled by broadcast, then flattened."""
    TILES: tl.constexpr = BLOCK // TILE
    tiles = first // TILE + tl.arange(0, TILES)
    columns = first + tl.arange(0, BLOCK)
    codes = tl.load(row_ptrs[:, None] + columns[None, :], mask=row_ok[:, None], other=0)
    codes = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), [row_ptrs.shape[0], TILES, TILE])
    scale_bytes = tl.load(scale_ptrs[:, None] + tiles[None, :], mask=row_ok[:, None] & (tiles < NOPE // TILE)[None, :],
                          other=0)
    scales = (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    rope_ptrs = (row_ptrs + NOPE).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    rope = tl.load(rope_ptrs[:, None] + tl.arange(0, TILE)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    values = tl.where((tiles == NOPE // TILE)[None, :, None], rope[:, None, :], codes * scales[:, :, None])
    return tl.reshape(values, [row_ptrs.shape[0], BLOCK]).to(dtype)


@triton.jit
def key_tile(rows, scales, cols, valid, D: tl.constexpr, PAGED: tl.constexpr, NOPE: tl.constexpr,
             TILE: tl.constexpr, dtype: tl.constexpr, first, BLOCK: tl.constexpr):
    """The `[BLOCK_K, C]` key / value tile of the slots' rows in the query's dtype: element rows, or FP8 page rows
    (by tiles where the columns `first … first + BLOCK` are whole tiles and the RoPE columns one of them)."""
    if PAGED:
        if BLOCK > 0 and (TILE & (TILE - 1)) == 0 and D - NOPE == TILE and BLOCK % TILE == 0:
            tile = paged_tile_by_tiles(rows, scales, first, BLOCK, valid, NOPE, TILE, dtype)
        else:
            tile = paged_tile(rows, scales, cols, valid, D, NOPE, TILE, dtype)
    else:
        tile = row_tile(rows[:, None], cols, valid, D, True, True).to(dtype)
    return tile


def decode_attention_split_kernel(
    q_ptr, new_ptr, ring_ptr, entries_ptr, ids_ptr, seqlens_ptr, sink_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale,  # softmax scale * log2(e)
    H: tl.constexpr, D: tl.constexpr, R, RING_LIMIT, C, K, RATIO, SLOTS, SLOTS_PER_SPLIT, RING_PAGE, ENTRY_PAGE,
    SPLITS: tl.constexpr, HAS_ENTRIES: tl.constexpr, SELECTED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    VALUE_PARTS: tl.constexpr, PAGED: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr,
    ROW_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, DOT_PRECISION: tl.constexpr, CHAINED: tl.constexpr,
):
    """One (sequence, head block, value part, split): online softmax over the split's slots (module docstring).

    R ring slots, of which `min(p, RING_LIMIT)` are valid (`PAGED`: `min(p + 1, RING_LIMIT)`, the new row among
    them); C entry slots per sequence in `entries`; K selected ids per sequence (`SELECTED`); the sequence sees
    entries `j < (p + 1) // RATIO`. `PAGED`: the ring and entries are FP8 pages of `RING_PAGE` / `ENTRY_PAGE` bytes
    a sequence, rows of `ROW_BYTES` then `SCALE_BYTES` scale bytes a row, `NOPE` e4m3 columns in tiles of `TILE`.
    With `VALUE_PARTS = 2` (no tail columns) the program scores with every column but accumulates and writes only
    its half of the output's columns: half the accumulator's registers, twice the programs."""
    wait_for_previous_kernel(CHAINED)
    head_blocks: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    BLOCK_V: tl.constexpr = BLOCK_D // VALUE_PARTS  # the output columns this program owns
    part = tl.program_id(0) % VALUE_PARTS
    pid = tl.program_id(0) // VALUE_PARTS
    split = tl.program_id(1)
    b = (pid // head_blocks).to(tl.int64)
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    row_heads = (b * H + heads).to(tl.int64)[:, None] * D

    p = tl.load(seqlens_ptr + b).to(tl.int64)
    NEW: tl.constexpr = 0 if PAGED else 1  # slot 0 is the new row, unless it is in the ring already
    ring_valid = tl.minimum(p + 1 - NEW, RING_LIMIT)
    visible = (p + 1) // RATIO

    dm = part * BLOCK_V + tl.arange(0, BLOCK_V)
    q = row_tile(q_ptr + row_heads, dm, head_ok, D, True, True)
    acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    if VALUE_PARTS == 2:
        do = (1 - part) * BLOCK_V + tl.arange(0, BLOCK_V)  # the other half's columns: scores only
        q_o = row_tile(q_ptr + row_heads, do, head_ok, D, True, True)
    if BLOCK_DT > 0:
        dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        q_t = row_tile(q_ptr + row_heads, dt, head_ok, D, True, True)
        acc_t = tl.zeros([BLOCK_H, BLOCK_DT], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + MAX_FLOOR
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)

    first = split * SLOTS_PER_SPLIT
    last = tl.minimum(first + SLOTS_PER_SPLIT, SLOTS)
    for start in range(first, last, BLOCK_K):
        slot = start + tl.arange(0, BLOCK_K)
        in_split = slot < last
        is_new = slot < NEW
        ring_slot = slot - NEW
        in_ring = (ring_slot >= 0) & (ring_slot < ring_valid)
        valid = in_split & (is_new | in_ring)
        ring_at = tl.where(in_ring, ring_slot, 0)
        if PAGED:
            rows = ring_ptr + b * RING_PAGE + ring_at * ROW_BYTES
            scales = ring_ptr + b * RING_PAGE + R * ROW_BYTES + ring_at * SCALE_BYTES
        else:
            rows = tl.where(is_new, new_ptr + b * D, ring_ptr + (b * R + ring_at) * D)
            scales = rows
        if HAS_ENTRIES:
            e = slot - NEW - R
            in_entries = in_split & (e >= 0)
            if SELECTED:
                entry = tl.load(ids_ptr + b * K + tl.where(in_entries, e, 0), mask=in_entries, other=-1).to(tl.int64)
            else:
                entry = e
            entry_ok = in_entries & (entry >= 0) & (entry < visible) & (entry < C)
            entry_at = tl.where(entry_ok, entry, 0)
            if PAGED:
                rows = tl.where(entry_ok, entries_ptr + b * ENTRY_PAGE + entry_at * ROW_BYTES, rows)
                scales = tl.where(entry_ok, entries_ptr + b * ENTRY_PAGE + C * ROW_BYTES + entry_at * SCALE_BYTES,
                                  scales)
            else:
                rows = tl.where(entry_ok, entries_ptr + (b * C + entry_at) * D, rows)
            valid = valid | entry_ok
        kv = key_tile(rows, scales, dm, valid, D, PAGED, NOPE, TILE, q.dtype, part * BLOCK_V, BLOCK_V)
        if VALUE_PARTS == 2:
            kv_o = key_tile(rows, scales, do, valid, D, PAGED, NOPE, TILE, q.dtype, (1 - part) * BLOCK_V, BLOCK_V)
            # Both parts sum the low half's products first: the same scores, so the same maxima and sums (part 0
            # stores them for both).
            if part == 0:
                s = tl.dot(q_o, tl.trans(kv_o), tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION),
                           input_precision=DOT_PRECISION)
            else:
                s = tl.dot(q, tl.trans(kv), tl.dot(q_o, tl.trans(kv_o), input_precision=DOT_PRECISION),
                           input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            kv_t = key_tile(rows, scales, dt, valid, D, PAGED, NOPE, TILE, q.dtype, BLOCK_D, 0)
            s = tl.dot(q_t, tl.trans(kv_t), s, input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, weights, alpha = online_softmax_step(s, m_i, l_i)
        acc = tl.dot(weights.to(kv.dtype), kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
        if BLOCK_DT > 0:
            acc_t = tl.dot(weights.to(kv.dtype), kv_t, acc_t * alpha[:, None], input_precision=DOT_PRECISION)

    out_mask = head_ok[:, None] & (dm < D)[None, :]
    if SPLITS == 1:
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * LOG2E
        top = tl.maximum(m_i, sink)
        scale = tl.exp2(m_i - top)
        inv_denominator = scale / (l_i * scale + tl.exp2(sink - top))
        tl.store(out_ptr + row_heads + dm[None, :], (acc * inv_denominator[:, None]).to(out_ptr.dtype.element_ty),
                 mask=out_mask)
        if BLOCK_DT > 0:
            tl.store(out_ptr + row_heads + dt[None, :],
                     (acc_t * inv_denominator[:, None]).to(out_ptr.dtype.element_ty),
                     mask=head_ok[:, None] & (dt < D)[None, :])
    else:
        # Partials [B, H, SPLITS(, D)]: the split's running maximum (base 2), its sum and its unnormalised output.
        at = (b * H + heads).to(tl.int64) * SPLITS + split
        if part == 0:  # both parts' maxima and sums (the same numbers: see the scores)
            tl.store(part_max_ptr + at, m_i, mask=head_ok)
            tl.store(part_sum_ptr + at, l_i, mask=head_ok)
        tl.store(part_acc_ptr + at[:, None] * D + dm[None, :], acc, mask=out_mask)
        if BLOCK_DT > 0:
            tl.store(part_acc_ptr + at[:, None] * D + dt[None, :], acc_t, mask=head_ok[:, None] & (dt < D)[None, :])


def decode_combine_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, sink_ptr, out_ptr, seqlens_ptr, freq_ptr,
    H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, CHAINED: tl.constexpr,
):
    """One (sequence, head): `out = Σ_s 2^(m_s − M) acc_s / (2^(sink − M) + Σ_s 2^(m_s − M) l_s)` with `M` the
    largest of the splits' maxima and the sink; the columns in chunks of `BLOCK_D`. `HALF > 0`: the last
    `2·HALF` columns, pairs `(even, odd)`, are rounded to out's dtype, then turned back by `−p·freq` as the RoPE
    kernel turns them (`rotate_pairs`, the same roundings), `p = seqlens[b]`."""
    wait_for_previous_kernel(CHAINED)
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    head = row % H
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < SPLITS
    maxima = tl.load(part_max_ptr + row * SPLITS + splits, mask=split_ok, other=MAX_FLOOR)
    sums = tl.load(part_sum_ptr + row * SPLITS + splits, mask=split_ok, other=0.0)
    sink = tl.load(sink_ptr + head) * LOG2E
    top = tl.maximum(tl.max(maxima, 0), sink)
    weights = tl.where(split_ok, tl.exp2(maxima - top), 0.0)
    inv_denominator = 1.0 / (tl.sum(weights * sums, 0) + tl.exp2(sink - top))
    NOPE: tl.constexpr = D - 2 * HALF  # columns written as they are
    parts = part_acc_ptr + (row * SPLITS + splits)[:, None] * D
    for first in range(0, NOPE, BLOCK_D):
        cols = first + tl.arange(0, BLOCK_D)
        partial = tl.load(parts + cols[None, :], mask=split_ok[:, None] & (cols < NOPE)[None, :], other=0.0)
        out = tl.sum(partial * weights[:, None], 0) * inv_denominator
        tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=cols < NOPE)
    if HALF > 0:
        dtype = out_ptr.dtype.element_ty
        pairs = tl.arange(0, BLOCK_HALF)
        pair_ok = pairs < HALF
        even_cols = NOPE + 2 * pairs
        mask = split_ok[:, None] & pair_ok[None, :]
        even = tl.sum(tl.load(parts + even_cols[None, :], mask=mask, other=0.0) * weights[:, None], 0)
        odd = tl.sum(tl.load(parts + even_cols[None, :] + 1, mask=mask, other=0.0) * weights[:, None], 0)
        # Rounded to out's dtype first: the values the RoPE kernel would read back from out.
        even = (even * inv_denominator).to(dtype).to(tl.float32)[None, :]
        odd = (odd * inv_denominator).to(dtype).to(tl.float32)[None, :]
        position = tl.load(seqlens_ptr + row // H).to(tl.float32)
        angles = (position * tl.load(freq_ptr + pairs, mask=pair_ok, other=0.0))[None, :]
        even, odd = rotate_pairs(even, odd, angles, 1.0, True, dtype, tl.float32)
        tl.store(out_ptr + row * D + even_cols, tl.reshape(even, [BLOCK_HALF]).to(dtype), mask=pair_ok)
        tl.store(out_ptr + row * D + even_cols + 1, tl.reshape(odd, [BLOCK_HALF]).to(dtype), mask=pair_ok)
