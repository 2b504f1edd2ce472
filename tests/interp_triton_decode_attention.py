"""Triton decode attention in the CPU interpreter against the reference decode (fp32): the op against
`ops.decode_attention` (windows, ragged lengths, a sequence with no entries yet, selected and every visible
entry, the sink, one and several key splits), and decode steps of W, C and H layers whose attention runs the
Triton kernel against the same steps through the unfused op (the reference decode, equal to the full forward
in float64: tests/test_decoding.py).

Not collected by the default suite: `test_triton_decode_attention.py` runs this file in a child process under
the interpreter (`triton_support.run_interpreted` says why). Tolerance: fp32 kernel vs fp32 reference differ
only in summation order (and the split merge), atol 2e-5 / rtol 1e-4 on values of order 1.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttentionConfig
from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.backends.triton_kernels.decode_attention import INTERPRETER_BLOCK_K, DecodeTiles
from megatron_dsa.backends.triton_kernels.decode_attention import decode_attention as triton_decode
from megatron_dsa.layers.decoding import LayerCache
from megatron_dsa.layers.kinds import build_attention
from megatron_dsa.ops.decode_attention import decode_attention as reference_decode
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")
TOL = dict(atol=2e-5, rtol=1e-4)


def decode_inputs(heads: int, dim: int, ring: int, entries: int, picks: int, seed: int = 0):
    """Four sequences: no token cached yet, a partial window, a full window with some entries, many entries."""
    g = torch.Generator().manual_seed(seed)
    batch = 4
    seqlens = torch.tensor([0, 2, ring + 5, 4 * entries - 1])
    ids = torch.randint(-1, entries, (batch, picks), generator=g)
    ids[0] = -1  # the empty sequence picks nothing
    ids[1, 0] = entries - 1  # a pick the sequence cannot see yet (it is ignored)
    return dict(query=torch.randn(batch, heads, dim, generator=g), kv_new=torch.randn(batch, dim, generator=g),
                window_rows=torch.randn(batch, ring, dim, generator=g), seqlens=seqlens,
                entries=torch.randn(batch, entries, dim, generator=g), entry_ids=ids, ratio=4,
                sink=torch.randn(heads, generator=g), scale=dim ** -0.5)


@pytest.mark.parametrize("heads, dim", [(4, 32), (3, 48), (20, 16)], ids=["h4_d32", "h3_d48_tail", "h20_d16"])
@pytest.mark.parametrize("entries", ["none", "every", "selected"])
@pytest.mark.parametrize("splits", [1, 3, None], ids=["one_split", "three_splits", "default_splits"])
def test_op_matches_reference(heads, dim, entries, splits):
    inputs = decode_inputs(heads, dim, ring=7, entries=9, picks=5)
    if entries != "selected":
        inputs["entry_ids"] = None
    if entries == "none":
        inputs["entries"] = None
    window = 8  # ring of W − 1 = 7 slots
    expected = reference_decode(window=window, **inputs)
    got = triton_decode(window=window, splits=splits, **inputs)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("entries", ["every", "selected"])
@pytest.mark.parametrize("splits", [1, 3])
def test_two_value_parts_match_the_reference(entries, splits):
    """Two programs per (sequence, head block, split), each writing half of the output's columns (one the output,
    several the partials the combine merges), give the same output as one."""
    inputs = decode_inputs(4, 32, ring=7, entries=9, picks=5)
    if entries != "selected":
        inputs["entry_ids"] = None
    tiles = DecodeTiles(INTERPRETER_BLOCK_K, 4, 2, parts=2)
    got = triton_decode(window=8, splits=splits, tiles=tiles, **inputs)
    torch.testing.assert_close(got, reference_decode(window=8, **inputs), **TOL)


@pytest.mark.parametrize("splits", [1, 3], ids=["one_split_then_rope_kernel", "in_the_combine"])
@pytest.mark.parametrize("heads, dim, pairs", [(4, 32, 4), (3, 48, 8), (4, 32, 16)],
                         ids=["h4_d32_p8", "h3_d48_p16", "h4_d32_all_rotated"])
def test_the_output_turned_back_matches_the_reference(splits, heads, dim, pairs):
    """With `inverse_rope_freq` the RoPE columns leave turned back by −p·freq (the reference applies the RoPE op
    after the attention; the kernel's combine applies it as it writes)."""
    inputs = decode_inputs(heads, dim, ring=7, entries=9, picks=5)
    freq = 1.0 / 40 ** (torch.arange(pairs) / pairs)
    expected = reference_decode(window=8, inverse_rope_freq=freq, **inputs)
    unturned = reference_decode(window=8, **inputs)
    assert not torch.allclose(expected[..., -2 * pairs:], unturned[..., -2 * pairs:])
    got = triton_decode(window=8, splits=splits, inverse_rope_freq=freq, **inputs)
    torch.testing.assert_close(got, expected, **TOL)


def test_a_bad_inverse_rope_freq_is_named():
    inputs = decode_inputs(4, 32, ring=7, entries=9, picks=5)
    with pytest.raises(ValueError, match="inverse_rope_freq must be a floating"):
        triton_decode(window=8, inverse_rope_freq=torch.ones(17), **inputs)


def test_two_value_parts_need_a_power_of_two_head_dim():
    inputs = decode_inputs(3, 48, ring=7, entries=9, picks=5)
    with pytest.raises(ValueError, match="value parts must be 1, or 2 where the head dim is a power of two"):
        triton_decode(window=8, tiles=DecodeTiles(INTERPRETER_BLOCK_K, 4, 2, parts=2), **inputs)


def test_window_of_one_attends_the_new_row_and_entries_only():
    inputs = decode_inputs(4, 32, ring=1, entries=9, picks=5)
    torch.testing.assert_close(triton_decode(window=1, **inputs), reference_decode(window=1, **inputs), **TOL)


def test_a_dominating_sink_leaves_finite_outputs():
    """A sink far above every score leaves outputs near 0, finite, as the reference."""
    inputs = decode_inputs(4, 32, ring=7, entries=9, picks=5)
    inputs["sink"] = torch.full((4,), 80.0)
    for splits in (1, 3):
        got = triton_decode(window=8, splits=splits, **inputs)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, reference_decode(window=8, **inputs), **TOL)


def decoding_config(kind: str) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern=kind, csa_window_size=5,
                                             hca_compress_ratio=8, dsa_indexer_topk=3)


@torch.no_grad()
def decode_twins(kind: str, family: str, tokens: int = 30, prompt: int = 6, **cache_options) -> list[tuple]:
    """A `kind` layer on the reference path and its twin (same weights) with `family` on Triton: `prompt` tokens of
    3 sequences prefilled, then one at a time up to `tokens`, caches made with `cache_options`. Per layer `(outputs
    [tokens, 3, d], picks [steps, 3, k] of a C layer or None, cache)`; the call counters count the twin's
    single-token steps."""
    config = decoding_config(kind)
    torch.manual_seed(0)
    reference = build_attention(config.replace(attention_backend="unfused"), kind=kind).eval()
    fused = build_attention(config.replace(attention_backend_overrides={family: "triton"}), kind=kind).eval()
    fused.load_state_dict(reference.state_dict())
    hidden = torch.randn(tokens, 3, config.hidden_size)
    runs = []
    for layer in (reference, fused):
        cache = LayerCache.for_layer(layer, 3, tokens, **cache_options)
        steps, chosen = [layer(hidden[:prompt], inference_cache=cache)[0]], []
        reset_call_counts()
        for t in range(prompt, tokens):
            steps.append(layer(hidden[t:t + 1], inference_cache=cache)[0])
            chosen.append(layer.core_attention.last_decode_picks if kind == "C" else None)
        runs.append((torch.cat(steps), None if kind != "C" else torch.stack(chosen), cache))
    return runs


@pytest.mark.parametrize("kind", ["W", "C", "H", "M"])
def test_decode_steps_with_the_triton_kernel_match_the_reference_decode(kind):
    """Prefill (reference path) then one token at a time: the attention through the Triton kernel (counted)
    against the same steps through the unfused op, fp32 (M: its absorbed step, the whole cache as the ring and
    a −inf sink)."""
    config = decoding_config(kind)
    torch.manual_seed(0)
    reference = build_attention(config.replace(attention_backend="unfused"), kind=kind).eval()
    if kind != "M":
        with torch.no_grad():
            reference.core_attention.attn_sink.normal_()
    fused = build_attention(config.replace(attention_backend_overrides={"decode_attention": "triton"}),
                            kind=kind).eval()
    fused.load_state_dict(reference.state_dict())
    hidden = torch.randn(19, 3, config.hidden_size)
    outputs = []
    for layer in (reference, fused):
        cache = LayerCache.for_layer(layer, 3, 19)
        with torch.no_grad():
            steps = [layer(hidden[:6], inference_cache=cache)[0]]
            reset_call_counts()
            steps += [layer(hidden[t:t + 1], inference_cache=cache)[0] for t in range(6, 19)]
        outputs.append(torch.cat(steps))
    assert call_counts()[("triton", "decode_attention")] == 13
    torch.testing.assert_close(outputs[1], outputs[0], **TOL)
