"""Triton kernel building the cuDNN indexer backward's per-slot inputs (see `kl_slots.py`).

Plain function: `lazy_jit.jitted` decorates it on first launch. candidates `[T, C]` int32/int64,
student and target `[T, C]` float32, grad_rows `[T]` float32; outputs `[T, W]` (W ≥ C): weighted and
predict float32, ids int32.
"""

import triton.language as tl

FLOAT32_MIN = tl.constexpr(-3.4028234663852886e38)  # torch.finfo(torch.float32).min: invalid logits


def kl_slots_kernel(candidates_ptr, student_ptr, target_ptr, grad_rows_ptr, weighted_ptr, predict_ptr, ids_ptr,
                    C, W, KEYS, BLOCK: tl.constexpr):
    """One row (grid: (T,)). A slot is valid when its candidate is a key row (`0 <= id < KEYS`).

    predict: softmax over the row's C slots of the student score (invalid slots at float32's lowest
    value, so they hold their share of the sum exactly as in the torch form), 0 at invalid slots;
    weighted: target · grad_rows[row] at valid slots, else 0; ids: the candidate, −1 where invalid.
    Slots C … W−1 are padding: 0, 0 and −1."""
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK)
    in_row = slots < C
    ids = tl.load(candidates_ptr + row * C + slots, mask=in_row, other=-1).to(tl.int64)
    valid = in_row & (ids >= 0) & (ids < KEYS)
    student = tl.load(student_ptr + row * C + slots, mask=valid, other=0.0)
    logits = tl.where(valid, student, FLOAT32_MIN)
    top = tl.max(tl.where(in_row, logits, float("-inf")), 0)
    mass = tl.where(in_row, tl.exp(logits - top), 0.0)
    predict = tl.where(valid, mass / tl.sum(mass, 0), 0.0)
    target = tl.load(target_ptr + row * C + slots, mask=valid, other=0.0)
    weighted = tl.where(valid, target * tl.load(grad_rows_ptr + row), 0.0)
    in_width = slots < W
    tl.store(weighted_ptr + row * W + slots, weighted, mask=in_width)
    tl.store(predict_ptr + row * W + slots, predict, mask=in_width)
    tl.store(ids_ptr + row * W + slots, tl.where(valid, ids, -1).to(tl.int32), mask=in_width)
