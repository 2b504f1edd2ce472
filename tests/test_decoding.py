"""Incremental decoding (`layers.decoding`): prefill in chunks, then one token at a time, equals the
full-sequence forward for every kind, in float64 to 1e-12; batches of different lengths and packed
prompts too; C layers pick the same top-k entries. Prefill chunks run the reference path, single tokens
of W/C/H layers the decode step (`decode_step`), so both are held to the full forward here."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import assert_bf16_parity, run_distributed
from megatron_dsa import HybridAttentionConfig
from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.layers.decoding import LayerCache, cache_footprint, dense_mla_bytes_per_token
from megatron_dsa.layers.kinds import build_attention
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.sharding import load_full_state_dict

KINDS = ("W", "C", "H", "M")
TOLERANCE = 1e-12


def config(kind: str) -> HybridAttentionConfig:
    # Window 5 and top-k 3: windows, groups (r = 4, 8) and chunks fall out of step; the top-k must choose.
    return HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern=kind, csa_window_size=5,
                                             hca_compress_ratio=8, dsa_indexer_topk=3)


def layer_and_input(kind: str, seqlen: int, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    layer = build_attention(config(kind), kind=kind).double().eval()
    with torch.no_grad():  # a nonzero sink, so it takes part in every softmax
        for name, parameter in layer.named_parameters():
            if name.endswith("attn_sink"):
                parameter.normal_()
    return layer, torch.randn(seqlen, batch, layer.config.hidden_size, dtype=torch.float64)


def run_in_chunks(layer, hidden, chunks: list[int], **cache_options) -> torch.Tensor:
    """`hidden [S, B, d]` through the cache (made with `cache_options`) in consecutive chunks of the given sizes →
    `[S, B, d]`."""
    cache = LayerCache.for_layer(layer, hidden.shape[1], hidden.shape[0], **cache_options)
    outputs, start = [], 0
    for size in chunks:
        outputs.append(layer(hidden[start:start + size], inference_cache=cache)[0])
        start += size
    assert start == hidden.shape[0] and cache.seqlens.tolist() == [start] * hidden.shape[1]
    return torch.cat(outputs)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefill", [1, 6, 11, 16])
@torch.no_grad()
def test_prefill_then_one_token_at_a_time_equals_the_full_forward(kind: str, prefill: int) -> None:
    seqlen = 21
    layer, hidden = layer_and_input(kind, seqlen, batch=2)
    full = layer(hidden)[0]
    decoded = run_in_chunks(layer, hidden, [prefill] + [1] * (seqlen - prefill))
    assert max_error(decoded, full) < TOLERANCE


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_chunked_prefill_of_odd_sizes_equals_the_full_forward(kind: str) -> None:
    layer, hidden = layer_and_input(kind, 40, batch=2, seed=1)
    full = layer(hidden)[0]
    assert max_error(run_in_chunks(layer, hidden, [3, 7, 1, 9, 5, 13, 2]), full) < TOLERANCE


class AtenOps(TorchDispatchMode):
    """Counts the aten ops that run (views excluded: they launch nothing), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_a_decode_step_writes_each_cache_buffer_in_one_family_call(kind: str) -> None:
    """A decode step hands each compressor's new slot and its group's entry to one `decode_compressor` call, and the
    new row's write into the window ring (M: the latent cache) with the lengths' increment to one `decode_append`
    call (one kernel each on CUDA; the writes, the slot arithmetic and the pooling are the families'); after it the
    lengths count the new token. A prefill call makes neither."""
    layer, hidden = layer_and_input(kind, 12, batch=3)
    cache = LayerCache.for_layer(layer, 3, 12)
    reset_call_counts()
    writes = lambda: {op: n for (_, op), n in call_counts().items()  # noqa: E731
                      if op in ("decode_compressor", "decode_append")}
    layer(hidden[:9], inference_cache=cache)
    assert not writes(), call_counts()
    layer(hidden[9:10], inference_cache=cache)
    compressors = {"C": 2, "H": 1}.get(kind)
    expected = {"decode_append": 1, **({"decode_compressor": compressors} if compressors else {})}
    assert writes() == expected, call_counts()
    assert cache.seqlens.tolist() == [10] * 3


# The aten ops (views excluded) of one C-layer decode step on the CPU: 256 before the step stopped stacking the
# projection weights and converting the RoPE table every call and writing kv and gate slots separately, 250 until
# the compressor writes became one `decode_compressor` call each (pure reference ops on the CPU), 245 until the
# step stopped building the top-k's valid mask (cuDNN's top-k reads the counts; the reference builds the mask
# from them: 246 since), 247 since the window write and the length increment became one `decode_append` call (one
# kernel on CUDA; the reference numbers the sequences itself, where the step kept an arange), 248 since the
# indexer's compressor write gives the entry counts (the reference copies them into the step's int32 buffer; on
# CUDA the write's kernel stores them, three elementwise kernels fewer), 250 since the compressor write's reference
# takes the store as a ring of slots (`j % C`: one slot for FP8 attention rows' scratch row; a remainder each, no
# kernel more on CUDA). On the CPU the op families run their reference ops; the rest is the step's own glue, which a
# CUDA graph replays as one node per kernel. A bound, not a count of each op: an accidental per-step copy, cat or
# constant raises it.
C_DECODE_STEP_OPS = 250


@torch.no_grad()
def test_a_c_decode_step_runs_no_more_ops_than_it_needs() -> None:
    layer, hidden = layer_and_input("C", 12, batch=3)
    layer, hidden = layer.float(), hidden.float()  # float32: the RoPE table (float64) is converted, once
    cache = LayerCache.for_layer(layer, 3, 12)
    layer(hidden[:9], inference_cache=cache)
    layer(hidden[9:10], inference_cache=cache)
    with AtenOps() as ops:
        layer(hidden[10:11], inference_cache=cache)
    assert sum(ops.counts.values()) <= C_DECODE_STEP_OPS, ops.counts


@pytest.mark.parametrize("hooked", [False, True])
@torch.no_grad()
def test_an_m_layer_decodes_through_the_decode_attention_family_unless_its_up_projection_is_hooked(
        hooked: bool) -> None:
    """An M layer's single-token steps run the decode step, its up-projection absorbed, through the
    `decode_attention` family (counted); with a hook on `linear_kv_up_proj` (a module whose output may not be
    `latent · Wᵀ`) they take the reference path, which calls the module. Both equal the full forward."""
    layer, hidden = layer_and_input("M", 14, batch=2, seed=2)
    full = layer(hidden)[0]
    calls = []
    if hooked:
        layer.linear_kv_up_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    reset_call_counts()
    decoded = run_in_chunks(layer, hidden, [5] + [1] * 9)
    assert max_error(decoded, full) < TOLERANCE
    decode_calls = sum(n for (_, op), n in call_counts().items() if op == "decode_attention")
    assert decode_calls == (0 if hooked else 9), call_counts()
    if hooked:  # the reference path up-projects every cached latent, each step
        assert calls == [2 * n for n in range(5, 15)]


@torch.no_grad()
def test_every_decode_step_of_a_c_layer_selects_the_full_forwards_entries() -> None:
    seqlen, prefill = 33, 9
    layer, hidden = layer_and_input("C", seqlen, batch=2, seed=2)
    layer(hidden)
    full = layer.core_attention.last_selection.entries.view(2, seqlen, -1)  # rows are batch-major
    cache = LayerCache.for_layer(layer, 2, seqlen)
    layer(hidden[:prefill], inference_cache=cache)
    chosen = 0
    for position in range(prefill, seqlen):
        layer(hidden[position:position + 1], inference_cache=cache)  # a decode step: it keeps only its picks
        assert layer.core_attention.last_selection is None
        step = layer.core_attention.last_decode_picks  # [B, K'], a set: any order, −1 or not visible where no pick
        visible = (position + 1) // layer.core_attention.indexer.compressor.ratio
        step = torch.where((step >= 0) & (step < visible), step, -1).sort(dim=1, descending=True).values
        width = min(step.shape[1], full.shape[2])
        assert torch.equal(step[:, :width], full[:, position, :width].sort(dim=1, descending=True).values)
        assert (step[:, width:] < 0).all() and (full[:, position, width:] < 0).all()
        chosen += int((step >= 0).sum())
    assert chosen > 0


@torch.no_grad()
def test_fp8_indexer_keys_hold_the_rounded_keys_and_change_nothing_else() -> None:
    """A C layer's cache with FP8 indexer keys, prefilled in chunks and decoding, against the same steps on a
    native cache: the stored keys times their scales are the native cache's keys rounded to e4m3 (relative error
    at most 2⁻⁴ of each key's largest value: 3 mantissa bits), and with a top-k that keeps every entry (the
    indexer's scores then choose nothing) the outputs agree to float64 rounding; the cache is smaller."""
    seqlen = 29
    layer, hidden = layer_and_input("C", seqlen, batch=2, seed=3)
    layer.config = layer.config.replace(dsa_indexer_topk=64)
    layer.core_attention.indexer.config = layer.config
    caches = [LayerCache.for_layer(layer, 2, seqlen), LayerCache.for_layer(layer, 2, seqlen, fp8_indexer_keys=True)]
    assert caches[1].indexer_keys.dtype == torch.float8_e4m3fn and caches[1].indexer_key_scales.dtype == torch.float32
    outputs = [[], []]
    for chunk in ([0, 7], [7, 12], *[[t, t + 1] for t in range(12, seqlen)]):
        for cache, out in zip(caches, outputs):
            out.append(layer(hidden[chunk[0]:chunk[1]], inference_cache=cache)[0])
        native = caches[0].indexer_keys
        stored = caches[1].indexer_keys.double() * caches[1].indexer_key_scales.double().unsqueeze(-1)
        bound = native.abs().amax(-1, keepdim=True) * 2 ** -4
        assert ((stored - native).abs() <= bound).all()
    assert max_error(torch.cat(outputs[1]), torch.cat(outputs[0])) < TOLERANCE
    assert caches[1].nbytes() < caches[0].nbytes()


@torch.no_grad()
def test_fp8_indexer_keys_pick_the_top_k_of_the_scores_of_the_stored_keys() -> None:
    """Decode steps of a C layer with FP8 indexer keys pick, as a set, the top-k of the scores of the keys the
    cache holds (codes times scales) against the step's queries rounded to e4m3 (one scale per head row), both
    dequantized and scored by the float64 reference: the step scores what it stored."""
    from megatron_dsa.ops.decode_attention import entry_counts
    from megatron_dsa.ops.fp8_linear import quantize_rows
    from megatron_dsa.ops.indexer import decode_indexer_scores
    from megatron_dsa.ops.indices import topk_columns

    seqlen, prefill = 33, 9
    layer, hidden = layer_and_input("C", seqlen, batch=2, seed=4)
    indexer = layer.core_attention.indexer
    cache = LayerCache.for_layer(layer, 2, seqlen, fp8_indexer_keys=True)
    layer(hidden[:prefill], inference_cache=cache)
    queries = []
    original = indexer.queries
    indexer.queries = lambda *args, **kwargs: queries.append(original(*args, **kwargs)) or queries[-1]
    chosen = 0
    for position in range(prefill, seqlen):
        layer(hidden[position:position + 1], inference_cache=cache)
        q, weights = queries[-1]  # the step's head weights without HI^-1/2: its scale carries it
        counts = entry_counts(torch.full((2,), position), indexer.compressor.ratio)
        keys = cache.indexer_keys.double() * cache.indexer_key_scales.double().unsqueeze(-1)
        q_codes, q_scales = quantize_rows(q.flatten(0, 1))
        rounded = (q_codes.double() * q_scales).view(q.shape)
        scores = decode_indexer_scores(rounded, keys, weights, counts, indexer.scale * indexer.head_weight_scale)
        visible = torch.arange(keys.shape[1]) < counts.unsqueeze(1)
        want = topk_columns(scores, visible, layer.config.dsa_indexer_topk)
        step = layer.core_attention.last_decode_picks
        step = torch.where((step >= 0) & (step < counts.unsqueeze(1)), step, -1)
        assert torch.equal(step.sort(dim=1).values, want.sort(dim=1).values), position
        chosen += int((step >= 0).sum())
    assert chosen > 0


def one_token_each(batch: int) -> PackedSeqParams:
    return packed([1] * batch)


@pytest.mark.parametrize("kind", ["W", "C", "H"])
@torch.no_grad()
def test_fp8_attention_rows_decode_steps_equal_the_cached_reference_path(kind: str) -> None:
    """With FP8 attention rows every row a query reads is rounded as the pages keep it, its own row too: decode
    steps (`decode_step`: the new row written to its page first, then `paged_decode_attention`) equal the same
    tokens given as packed one-token calls (the reference path, `attend_cached`) to float64 rounding, and both
    stay close to the unrounded full forward (e4m3 keeps three mantissa bits)."""
    seqlen, prefill = 21, 6
    layer, hidden = layer_and_input(kind, seqlen, batch=2, seed=7)
    full = layer(hidden)[0]
    caches = [LayerCache.for_layer(layer, 2, seqlen, fp8_attention_rows=True) for _ in range(2)]
    outputs = [[layer(hidden[:prefill], inference_cache=cache)[0]] for cache in caches]
    reset_call_counts()
    for t in range(prefill, seqlen):
        outputs[0].append(layer(hidden[t:t + 1], inference_cache=caches[0])[0])
        rows = layer(hidden[t].unsqueeze(1), inference_cache=caches[1], packed_seq_params=one_token_each(2))[0]
        outputs[1].append(rows.transpose(0, 1))
    steps = seqlen - prefill
    assert call_counts()[("unfused", "paged_decode_attention")] == steps, call_counts()
    assert call_counts()[("unfused", "paged_rows_write")] == steps * (1 if kind == "W" else 2), call_counts()
    decoded, cached = torch.cat(outputs[0]), torch.cat(outputs[1])
    assert max_error(decoded, cached) < TOLERANCE
    assert torch.equal(caches[0].window.pages, caches[1].window.pages)
    cos = torch.nn.functional.cosine_similarity(decoded.flatten(), full.flatten(), dim=0)
    assert cos > 0.999 and max_error(decoded, full) < 0.05 * float(full.abs().max()), (float(cos),
                                                                                          max_error(decoded, full))


@torch.no_grad()
def test_fp8_attention_rows_leave_a_c_layers_picks_as_they_were() -> None:
    """The indexer scores its own keys, not the attention rows: a C layer picks the same entries each step with FP8
    attention rows as with bf16 rows, and its cache is smaller."""
    seqlen, prefill = 29, 9
    layer, hidden = layer_and_input("C", seqlen, batch=2, seed=8)
    caches = [LayerCache.for_layer(layer, 2, seqlen), LayerCache.for_layer(layer, 2, seqlen, fp8_attention_rows=True)]
    for cache in caches:
        layer(hidden[:prefill], inference_cache=cache)
    for t in range(prefill, seqlen):
        picks = []
        for cache in caches:
            layer(hidden[t:t + 1], inference_cache=cache)
            picks.append(layer.core_attention.last_decode_picks)
        assert torch.equal(picks[0], picks[1]), t
    assert caches[1].nbytes() < caches[0].nbytes()


def test_fp8_attention_rows_are_refused_for_an_m_layer() -> None:
    layer, _ = layer_and_input("M", 1, 1)
    with pytest.raises(ValueError, match="fp8_attention_rows applies to W/C/H layers"):
        LayerCache.for_layer(layer, 2, 8, fp8_attention_rows=True)


def packed(lengths: list[int]) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(cu_seqlens_q=cu, max_seqlen_q=max(lengths))


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_packed_prompts_of_different_lengths_then_batched_decoding_equals_each_sequence_alone(kind: str) -> None:
    prompts, generated = [3, 12, 7], 6
    layer, hidden = layer_and_input(kind, max(prompts) + generated, batch=len(prompts), seed=3)
    cache = LayerCache.for_layer(layer, len(prompts), max(prompts) + generated)
    stream = torch.cat([hidden[:length, b] for b, length in enumerate(prompts)]).unsqueeze(1)
    prefilled = layer(stream, packed_seq_params=packed(prompts), inference_cache=cache)[0][:, 0]
    steps = []
    for step in range(generated):  # each sequence's next token, all in one [1, B, d] call
        next_rows = torch.stack([hidden[length + step, b] for b, length in enumerate(prompts)]).unsqueeze(0)
        steps.append(layer(next_rows, inference_cache=cache)[0][0])
    assert cache.seqlens.tolist() == [length + generated for length in prompts]
    starts = [0, *torch.tensor(prompts).cumsum(0).tolist()]
    for b, length in enumerate(prompts):
        alone = layer(hidden[:length + generated, b:b + 1])[0][:, 0]
        assert max_error(prefilled[starts[b]:starts[b + 1]], alone[:length]) < TOLERANCE
        assert max_error(torch.stack([s[b] for s in steps]), alone[length:]) < TOLERANCE


@pytest.mark.parametrize("kind", ["W", "C", "H"])
@torch.no_grad()
def test_with_fp8_attention_rows_packed_prompts_then_batched_decoding_equal_each_sequence_alone(kind: str) -> None:
    """Packed == separate with FP8 attention rows: rows are rounded one at a time (a scale per 64 columns of a row),
    so prompts prefilled packed and decoded as a batch give each sequence what its own cache of one gives."""
    prompts, generated = [3, 12, 7], 6
    layer, hidden = layer_and_input(kind, max(prompts) + generated, batch=len(prompts), seed=3)
    cache = LayerCache.for_layer(layer, len(prompts), max(prompts) + generated, fp8_attention_rows=True)
    stream = torch.cat([hidden[:length, b] for b, length in enumerate(prompts)]).unsqueeze(1)
    prefilled = layer(stream, packed_seq_params=packed(prompts), inference_cache=cache)[0][:, 0]
    steps = []
    for step in range(generated):
        next_rows = torch.stack([hidden[length + step, b] for b, length in enumerate(prompts)]).unsqueeze(0)
        steps.append(layer(next_rows, inference_cache=cache)[0][0])
    starts = [0, *torch.tensor(prompts).cumsum(0).tolist()]
    for b, length in enumerate(prompts):
        alone = run_in_chunks(layer, hidden[:length + generated, b:b + 1], [length] + [1] * generated,
                              fp8_attention_rows=True)[:, 0]
        assert max_error(prefilled[starts[b]:starts[b + 1]], alone[:length]) < TOLERANCE
        assert max_error(torch.stack([s[b] for s in steps]), alone[length:]) < TOLERANCE


@pytest.mark.parametrize("kind", ["C", "M"])
@torch.no_grad()
def test_a_packed_call_may_extend_only_some_sequences(kind: str) -> None:
    layer, hidden = layer_and_input(kind, 14, batch=2, seed=4)
    cache = LayerCache.for_layer(layer, 2, 14)
    # Sequence 0 gets 9 tokens then 5, sequence 1 gets none then 14: padding-free packed calls.
    first = layer(hidden[:9, :1], packed_seq_params=packed([9, 0]), inference_cache=cache)[0]
    second_stream = torch.cat((hidden[9:, 0], hidden[:, 1])).unsqueeze(1)
    second = layer(second_stream, packed_seq_params=packed([5, 14]), inference_cache=cache)[0][:, 0]
    full = layer(hidden)[0]
    assert max_error(torch.cat((first[:, 0], second[:5])), full[:, 0]) < TOLERANCE
    assert max_error(second[5:], full[:, 1]) < TOLERANCE


@torch.no_grad()
def test_bad_cached_calls_are_rejected_with_clear_errors() -> None:
    layer, hidden = layer_and_input("H", 8, batch=2)
    with pytest.raises(ValueError, match="capacity"):
        layer(hidden, inference_cache=LayerCache.for_layer(layer, 2, 7))
    full = LayerCache.for_layer(layer, 2, 8)
    layer(hidden, inference_cache=full)
    with pytest.raises(ValueError, match="capacity 8"):  # a decode step checks its host-side bound, no sync
        layer(hidden[:1], inference_cache=full)
    with pytest.raises(ValueError, match="batch"):
        layer(hidden, inference_cache=LayerCache.for_layer(layer, 3, 8))
    with pytest.raises(ValueError, match="kind"):
        other, _ = layer_and_input("W", 8, batch=2)
        layer(hidden, inference_cache=LayerCache.for_layer(other, 2, 8))
    with pytest.raises(TypeError, match="LayerCache"):
        layer(hidden, inference_cache={})
    with pytest.raises(ValueError, match="attention_mask"):
        mask = torch.ones(8, 8, dtype=torch.bool).triu(1).view(1, 1, 8, 8)
        layer(hidden, attention_mask=mask, inference_cache=LayerCache.for_layer(layer, 2, 8))
    with pytest.raises(ValueError, match="segment b appends to cached sequence b"):
        layer(hidden[:, :1], packed_seq_params=packed([8]), inference_cache=LayerCache.for_layer(layer, 2, 8))


@pytest.mark.parametrize("kind", ["C", "M"])
def test_an_fp32_cache_serves_bf16_rows_under_autocast(kind: str) -> None:
    torch.manual_seed(0)
    layer = build_attention(config(kind), kind=kind).eval()
    hidden = torch.randn(12, 2, layer.config.hidden_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = layer(hidden)[0].float()
        decoded = run_in_chunks(layer, hidden, [7] + [1] * 5).float()
    assert max_error(decoded, full) < 0.05 * float(full.abs().max())


@pytest.mark.parametrize("kind, options", [(kind, {}) for kind in KINDS] + [("C", dict(fp8_indexer_keys=True))]
                         + [(kind, dict(fp8_attention_rows=True)) for kind in "WCH"],
                         ids=[*KINDS, "C_fp8_indexer_keys", "W_fp8_rows", "C_fp8_rows", "H_fp8_rows"])
def test_the_footprint_counts_what_the_cache_allocates(kind: str, options: dict) -> None:
    """Exactly, but for FP8 attention rows' page padding (less than a row's bytes per page: two pages a
    sequence)."""
    layer, _ = layer_and_input(kind, 1, 1)
    footprint = cache_footprint(layer.config, kind, element_size=8, **options)  # float64 buffers
    c = layer.config
    padding = 2 * (c.v_head_dim + c.qk_pos_emb_head_dim) if options.get("fp8_attention_rows") else 0
    for capacity in (64, 256):  # entry slots a multiple of ENTRY_SLOT_MULTIPLE at every ratio
        cache = LayerCache.for_layer(layer, 3, capacity, **options)
        counted = 3 * (footprint.per_sequence + footprint.per_token * capacity)
        assert counted <= cache.nbytes() <= counted + 3 * padding


@pytest.mark.parametrize("kind", ["C", "H"])
def test_entry_slots_are_rounded_up_to_whole_rows_of_scores(kind: str) -> None:
    """`⌈capacity / r⌉` entry slots rounded up to a multiple of 8 (cuDNN's top-k takes 32-byte rows of float32
    scores without a padded copy), the same for the indexer's keys; a prefill and decode steps in a cache whose
    last slots no token reaches equal the full forward."""
    layer, hidden = layer_and_input(kind, 21, batch=2, seed=3)
    ratio = layer.core_attention.ratio
    for capacity, slots in ((21, 8), (8 * ratio, 8), (8 * ratio + 1, 16)):
        cache = LayerCache.for_layer(layer, 2, capacity)
        assert cache.entries.shape[1] == slots, (capacity, cache.entries.shape)
        if cache.indexer_keys is not None:
            assert cache.indexer_keys.shape[1] == slots
    with torch.no_grad():
        expected = layer(hidden)[0]
        torch.testing.assert_close(run_in_chunks(layer, hidden, [9] + [1] * 12), expected, rtol=0, atol=TOLERANCE)


def test_at_dsv4_flash_dims_the_sparse_kinds_cache_a_fraction_of_dense_mla() -> None:
    c = HybridAttentionConfig.from_preset("dsv4-flash")
    dense = dense_mla_bytes_per_token(c)
    assert dense == (c.mla_kv_lora_rank + c.qk_pos_emb_head_dim) * 2
    assert cache_footprint(c, "M").per_token == dense
    assert cache_footprint(c, "W").per_token == 0
    assert cache_footprint(c, "C").per_token == (c.v_head_dim + c.dsa_indexer_head_dim) / 4 * 2
    assert cache_footprint(c, "C", fp8_indexer_keys=True).per_token == (c.v_head_dim * 2 + c.dsa_indexer_head_dim
                                                                        + 4) / 4  # e4m3 and a float32 scale
    assert cache_footprint(c, "H").per_token == c.v_head_dim / c.hca_compress_ratio * 2


def tensor_parallel_decoding_body(rank: int, world: int) -> None:
    """TP-2 decoding == TP-1 decoding == the full forward, for every kind; with FP8 attention rows (W/C/H), TP-2
    decoding == TP-1 decoding on the same FP8 cache (each rank keeps the whole rows, rounded alike)."""
    state = initialize_parallel_state(tp_size=world)
    chunks = [6, 1, 4] + [1] * 6
    for kind in KINDS:
        reference, hidden = layer_and_input(kind, 17, batch=2, seed=5)
        torch.manual_seed(0)
        layer = build_attention(config(kind), kind=kind, parallel_state=state).double().eval()
        load_full_state_dict(layer, reference.state_dict(), state)
        with torch.no_grad():
            expected = reference(hidden)[0]
            torch.testing.assert_close(run_in_chunks(layer, hidden, chunks), expected, rtol=0, atol=TOLERANCE,
                                       msg=lambda m: f"kind {kind}, rank {rank}: {m}")
            if kind != "M":
                fp8 = [run_in_chunks(model, hidden, chunks, fp8_attention_rows=True) for model in (layer, reference)]
                torch.testing.assert_close(*fp8, rtol=0, atol=TOLERANCE,
                                           msg=lambda m: f"kind {kind} FP8 rows, rank {rank}: {m}")


def test_decoding_under_tensor_parallelism_equals_one_process() -> None:
    run_distributed(tensor_parallel_decoding_body, 2)


def nccl_bf16_decoding_body(rank: int, world: int) -> None:
    """bf16 on GPUs (NCCL): TP-2 prefill + decode steps vs the TP-1 layer's with the same weights, on this rank's
    GPU, for every kind, with FP8 attention rows too (W/C/H). The indexer is replicated across the TP ranks, so both
    runs pick the same entries and only the order of reductions differs (`assert_bf16_parity`). The decode steps run
    the fused kernels, a C layer's with a fork to a side stream (`decoding.beside`, counted here)."""
    from megatron_dsa.layers import decoding

    state = initialize_parallel_state(tp_size=world)
    forks, fork = [], decoding.beside
    decoding.beside = lambda work, device: (forks.append(device), fork(work, device))[1]
    chunks = [137] + [1] * 63
    for kind in KINDS:
        reference, hidden = layer_and_input(kind, sum(chunks), batch=2, seed=6)
        reference, hidden = reference.cuda().bfloat16(), hidden.cuda().bfloat16()
        layer = build_attention(config(kind), kind=kind, parallel_state=state).cuda().bfloat16().eval()
        load_full_state_dict(layer, reference.state_dict(), state)
        with torch.no_grad():
            for options in ({}, {"fp8_attention_rows": True}) if kind != "M" else ({},):
                tag = f"kind {kind} {options} rank {rank}"
                expected = run_in_chunks(reference, hidden, chunks, **options)
                forks.clear()
                reset_call_counts()
                actual = run_in_chunks(layer, hidden, chunks, **options)
                steps = len(chunks) - 1
                attention = "paged_decode_attention" if options else "decode_attention"
                assert call_counts().get(("triton", attention), 0) == steps, (tag, call_counts())
                assert len(forks) == (steps if kind == "C" else 0), (tag, forks)
                assert_bf16_parity([("prefill", actual[:chunks[0]], expected[:chunks[0]]),
                                    ("decode steps", actual[chunks[0]:], expected[chunks[0]:])], tag)


@pytest.mark.multigpu
def test_tensor_parallel_decoding_on_gpus_matches_one_gpu() -> None:
    run_distributed(nccl_bf16_decoding_body, 2, backend="nccl", timeout_s=300)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"fp8_attention_rows": True}])
@torch.no_grad()
def test_a_c_decode_step_makes_what_only_its_attention_reads_beside_the_top_k(monkeypatch: pytest.MonkeyPatch,
                                                                                 options: dict) -> None:
    """On CUDA a C layer's decode step makes what only its attention reads on a side stream beside the indexer's
    top-k: the new K = V rows, the attention compressor's entry (FP8 pages: both written into their pages), the
    queries' GEMM and norm; it joins them before the attention (`decoding.beside`). Each step forks once, and the
    steps give the bits of the same steps made inline."""
    from megatron_dsa.layers import decoding

    layer, hidden = layer_and_input("C", 160, batch=2, seed=3)
    layer, hidden = layer.cuda().bfloat16(), hidden.cuda().bfloat16()
    forks, fork = [], decoding.beside

    def counted(work, device):
        forks.append(device)
        return fork(work, device)

    monkeypatch.setattr(decoding, "beside", counted)
    beside = run_in_chunks(layer, hidden, [100] + [1] * 60, **options)
    assert len(forks) == 60 and {device.type for device in forks} == {"cuda"}, forks
    monkeypatch.setattr(decoding, "beside", lambda work, device: (lambda result: lambda: result)(work()))
    assert torch.equal(run_in_chunks(layer, hidden, [100] + [1] * 60, **options), beside)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_bf16_decoding_on_the_gpu_is_as_close_to_float64_as_the_full_forward(kind: str) -> None:
    """bf16 on the GPU (the fused backends where they serve): prefill + one token at a time is within
    2× the full bf16 forward's error against the float64 forward, plus 1% of the output scale (a C
    layer's top-k may break a near-tie differently in bf16, in either path)."""
    layer, hidden = layer_and_input(kind, 300, batch=2, seed=6)
    layer, hidden = layer.cuda(), hidden.cuda()
    reference = layer(hidden)[0]
    layer, hidden = layer.bfloat16(), hidden.bfloat16()
    reset_call_counts()
    full = layer(hidden)[0].double()
    full_backends = call_counts()
    reset_call_counts()
    decoded = run_in_chunks(layer, hidden, [137] + [1] * 163).double()
    scale = float(reference.abs().max())
    # What the bound's failure message needs to tell a wrong decode from an unfair bound: the prefill's and
    # the single-token steps' errors (the latter run every GEMM on B = 2 rows) and the backends of each path.
    # The 163 single-token steps are decode steps, through the Triton decode kernel (M's with its weights absorbed).
    assert call_counts().get(("triton", "decode_attention"), 0) == 163, call_counts()
    if kind == "C":  # a C layer's decode scores and top-k through Triton's kernels
        assert call_counts().get(("triton", "decode_indexer_scores"), 0) == 163, call_counts()
        assert call_counts().get(("triton", "topk"), 0) >= 163, call_counts()
    compressors = {"C": 2, "H": 1}.get(kind, 0)  # each compressor's write: one Triton kernel a step
    assert call_counts().get(("triton", "decode_compressor"), 0) == 163 * compressors, call_counts()
    error, full_error = max_error(decoded, reference), max_error(full, reference)
    assert error <= 2 * full_error + 1e-2 * scale, (
        f"decoded error {error:.3g} (prefill rows {max_error(decoded[:137], reference[:137]):.3g}, single-token "
        f"rows {max_error(decoded[137:], reference[137:]):.3g}), full bf16 forward {full_error:.3g} (prefill rows "
        f"{max_error(full[:137], reference[:137]):.3g}), scale {scale:.3g}; full forward ran {full_backends}, "
        f"decoding {call_counts()}")
