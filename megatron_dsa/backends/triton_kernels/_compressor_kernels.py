"""Triton kernel of the compressor's gated pooling (see `compressor.py` for the entry point and the math).

A plain function: `lazy_jit.jitted` decorates it on first launch. kv and gate are `[T, COFF·DC]` rows
`KV_STRIDE` and `GATE_STRIDE` elements apart (unit column stride), dkv and dgate contiguous
`[T, COFF·DC]`, ape `[RATIO, COFF·DC]`, out / grad `[E, DC]`, own / prev `[E]` int64.

Tiles: a program owns `BLOCK_E` entries × `BLOCK_C` output channels and walks their slots
`BLOCK_S` at a time as `[BLOCK_E, BLOCK_S, BLOCK_C]` tiles of token rows (the rows of one entry are
consecutive, so each tile row is a contiguous channel run). For COFF = 2 a "half" is one of the two
slot groups: half 0 = the entry's own group through channels `DC + c`, half 1 = the previous group
through channels `c`. With COFF = 1 there is only half 0, through channels `c`.
"""

import triton.language as tl


def gated_pool_kernel(kv_ptr, gate_ptr, ape_ptr, own_ptr, prev_ptr, out_ptr, grad_ptr, dkv_ptr, dgate_ptr,
                      dape_ptr, E, DC, KV_STRIDE, GATE_STRIDE, RATIO: tl.constexpr, COFF: tl.constexpr, BACKWARD: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                      COMPUTE: tl.constexpr):
    """Forward: out[e, c] = Σ_slots softmax_slots(gate + ape)·kv, 0 for entries with own[e] < 0.

    Backward (BACKWARD, out_ptr unused): with w the weights, g = grad[e, c] and o the pooled value,
    both recomputed, dkv = w·g and dgate = w·g·(kv − o) at the slot's token row and channel (each
    written by exactly one program, see `compressor.py`), and the block's Σ_e dgate per (slot,
    channel) into dape_ptr `[cdiv(E, BLOCK_E), RATIO, COFF·DC]` (summed over blocks by the caller).

    The first sweep over the slots is an online softmax (running max `top`, running sum `total`,
    running weighted sum `acc`); the backward runs a second sweep with the final statistics. A slot
    without a token (no previous group, unused entry, slot ≥ RATIO) has logit −inf.
    Grid: (cdiv(E, BLOCK_E), cdiv(DC, BLOCK_C)).
    """
    block = tl.program_id(0).to(tl.int64)
    entries = block * BLOCK_E + tl.arange(0, BLOCK_E)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < DC
    width = COFF * DC
    own = tl.load(own_ptr + entries, mask=entries < E, other=-1).to(tl.int64)
    top = tl.full([BLOCK_E, BLOCK_C], float("-inf"), COMPUTE)
    total = tl.zeros([BLOCK_E, BLOCK_C], COMPUTE)
    acc = tl.zeros([BLOCK_E, BLOCK_C], COMPUTE)
    out_offsets = entries[:, None] * DC + chans[None, :]
    if BACKWARD:
        grad = tl.load(grad_ptr + out_offsets, mask=(own[:, None] >= 0) & chan_ok[None, :], other=0.0).to(COMPUTE)
    for sweep in tl.static_range(2 if BACKWARD else 1):
        if sweep == 1:
            # A column whose slots are all −inf (unused entry, masked channel) has total 0 and acc 0:
            # shift 0 and divisor 1 give it weights and value 0, not NaN.
            shift = tl.where(top == float("-inf"), 0.0, top)
            inv_total = 1.0 / tl.where(total > 0, total, 1.0)
            pooled = acc * inv_total
        for half in tl.static_range(COFF):
            if half == 0:
                first = own
            else:
                first = tl.load(prev_ptr + entries, mask=entries < E, other=-1).to(tl.int64)
            cols = (COFF - 1 - half) * DC + chans
            for start in range(0, RATIO, BLOCK_S):
                slots = start + tl.arange(0, BLOCK_S)
                slot_ok = slots < RATIO
                mask = ((first[:, None] >= 0) & slot_ok[None, :])[:, :, None] & chan_ok[None, None, :]
                token_rows = (first[:, None] + slots[None, :])[:, :, None]
                kv = tl.load(kv_ptr + token_rows * KV_STRIDE + cols[None, None, :], mask=mask, other=0.0).to(COMPUTE)
                ape_mask = slot_ok[:, None] & chan_ok[None, :]
                ape = tl.load(ape_ptr + slots[:, None] * width + cols[None, :], mask=ape_mask, other=0.0)
                logits = tl.load(gate_ptr + token_rows * GATE_STRIDE + cols[None, None, :], mask=mask,
                                 other=0.0).to(COMPUTE) + ape.to(COMPUTE)[None, :, :]
                logits = tl.where(mask, logits, float("-inf"))
                if sweep == 0:
                    new_top = tl.maximum(top, tl.max(logits, axis=1))
                    # Until a column meets a finite logit its max is −inf; shifting by 0 then keeps
                    # exp(−inf − shift) = 0 instead of exp(−inf + inf) = NaN.
                    step_shift = tl.where(new_top == float("-inf"), 0.0, new_top)
                    weights = tl.exp(logits - step_shift[:, None, :])
                    rescale = tl.exp(top - step_shift)
                    total = total * rescale + tl.sum(weights, axis=1)
                    acc = acc * rescale + tl.sum(weights * kv, axis=1)
                    top = new_top
                else:
                    grad_kv = tl.exp(logits - shift[:, None, :]) * inv_total[:, None, :] * grad[:, None, :]
                    grad_logits = grad_kv * (kv - pooled[:, None, :])
                    grad_offsets = token_rows * width + cols[None, None, :]
                    tl.store(dkv_ptr + grad_offsets, grad_kv.to(dkv_ptr.dtype.element_ty), mask=mask)
                    tl.store(dgate_ptr + grad_offsets, grad_logits.to(dgate_ptr.dtype.element_ty), mask=mask)
                    tl.store(dape_ptr + block * RATIO * width + slots[:, None] * width + cols[None, :],
                             tl.sum(grad_logits, axis=0), mask=ape_mask)
    if not BACKWARD:
        pooled = acc / tl.where(total > 0, total, 1.0)  # 0 for an all −inf column, as above
        tl.store(out_ptr + out_offsets, pooled.to(out_ptr.dtype.element_ty),
                 mask=(entries < E)[:, None] & chan_ok[None, :])
