"""Triton kernel of a decode step's compressor write (see `decode_compressor.py` for the entry point and the
math).

A plain function: `lazy_jit.jitted` decorates it on first launch. state is `[B, K, ROW]` contiguous (ROW =
2·COFF·DC: the kv then the gate projections of a slot), new rows `[B, ROW]` `NEW_STRIDE` elements apart, ape
`[RATIO, COFF·DC]`, the store `[B, ENTRIES, DC]` contiguous (e4m3 with `scale [B, ENTRIES]` float32 where FP8).

One program per sequence holds its entry as `[BLOCK_P, 2]` channel pairs (channel `2i + a` at `[i, a]`), so
that the RoPE pairs and the Hadamard transform's halves are a `tl.split` away, and walks the group's slots
`BLOCK_S` at a time with an online softmax per channel (as `gated_pool_kernel`). For COFF = 2 "half" 0 is the
entry's own group through channels `DC + c`, half 1 the previous group through channels `c`.
"""

import triton
import triton.language as tl

from megatron_dsa.backends.triton_kernels._grid_dependency import wait_for_previous_kernel

from megatron_dsa.backends.triton_kernels._fp8_quantize_kernels import e4m3_values, row_scale
from megatron_dsa.backends.triton_kernels._rope_kernels import rotate_pairs


@triton.jit
def hadamard_pairs(even, odd, pairs, BLOCK_P: tl.constexpr, LOG2_P: tl.constexpr, SCALE: tl.constexpr):
    """`H_n x / sqrt(n)` of the row whose channel pairs are `(even, odd)` `[BLOCK_P]` (n = 2·BLOCK_P, Sylvester
    order): with `c = 2i + a`, `popcount(c & c') = popcount(i & i') + a·a'`, so the even outputs are `H_{n/2}`
    of `even + odd` and the odd ones of `even − odd` (float32, not rounded)."""
    common = pairs[:, None] & pairs[None, :]
    parity = tl.zeros([BLOCK_P, BLOCK_P], tl.int32)
    for bit in tl.static_range(LOG2_P):
        parity = parity ^ ((common >> bit) & 1)
    sign = (1 - 2 * parity).to(tl.float32)
    plus, minus = even + odd, even - odd
    return tl.sum(sign * plus[None, :], axis=1) * SCALE, tl.sum(sign * minus[None, :], axis=1) * SCALE


@triton.jit
def pool_pairs(slots_ptr, new_row, ape_ptr, entry, new_slot, pair_start, SLOTS: tl.constexpr, RATIO: tl.constexpr,
               COFF: tl.constexpr, DC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
               COMPUTE: tl.constexpr):
    """`(pooled [BLOCK_P, 2] in COMPUTE, chans)`: channel pairs `pair_start …` of entry `entry`, an online
    softmax per channel over the group's slots `BLOCK_S` at a time (as `gated_pool_kernel`); the new token's slot
    is read from its new row, never from the state (another thread wrote it there)."""
    WIDTH: tl.constexpr = COFF * DC
    ROW: tl.constexpr = 2 * WIDTH
    chans = 2 * (pair_start + tl.arange(0, BLOCK_P))[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK_P, 2]
    chan_ok = chans < DC
    top = tl.full([BLOCK_P, 2], float("-inf"), COMPUTE)
    total = tl.zeros([BLOCK_P, 2], COMPUTE)
    acc = tl.zeros([BLOCK_P, 2], COMPUTE)
    for half in tl.static_range(COFF):
        group_start = entry * RATIO - half * RATIO  # half 1: the previous group, none before entry 0
        cols = (COFF - 1 - half) * DC + chans
        for start in range(0, RATIO, BLOCK_S):
            in_group = start + tl.arange(0, BLOCK_S)
            # (group_start + in_group ≥ 0: none before entry 0; vector against vector, which Triton 3.9's
            # interpreter keeps boolean where a vector & a scalar comparison is not)
            slot_ok = (in_group < RATIO) & (group_start + in_group >= 0)
            slot = (group_start + in_group + SLOTS) % SLOTS
            mask = slot_ok[:, None, None] & chan_ok[None, :, :]
            kv_ptrs = tl.where((slot == new_slot)[:, None, None], new_row + cols[None, :, :],
                               slots_ptr + slot[:, None, None] * ROW + cols[None, :, :])
            kv = tl.load(kv_ptrs, mask=mask, other=0.0).to(COMPUTE)
            ape = tl.load(ape_ptr + in_group[:, None, None] * WIDTH + cols[None, :, :],
                          mask=(in_group < RATIO)[:, None, None] & chan_ok[None, :, :], other=0.0).to(COMPUTE)
            logits = tl.where(mask, tl.load(kv_ptrs + WIDTH, mask=mask, other=0.0).to(COMPUTE) + ape, float("-inf"))
            new_top = tl.maximum(top, tl.max(logits, axis=0))
            # A channel that has met no finite logit yet shifts by 0: exp(−inf − 0) = 0, not NaN.
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            weights = tl.exp(logits - shift[None, :, :])
            rescale = tl.exp(top - shift)
            total = total * rescale + tl.sum(weights, axis=0)
            acc = acc * rescale + tl.sum(weights * kv, axis=0)
            top = new_top
    return acc / tl.where(total > 0, total, 1.0), chans


@triton.jit
def finish_entry(pooled, chans, entry, b, w_ptr, freq_ptr, eps_ptr, store_ptr, scale_ptr, ENTRIES,
                 RATIO: tl.constexpr, DC: tl.constexpr, HALF: tl.constexpr, ROTATE: tl.constexpr, FP8: tl.constexpr,
                 BLOCK_P: tl.constexpr, LOG2_P: tl.constexpr, HADAMARD_SCALE: tl.constexpr, FP8_MAX: tl.constexpr,
                 INV_FP8_MAX: tl.constexpr, TINY: tl.constexpr, dtype: tl.constexpr, COMPUTE: tl.constexpr):
    """The pooled entry `[BLOCK_P, 2]` (COMPUTE values the dtype holds) normalised, rotated, encoded and stored as
    row `entry % ENTRIES` of sequence b (the kernel's docstring says how each step rounds)."""
    chan_ok = chans < DC
    pairs = tl.arange(0, BLOCK_P)
    rstd = tl.rsqrt(tl.sum(pooled * pooled) / DC + tl.load(eps_ptr))
    weight = tl.load(w_ptr + chans, mask=chan_ok, other=0.0).to(COMPUTE)
    even, odd = tl.split((pooled * rstd * weight).to(dtype).to(COMPUTE))
    rotated = pairs - (DC // 2 - HALF)  # pair i of the last HALF turns by freq[i − (DC/2 − HALF)]; the others by 0
    freq = tl.load(freq_ptr + rotated, mask=(rotated >= 0) & (rotated < HALF), other=0.0).to(COMPUTE)
    even, odd = rotate_pairs(even, odd, (entry * RATIO).to(COMPUTE) * freq, 1.0, False, dtype, COMPUTE)
    if ROTATE:
        even, odd = hadamard_pairs(even, odd, pairs, BLOCK_P, LOG2_P, HADAMARD_SCALE)
        even, odd = even.to(dtype).to(COMPUTE), odd.to(dtype).to(COMPUTE)
    values = tl.join(even, odd)  # [BLOCK_P, 2]
    slot = entry % ENTRIES  # the store is a ring of ENTRIES slots (a one-slot scratch row for FP8 attention rows)
    out_ptrs = store_ptr + (b * ENTRIES + slot) * DC + chans
    if FP8:
        # |values| as float32 bits: a NaN's lie above inf's, so a row with one ends with a NaN scale (as the
        # reference's amax), where tl.max of floats may drop it.
        bits = tl.where(chan_ok, values.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        amax = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = row_scale(amax, INV_FP8_MAX, TINY)
        codes = e4m3_values(values.to(tl.float32), tl.zeros([BLOCK_P], tl.float32) + scale, FP8_MAX)
        tl.store(out_ptrs, codes.to(store_ptr.dtype.element_ty), mask=chan_ok)
        tl.store(scale_ptr + b * ENTRIES + slot, scale)
    else:
        tl.store(out_ptrs, values.to(store_ptr.dtype.element_ty), mask=chan_ok)


def decode_compress_kernel(state_ptr, new_ptr, pos_ptr, ape_ptr, w_ptr, freq_ptr, eps_ptr, store_ptr, scale_ptr,
                           counts_ptr, pooled_ptr, NEW_STRIDE, ENTRIES, SLOTS: tl.constexpr, RATIO: tl.constexpr,
                           COFF: tl.constexpr, DC: tl.constexpr, HALF: tl.constexpr, ROTATE: tl.constexpr,
                           FP8: tl.constexpr, STAGE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_ROW: tl.constexpr, LOG2_P: tl.constexpr, HADAMARD_SCALE: tl.constexpr,
                           FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, TINY: tl.constexpr,
                           COUNTS: tl.constexpr, COMPUTE: tl.constexpr, CHAINED: tl.constexpr):
    """Sequence b's new row into slot `p % SLOTS`; entry `j = p // RATIO` = pool → round → RMSNorm (rounded) →
    RoPE at `j·RATIO` on the last 2·HALF channels (rounded as `rotate_pairs`) → Hadamard (`ROTATE`, rounded
    once) → the store's dtype, or e4m3 codes with the row's scale `max(amax, tiny) / FP8_MAX` (`FP8`).

    `STAGE` 0: all of it, grid (B,). A long group (a large ratio: K = r slots to pool) leaves B programs waiting
    on the latency of one slot tile after another, so it is split in two launches: `STAGE` 1, grid (B, pair
    blocks), writes the slot and pools `BLOCK_P` channel pairs per program into `pooled [B, DC]` (rounded to the
    state's dtype, as the entry is); `STAGE` 2, grid (B,), finishes the entry from there. `COUNTS`: the program
    that finishes the entry also writes `counts[b] = (p + 1) // RATIO`."""
    wait_for_previous_kernel(CHAINED)
    dtype = state_ptr.dtype.element_ty
    ROW: tl.constexpr = 2 * COFF * DC
    b = tl.program_id(0).to(tl.int64)
    position = tl.load(pos_ptr + b).to(tl.int64)
    entry = position // RATIO
    new_slot = position % SLOTS
    slots_ptr = state_ptr + b * SLOTS * ROW
    new_row = new_ptr + b * NEW_STRIDE
    if STAGE == 2:
        chans = 2 * tl.arange(0, BLOCK_P)[:, None] + tl.arange(0, 2)[None, :]
        pooled = tl.load(pooled_ptr + b * DC + chans, mask=chans < DC, other=0.0)
    else:
        if tl.program_id(1) == 0:
            for start in tl.static_range(0, ROW, BLOCK_ROW):
                cols = start + tl.arange(0, BLOCK_ROW)
                tl.store(slots_ptr + new_slot * ROW + cols, tl.load(new_row + cols, mask=cols < ROW), mask=cols < ROW)
        pooled, chans = pool_pairs(slots_ptr, new_row, ape_ptr, entry, new_slot, tl.program_id(1) * BLOCK_P, SLOTS,
                                   RATIO, COFF, DC, BLOCK_S, BLOCK_P, COMPUTE)
        pooled = pooled.to(dtype)  # the reference rounds the pooled entry
    if STAGE == 1:
        tl.store(pooled_ptr + b * DC + chans, pooled, mask=chans < DC)
    else:
        if COUNTS:
            tl.store(counts_ptr + b, ((position + 1) // RATIO).to(counts_ptr.dtype.element_ty))
        finish_entry(pooled.to(COMPUTE), chans, entry, b, w_ptr, freq_ptr, eps_ptr, store_ptr, scale_ptr, ENTRIES,
                     RATIO, DC, HALF, ROTATE, FP8, BLOCK_P, LOG2_P, HADAMARD_SCALE, FP8_MAX, INV_FP8_MAX, TINY,
                     dtype, COMPUTE)
