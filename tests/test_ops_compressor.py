"""Compressor tests (docs/math.md §4) against the scalar-loop gated-pooling oracle.

Tolerance: fp64 op vs fp64 oracle (values and autograd gradients), rtol 1e-10 / atol 1e-12 — only
summation order differs. Segment-isolation checks are exact (`torch.equal`): an entry of another
segment must not move at all.
"""

from dataclasses import dataclass

import pytest
import torch

from megatron_dsa.ops.compressor import channel_factor, compress, gated_pool
from megatron_dsa.ops.layout import TokenLayout
from oracles import compressor_oracle, gated_pool_oracle, rope_oracle, yarn_inv_freq_oracle

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
EPS = 1e-6
# Per ratio: segment lengths covering a short segment, an exact multiple and a tail.
CASES = {4: [13, 8, 3], 8: [17, 8], 16: [35, 16, 5], 128: [259, 128]}
HIDDEN = 3
INV_FREQ = yarn_inv_freq_oracle(4, 40000.0, 4.0, 65536)  # P = 4 rope dims of Dc


def packed(lengths) -> TokenLayout:
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.long)
    return TokenLayout(cu_seqlens=cu, num_rows=sum(lengths), max_seqlen=max(lengths))


@dataclass
class Params:
    x: torch.Tensor
    wkv: torch.Tensor
    wgate: torch.Tensor
    ape: torch.Tensor
    norm: torch.Tensor

    def leaves(self):
        return (self.x, self.wkv, self.wgate, self.ape, self.norm)


def make_params(tokens: int, dc: int, ratio: int, seed: int = 0) -> Params:
    gen = torch.Generator().manual_seed(seed)
    width = channel_factor(ratio) * dc

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale).requires_grad_()

    return Params(x=rand(tokens, HIDDEN), wkv=rand(width, HIDDEN), wgate=rand(width, HIDDEN, scale=0.7),
                  ape=rand(ratio, width, scale=0.5), norm=(1.0 + rand(dc, scale=0.3)).detach().requires_grad_())


def run_compress(p: Params, layout: TokenLayout, ratio: int, rotate: bool, inv_freq=INV_FREQ):
    return compress(p.x @ p.wkv.T, p.x @ p.wgate.T, p.ape, p.norm, EPS, layout.compressed(ratio),
                    torch.tensor(inv_freq, dtype=F64), rotate)


def real_rows(layout, ratio):
    return int(layout.compressed(ratio).cu_compressed[-1])


def test_channel_factor():
    assert [channel_factor(r) for r in (4, 8, 16, 128)] == [2, 1, 1, 1]


@pytest.mark.parametrize("ratio", sorted(CASES))
def test_gated_pool_matches_oracle(ratio):
    lengths, dc = CASES[ratio], 4
    tokens = sum(lengths)
    gen = torch.Generator().manual_seed(ratio)
    width = channel_factor(ratio) * dc
    kv, gate = (torch.randn(tokens, width, generator=gen, dtype=F64) for _ in range(2))
    ape = torch.randn(ratio, width, generator=gen, dtype=F64)
    clayout = packed(lengths).compressed(ratio)
    got = gated_pool(kv, gate, ape, clayout)
    n = real_rows(packed(lengths), ratio)
    assert got.shape == (clayout.capacity, dc) and got.dtype == F64
    torch.testing.assert_close(got[:n], gated_pool_oracle(kv, gate, ape, lengths, ratio), **TOL)
    assert torch.isfinite(got).all()  # unused capacity rows: finite garbage


@pytest.mark.parametrize("rotate", [False, True], ids=["main", "indexer_hadamard"])
@pytest.mark.parametrize("ratio", sorted(CASES))
def test_compress_forward_and_grads_match_oracle(ratio, rotate):
    """docs/math.md §4: value and gradients for x, wkv, wgate, ape and the norm weight."""
    lengths = CASES[ratio]
    dc = 8 if ratio == 4 else 4  # power of two for the Hadamard
    p = make_params(sum(lengths), dc, ratio)
    layout = packed(lengths)
    n = real_rows(layout, ratio)
    got = run_compress(p, layout, ratio, rotate)[:n]
    expected = compressor_oracle(*p.leaves(), EPS, lengths, ratio, INV_FREQ, rotate)
    torch.testing.assert_close(got, expected, **TOL)
    upstream = torch.randn(expected.shape, dtype=F64)
    grads = torch.autograd.grad((got * upstream).sum(), p.leaves())
    oracle_grads = torch.autograd.grad((expected * upstream).sum(), p.leaves())
    for name, a, b in zip(("x", "wkv", "wgate", "ape", "norm"), grads, oracle_grads):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"grad {name}: {m}")


def test_overlap_slots_use_previous_group_first_half_and_own_group_second_half():
    """r = 4: entry j reads group j−1 only through projection channels [:Dc] and group j only through
    [Dc:]; the first entry of a segment has no previous-group slots (0 / −inf)."""
    ratio, dc, lengths = 4, 2, [12]
    gen = torch.Generator().manual_seed(3)
    kv, gate = (torch.randn(12, 2 * dc, generator=gen, dtype=F64) for _ in range(2))
    ape = torch.randn(ratio, 2 * dc, generator=gen, dtype=F64)
    clayout = packed(lengths).compressed(ratio)
    base = gated_pool(kv, gate, ape, clayout)

    def perturbed(rows, channels):
        kv2, gate2 = kv.clone(), gate.clone()
        kv2[rows, channels] += 5.0
        gate2[rows, channels] -= 3.0
        return gated_pool(kv2, gate2, ape, clayout)

    group1 = slice(4, 8)
    unaffected_by_second_half = perturbed(group1, slice(dc, None))  # only entry 1 reads group 1's [Dc:]
    assert torch.equal(unaffected_by_second_half[[0, 2]], base[[0, 2]])
    assert not torch.allclose(unaffected_by_second_half[1], base[1])
    unaffected_by_first_half = perturbed(group1, slice(0, dc))  # only entry 2 reads group 1's [:Dc]
    assert torch.equal(unaffected_by_first_half[[0, 1]], base[[0, 1]])
    assert not torch.allclose(unaffected_by_first_half[2], base[2])
    # first entry: a softmax over its own group's [Dc:] channels only
    own = torch.softmax(gate[0:4, dc:] + ape[:, dc:], dim=0)
    torch.testing.assert_close(base[0], (own * kv[0:4, dc:]).sum(0), **TOL)


@pytest.mark.parametrize("ratio", [8, 128])
def test_non_overlapping_entry_reads_only_its_group(ratio):
    lengths = [3 * ratio]
    gen = torch.Generator().manual_seed(5)
    kv, gate = (torch.randn(3 * ratio, 2, generator=gen, dtype=F64) for _ in range(2))
    ape = torch.randn(ratio, 2, generator=gen, dtype=F64)
    clayout = packed(lengths).compressed(ratio)
    base = gated_pool(kv, gate, ape, clayout)
    kv2 = kv.clone()
    kv2[ratio:2 * ratio] += 1.0
    moved = gated_pool(kv2, gate, ape, clayout)
    assert torch.equal(moved[[0, 2]], base[[0, 2]])
    torch.testing.assert_close(moved[1], base[1] + 1.0, **TOL)  # softmax weights sum to 1


@pytest.mark.parametrize("ratio", [4, 16])
def test_multi_segment_never_mixes_segments(ratio):
    """Packed segments compress exactly as separate calls; perturbing one segment leaves the others."""
    lengths = CASES[ratio]
    dc = 8 if ratio == 4 else 4
    p = make_params(sum(lengths), dc, ratio, seed=11)
    layout = packed(lengths)
    with torch.no_grad():
        together = run_compress(p, layout, ratio, rotate=True)[:real_rows(layout, ratio)]
        parts, start = [], 0
        for length in lengths:
            alone = Params(p.x[start:start + length], p.wkv, p.wgate, p.ape, p.norm)
            parts.append(run_compress(alone, packed([length]), ratio, rotate=True)[:length // ratio])
            start += length
        torch.testing.assert_close(together, torch.cat(parts), **TOL)
        x2 = p.x.clone()
        x2[:lengths[0]] += 10.0  # perturb segment 0 only
        moved = run_compress(Params(x2, p.wkv, p.wgate, p.ape, p.norm), layout, ratio, rotate=True)
        first = lengths[0] // ratio
        assert torch.equal(moved[first:real_rows(layout, ratio)], together[first:])


def test_compressed_rope_equals_strided_full_length_table():
    """docs/math.md §2.6: the compressor's rotation at `j·r` equals rotating the unrotated entries with the
    angles of a full-length (C·r) table taken at stride r."""
    ratio, lengths = 4, [13, 8, 3]
    p = make_params(sum(lengths), 8, ratio, seed=2)
    layout = packed(lengths)
    n = real_rows(layout, ratio)
    with torch.no_grad():
        rotated = run_compress(p, layout, ratio, rotate=False)[:n]
        unrotated = run_compress(p, layout, ratio, rotate=False, inv_freq=[0.0, 0.0])[:n]
    full_table = list(range(max(lengths) // ratio * ratio))
    strided = [full_table[j * ratio] for length in lengths for j in range(length // ratio)]
    torch.testing.assert_close(rotated, rope_oracle(unrotated, strided, INV_FREQ), **TOL)


@pytest.mark.parametrize("ratio", [4, 128])
def test_sequence_shorter_than_ratio_gives_no_entries_and_zero_grads(ratio):
    p = make_params(2 * (ratio - 1), 4, ratio)
    layout = TokenLayout.uniform(2, ratio - 1, torch.device("cpu"))
    out = run_compress(p, layout, ratio, rotate=False)
    assert out.shape == (0, 4)
    grads = torch.autograd.grad(out.sum(), p.leaves(), allow_unused=True)
    for g, leaf in zip(grads, p.leaves()):
        assert g is not None and torch.equal(g, torch.zeros_like(leaf))


def test_unused_capacity_rows_are_finite():
    """Lengths [7, 1] at r = 4: capacity 2, one real entry; the spare row must not be NaN/inf."""
    lengths, ratio = [7, 1], 4
    p = make_params(8, 8, ratio)
    clayout = packed(lengths).compressed(ratio)
    assert clayout.capacity == 2 and int(clayout.valid.sum()) == 1
    out = run_compress(p, packed(lengths), ratio, rotate=True)
    assert out.shape == (2, 8) and torch.isfinite(out).all()
    torch.testing.assert_close(out[:1], compressor_oracle(*p.leaves(), EPS, lengths, ratio, INV_FREQ, True),
                               **TOL)
