"""Triton kernels of the indexer KL loss (see `indexer_loss.py` for the entry points and the math).

Plain functions: `lazy_jit.jitted` decorates them on first launch (the helpers are decorated when this
module is imported, which happens only then; the indexer's KL backward uses the softmax ones too). All tensors are contiguous:
query `[T, H, D]`, kv `[M, D]`, full_lse `[T, H]`, candidates / mass / student / target / valid /
grad `[T, C]`, per-row values `[T]`.

Teacher mass: a program owns one query row and `BLOCK_C` candidate columns. Sparse-attention (MQA)
structure: every head of the row reads the same gathered kv rows, so the heads are the M side of
`tl.dot` and the dims are reduced in `BLOCK_D` steps: `[BLOCK_H, BLOCK_C]` logits live in registers
and are summed over heads there, so `[T, H, C]` never reaches memory.

KL: a program owns one row and walks its columns in `BLOCK_C` steps, twice in forward (online max
and sum of the student's exponentials, then the KL terms) and once in backward.
"""

import triton
import triton.language as tl

# Running max of a lane before any valid column: finite (the float32 minimum), so that
# `exp(m_old − m_new)` is never `exp(−inf + inf)`.
NO_MAX = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def softmax_lane_step(lane_max, lane_sum, s):
    """One step of a per-lane online softmax normaliser: the lanes' running max and Σ exp(s − max) after
    the scores `s` (−inf at the columns left out)."""
    new_max = tl.maximum(lane_max, s)
    return new_max, lane_sum * tl.exp(lane_max - new_max) + tl.exp(s - new_max)


@triton.jit
def softmax_row_normaliser(lane_max, lane_sum):
    """`(row_max, log_norm)` of a row from its lanes (`softmax_lane_step`); `(0, 0)` for a row without a
    valid column."""
    run_max = tl.max(lane_max, axis=0)
    run_sum = tl.sum(lane_sum * tl.exp(lane_max - run_max), axis=0)
    any_valid = run_sum > 0.0
    return tl.where(any_valid, run_max, 0.0), tl.log(tl.where(any_valid, run_sum, 1.0))


@triton.jit
def kl_score_grads(s, target, keep, row_max, log_norm, mass, g):
    """The gradient of `g·KL` w.r.t. the student scores `s` at the kept columns, 0 elsewhere:
    `g·(pred·mass − target·[target > 0])` with `pred = exp((s − row_max) − log_norm)`. `where`, not a
    product with the mask: a NaN upstream g must not reach the other columns."""
    pred = tl.exp((s - row_max) - log_norm)
    return tl.where(keep, g * (pred * mass - tl.where(target > 0.0, target, 0.0)), 0.0)


@triton.jit
def load_kl_columns(s_ptr, target_ptr, valid_ptr, row, start, C, BLOCK_C: tl.constexpr):
    """`(cols, keep, s, target)` of the row's columns `[start, start + BLOCK_C)`: keep = valid and in
    width; s and target are 0 elsewhere."""
    cols = start + tl.arange(0, BLOCK_C)
    keep = (cols < C) & (tl.load(valid_ptr + row + cols, mask=cols < C, other=0) != 0)
    s = tl.load(s_ptr + row + cols, mask=keep, other=0.0)
    target = tl.load(target_ptr + row + cols, mask=keep, other=0.0)
    return cols, keep, s, target


def attention_mass_kernel(q_ptr, kv_ptr, cand_ptr, lse_ptr, out_ptr, M, C, H, scale,
                          DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    """mass[t, c] = Σ_h exp(scale·<q[t,h], kv[cand[t,c]]> − lse[t,h]); 0 where cand ∉ [0, M).

    Grid: (T, cdiv(C, BLOCK_C)). Column blocks without a valid id (the causal future of the dense
    loss) store zeros without touching q or kv."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    in_width = cols < C
    ids = tl.load(cand_ptr + t * C + cols, mask=in_width, other=-1).to(tl.int64)
    valid = (ids >= 0) & (ids < M)
    mass = tl.zeros([BLOCK_C], tl.float32)
    if tl.max(valid.to(tl.int32), axis=0) > 0:
        logits = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for start in range(0, DIM, BLOCK_D):
            d = start + dims
            q = tl.load(q_ptr + t * H * DIM + heads[:, None] * DIM + d[None, :],
                        mask=(heads[:, None] < H) & (d[None, :] < DIM), other=0.0)
            keys = tl.load(kv_ptr + ids[:, None] * DIM + d[None, :],
                           mask=valid[:, None] & (d[None, :] < DIM), other=0.0)
            logits = tl.dot(q, tl.trans(keys), logits, input_precision=PRECISION)
        lse = tl.load(lse_ptr + t * H + heads, mask=heads < H, other=0.0)
        probs = tl.exp(logits * scale - lse[:, None])
        # Padded heads and invalid columns: dropped by selection, so an overflow there cannot leak.
        mass = tl.sum(tl.where((heads[:, None] < H) & valid[None, :], probs, 0.0), axis=0)
    tl.store(out_ptr + t * C + cols, mass, mask=in_width)


def kl_forward_kernel(s_ptr, target_ptr, valid_ptr, kl_ptr, max_ptr, log_norm_ptr, mass_ptr, C,
                      BLOCK_C: tl.constexpr):
    """KL of one row (grid: (T,)) and what its backward needs.

    Pass 1: m = max and l = Σ exp(s − m) over the valid columns, online per lane (no reduction per
    step). Pass 2, with log pred = (s − m) − log l (the log-softmax's own rounding order) and
    P = valid ∧ target > 0:
        kl = Σ_P target·(log target − log pred),   mass = Σ_P target.
    Stores kl, m, log l and mass; a row without valid columns stores 0 for all four."""
    t = tl.program_id(0)
    row = t.to(tl.int64) * C
    lane_max = tl.full([BLOCK_C], NO_MAX, tl.float32)
    lane_sum = tl.zeros([BLOCK_C], tl.float32)
    start = 0
    while start < C:  # not `for ... in range(0, C, ...)`: the interpreter cannot index with a runtime C
        cols = start + tl.arange(0, BLOCK_C)
        keep = (cols < C) & (tl.load(valid_ptr + row + cols, mask=cols < C, other=0) != 0)
        s = tl.load(s_ptr + row + cols, mask=keep, other=float("-inf"))
        lane_max, lane_sum = softmax_lane_step(lane_max, lane_sum, s)
        start += BLOCK_C
    row_max, log_norm = softmax_row_normaliser(lane_max, lane_sum)
    lane_kl = tl.zeros([BLOCK_C], tl.float32)
    lane_mass = tl.zeros([BLOCK_C], tl.float32)
    start = 0
    while start < C:
        _, keep, s, target = load_kl_columns(s_ptr, target_ptr, valid_ptr, row, start, C, BLOCK_C)
        positive = keep & (target > 0.0)
        safe_target = tl.where(positive, target, 1.0)  # log only of positive targets: 0·log 0 = 0
        log_pred = (s - row_max) - log_norm
        lane_kl += tl.where(positive, target * (tl.log(safe_target) - log_pred), 0.0)
        lane_mass += tl.where(positive, target, 0.0)
        start += BLOCK_C
    tl.store(kl_ptr + t, tl.sum(lane_kl, axis=0))
    tl.store(max_ptr + t, row_max)
    tl.store(log_norm_ptr + t, log_norm)
    tl.store(mass_ptr + t, tl.sum(lane_mass, axis=0))


def kl_backward_kernel(s_ptr, target_ptr, valid_ptr, max_ptr, log_norm_ptr, mass_ptr, grad_kl_ptr,
                       grad_s_ptr, C, BLOCK_C: tl.constexpr):
    """grad_s[t, c] = g_t·(pred·mass − target·[target > 0]) on valid columns, 0 elsewhere (grid: (T,);
    see `kl_score_grads`)."""
    t = tl.program_id(0)
    row = t.to(tl.int64) * C
    g = tl.load(grad_kl_ptr + t)
    row_max = tl.load(max_ptr + t)
    log_norm = tl.load(log_norm_ptr + t)
    mass = tl.load(mass_ptr + t)
    start = 0
    while start < C:
        cols, keep, s, target = load_kl_columns(s_ptr, target_ptr, valid_ptr, row, start, C, BLOCK_C)
        tl.store(grad_s_ptr + row + cols, kl_score_grads(s, target, keep, row_max, log_norm, mass, g), mask=cols < C)
        start += BLOCK_C
