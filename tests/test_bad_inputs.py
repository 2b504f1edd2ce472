"""Bad and edge inputs, table-driven (issue #25): every bad input gets the exact error type and the
words that name the argument and the rule; every valid edge case gets the right result, checked
against an independent computation. Tiny configs, float64 on CPU.

Sections: attention config, job config, layer inputs, valid layer edge cases, packed metadata
(host errors and the device-side rule of the same inputs), backends, main-job checkpoints and CLI,
converter CLI, distributed runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron_dsa import HybridAttention, HybridAttentionConfig, train
from megatron_dsa.backends import BackendUnavailableError, registry
from megatron_dsa.backends.registry import OpFamily, dispatch
from megatron_dsa.checkpointing import latest_checkpoint, load_checkpoint
from megatron_dsa.packed_seq import PackedSeqParams, packed_values_hold, validate_packed_seq_params
from test_packed_support import make_layer, pack, random_segments

F64 = torch.float64
REPO_ROOT = Path(__file__).resolve().parents[1]


def case(id_: str, *values: Any) -> Any:
    return pytest.param(*values, id=id_)


# ================================================================== attention config
BAD_ATTENTION = [
    case("hidden_size-zero", dict(hidden_size=0), ValueError, "hidden_size must be a positive integer"),
    case("hidden_size-negative", dict(hidden_size=-8), ValueError, "hidden_size must be a positive integer"),
    case("hidden_size-float", dict(hidden_size=128.5), ValueError, "hidden_size must be an integer"),
    case("hidden_size-bool", dict(hidden_size=True), ValueError, "hidden_size must be an integer"),
    case("heads-zero", dict(num_attention_heads=0), ValueError, "num_attention_heads must be a positive integer"),
    case("heads-string", dict(num_attention_heads="4"), ValueError, "num_attention_heads must be an integer"),
    case("num_layers-zero", dict(num_layers=0), ValueError, "num_layers must be a positive integer"),
    case("q_lora_rank-zero", dict(q_lora_rank=0), ValueError, "q_lora_rank must be a positive integer"),
    case("v_head_dim-none", dict(v_head_dim=None), ValueError, "v_head_dim must be an integer"),
    case("rope-dim-odd", dict(qk_pos_emb_head_dim=7), ValueError, "qk_pos_emb_head_dim must be a positive even"),
    case("rope-dim-too-big", dict(qk_pos_emb_head_dim=32), ValueError, r"qk_pos_emb_head_dim \(32\) must be smaller"),
    case("o_groups-not-dividing", dict(o_groups=3), ValueError, r"o_groups \(3\) must divide"),
    case("hca-ratio-4", dict(hca_compress_ratio=4), ValueError, "hca_compress_ratio must be >= 8"),
    case("indexer-dim-not-pow2", dict(dsa_indexer_head_dim=24), ValueError, "dsa_indexer_head_dim must be a power of two"),
    case("rotary_percent-zero", dict(rotary_percent=0.0), ValueError, r"rotary_percent must be in \(0, 1\]"),
    case("rotary_percent-above-1", dict(rotary_percent=1.5), ValueError, r"rotary_percent must be in \(0, 1\]"),
    case("rope_type-unknown", dict(rope_type="alibi"), ValueError, "rope_type must be 'rope' or 'yarn'"),
    case("scaling-below-1", dict(rotary_scaling_factor=0.5), ValueError, "rotary_scaling_factor must be >= 1"),
    case("rotary_base-nan", dict(rotary_base=math.nan), ValueError, "rotary_base must be a finite number"),
    case("rotary_base-zero", dict(rotary_base=0.0), ValueError, "rotary_base must be > 0"),
    case("beta-order", dict(beta_fast=1.0, beta_slow=2.0), ValueError, r"beta_fast \(1.0\) must be greater than beta_slow"),
    case("loss-coeff-negative", dict(dsa_indexer_loss_coeff=-0.1), ValueError, "dsa_indexer_loss_coeff must be >= 0"),
    case("loss-coeff-inf", dict(dsa_indexer_loss_coeff=math.inf), ValueError, "dsa_indexer_loss_coeff must be a finite"),
    case("eps-zero", dict(layernorm_epsilon=0.0), ValueError, "layernorm_epsilon must be > 0"),
    case("eps-negative", dict(layernorm_epsilon=-1e-6), ValueError, "layernorm_epsilon must be > 0"),
    case("cp_comm_type", dict(cp_comm_type="ring"), ValueError, "cp_comm_type must be 'p2p' or 'all_gather'"),
    case("cp_partition", dict(cp_partition="striped"), ValueError, "cp_partition must be 'zigzag' or 'contiguous'"),
    case("cp_ring_key_rows-zero", dict(cp_ring_key_rows=0), ValueError, "cp_ring_key_rows must be a positive integer"),
    case("cp_ring_key_rows-float", dict(cp_ring_key_rows=1024.0), ValueError, "cp_ring_key_rows must be an integer"),
    case("bias", dict(add_bias_linear=True), ValueError, "add_bias_linear=True is not supported"),
    case("backend-empty", dict(attention_backend=""), ValueError, "attention_backend must be a non-empty string"),
    case("backend-int", dict(attention_backend=3), ValueError, "attention_backend must be a string"),
    case("overrides-list", dict(attention_backend_overrides=["triton"]), ValueError, "attention_backend_overrides must map"),
    case("pattern-empty", dict(layer_pattern=""), ValueError, "layer_pattern must be a non-empty string"),
    case("pattern-symbol", dict(layer_pattern="WXHC"), ValueError, "layer_pattern symbol 'X' at position 1"),
    case("pattern-length", dict(layer_pattern="WCH"), ValueError, "layer_pattern has 3 symbols but num_layers"),
    case("kv_lora_rank-zero", dict(kv_lora_rank=0), ValueError, "kv_lora_rank must be positive when given"),
    case("query-groups-not-dividing", dict(num_query_groups=3), ValueError, r"num_query_groups \(3\) must divide"),
    case("dense-mode-string", dict(csa_dense_mode="yes"), ValueError, "csa_dense_mode must be true or false"),
    case("qk_layernorm-int", dict(qk_layernorm=1), ValueError, "qk_layernorm must be true or false"),
    case("recompute-string", dict(recompute_attention="true"), ValueError, "recompute_attention must be true or false"),
    case("init-std-zero", dict(init_method_std=0.0), ValueError, "init_method_std must be > 0"),
    case("window-zero", dict(csa_window_size=0), ValueError, "csa_window_size must be a positive integer"),
    case("topk-zero", dict(dsa_indexer_topk=0), ValueError, "dsa_indexer_topk must be a positive integer"),
    case("unknown-field", dict(hidden=128), ValueError, r"unknown HybridAttentionConfig field\(s\): \['hidden'\]"),
]


@pytest.mark.parametrize("changes,error,words", BAD_ATTENTION)
def test_bad_attention_config(changes, error, words):
    with pytest.raises(error, match=words):
        HybridAttentionConfig.from_preset("tiny", **changes)


def test_indexer_dims_bind_only_where_an_indexer_is_built():
    """A pattern without an indexer (dense-MLA, or C in dense mode) need not mind the indexer's dims; a pattern
    with one is refused at the config, and a C layer built by kind from an M pattern at its indexer."""
    rope_wider_than_indexer = dict(num_layers=1, qk_head_dim=128, v_head_dim=128, qk_pos_emb_head_dim=64,
                                   dsa_indexer_head_dim=16)
    dense = HybridAttentionConfig.from_preset("tiny", layer_pattern="M", **rope_wider_than_indexer)
    HybridAttention(dense, kind="M")
    HybridAttention(dense.replace(layer_pattern="C", csa_dense_mode=True), kind="C")
    words = r"qk_pos_emb_head_dim \(64\) must not exceed dsa_indexer_head_dim \(16\)"
    with pytest.raises(ValueError, match=words):
        HybridAttentionConfig.from_preset("tiny", layer_pattern="C", **rope_wider_than_indexer)
    with pytest.raises(ValueError, match=words):
        HybridAttention(dense, kind="C")
    with pytest.raises(ValueError, match="dsa_indexer_head_dim must be a power of two"):
        HybridAttention(dense.replace(dsa_indexer_head_dim=24), kind="C")


BAD_CONFIG_CALLS = [
    case("unknown-preset", lambda: HybridAttentionConfig.from_preset("huge"), ValueError, "unknown preset 'huge'"),
    case("from_dict-list", lambda: HybridAttentionConfig.from_dict([1, 2]), TypeError, "needs a mapping"),
    case("layer_number-zero", lambda: HybridAttentionConfig.from_preset("tiny").layer_kind(0), ValueError,
         r"layer_number must be in \[1, 4\], got 0"),
    case("layer_number-past-end", lambda: HybridAttentionConfig.from_preset("tiny").layer_kind(5), ValueError,
         r"layer_number must be in \[1, 4\], got 5"),
    case("layer-needs-number-or-kind", lambda: HybridAttention(HybridAttentionConfig.from_preset("tiny")),
         ValueError, "give layer_number .* or kind"),
    case("layer-kind-conflict", lambda: HybridAttention(HybridAttentionConfig.from_preset("tiny"), layer_number=1,
                                                        kind="C"), ValueError, "kind 'C' conflicts with layer_pattern"),
    case("layer-kind-unknown", lambda: HybridAttention(HybridAttentionConfig.from_preset("tiny"), kind="Z"),
         ValueError, "Z"),
]


@pytest.mark.parametrize("call,error,words", BAD_CONFIG_CALLS)
def test_bad_config_calls(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ================================================================== job config (YAML sections)
def _tiny_job() -> dict:
    return yaml.safe_load((REPO_ROOT / "configs" / "tiny.yaml").read_text())


BAD_JOB = [
    case("steps-zero", ("train", "steps", 0), "train.steps must be an integer >= 1"),
    case("steps-string", ("train", "steps", "300"), "steps must be an integer, got '300'"),
    case("batch-zero", ("train", "batch_size", 0), "train.batch_size must be an integer >= 1"),
    case("seq_len-float", ("train", "seq_len", 64.0), "seq_len must be an integer, got 64.0"),
    case("lr-zero", ("train", "lr", 0.0), "train.lr must be > 0"),
    case("min_lr-above-lr", ("train", "min_lr", 1.0), r"train.min_lr <= train.lr"),
    case("lr-nan", ("train", "lr", math.nan), "lr must be a finite number"),
    case("grad_clip-negative", ("train", "grad_clip", -1.0), "train.grad_clip must be a number >= 0"),
    case("retrieval-fraction", ("train", "retrieval_fraction", 1.5), r"train.retrieval_fraction must be in \[0, 1\]"),
    case("beta1-above-1", ("train", "adam_beta1", 1.2), r"train.adam_beta1 must be in \[0, 1\]"),
    case("dtype", ("train", "dtype", "fp8"), "train.dtype must be one of"),
    case("device", ("train", "device", "tpu"), "train.device must be 'cpu', 'cuda' or 'cuda:N'"),
    case("pack-string", ("train", "pack", "yes"), "pack must be true or false"),
    case("unknown-train-field", ("train", "stepz", 3), "stepz"),
    case("model-ffn-zero", ("model", "ffn_hidden_size", 0), "model.ffn_hidden_size must be a positive integer"),
    case("model-tie-string", ("model", "tie_embeddings", "no"), "tie_embeddings must be true or false, got 'no'"),
    case("model-unknown", ("model", "layers", 3), "layers"),
    case("attention-heads", ("attention", "num_attention_heads", "four"), "num_attention_heads must be an integer"),
]


@pytest.mark.parametrize("change,words", BAD_JOB)
def test_bad_job_config(change, words):
    section, name, value = change
    job = _tiny_job()
    job[section] = {**(job.get(section) or {}), name: value}
    with pytest.raises(ValueError, match=words):
        train.JobConfig.from_dict(job)


BAD_JOB_SHAPES = [
    case("not-a-mapping", ["x"], TypeError, "job config is a mapping"),
    case("train-not-mapping", {"train": "fast"}, TypeError, "train: section must be a mapping"),
    case("attention-not-mapping", {"attention": [1]}, TypeError, "HybridAttentionConfig needs a mapping"),
    case("unknown-section", {"optimizer": {"lr": 1}}, ValueError, "optimizer"),
]


@pytest.mark.parametrize("values,error,words", BAD_JOB_SHAPES)
def test_bad_job_config_shape(values, error, words):
    with pytest.raises(error, match=words):
        train.JobConfig.from_dict(values)


# ================================================================== layer inputs
@pytest.fixture(scope="module")
def layers() -> dict[str, HybridAttention]:
    return {kind: make_layer(kind) for kind in "WCHM"}


def _hidden(seqlen: int, batch: int = 1, width: int = 128, dtype=F64) -> torch.Tensor:
    return torch.randn(seqlen, batch, width, dtype=dtype)


BAD_LAYER_INPUTS = [
    case("not-a-tensor", lambda: [[0.0] * 128], {}, TypeError, "hidden_states must be a torch.Tensor, got list"),
    case("2-d", lambda: torch.randn(8, 128, dtype=F64), {}, ValueError, r"hidden_states must be \[S, B, hidden_size=128\]"),
    case("4-d", lambda: torch.randn(8, 1, 1, 128, dtype=F64), {}, ValueError, r"must be \[S, B, hidden_size=128\]"),
    case("wrong-width", lambda: _hidden(8, width=64), {}, ValueError, r"hidden_size=128\], got \(8, 1, 64\)"),
    case("integer-dtype", lambda: torch.ones(8, 1, 128, dtype=torch.long), {}, TypeError, "floating-point tensor"),
    case("bool-dtype", lambda: torch.ones(8, 1, 128, dtype=torch.bool), {}, TypeError, "floating-point tensor"),
    case("dtype-mismatch", lambda: _hidden(8, dtype=torch.float32), {}, TypeError,
         "dtype torch.float32 differs from the layer's parameter dtype torch.float64"),
    case("empty-sequence", lambda: _hidden(0), {}, ValueError, "S >= 1 and B >= 1"),
    case("empty-batch", lambda: _hidden(8, batch=0), {}, ValueError, "S >= 1 and B >= 1"),
    case("mask-not-bool", lambda: _hidden(8), dict(attention_mask=torch.zeros(8, 8)), TypeError,
         "attention_mask must be a bool tensor"),
    case("mask-wrong-shape", lambda: _hidden(8), dict(attention_mask=torch.zeros(4, 4, dtype=torch.bool)),
         ValueError, r"attention_mask must be \[B=1 or 1, 1, S=8, S\]"),
    case("mask-not-causal", lambda: _hidden(8), dict(attention_mask=torch.zeros(8, 8, dtype=torch.bool)),
         ValueError, "attention_mask must be causal, or causal within documents"),
    case("mask-and-packed", lambda: _hidden(8), dict(attention_mask=torch.ones(8, 8, dtype=torch.bool).triu(1),
                                                     packed_seq_params=PackedSeqParams(
                                                         torch.tensor([0, 8], dtype=torch.int32))),
         ValueError, "give attention_mask or packed_seq_params, not both"),
    case("packed-batch-2", lambda: _hidden(8, batch=2), dict(packed_seq_params=PackedSeqParams(
        torch.tensor([0, 8], dtype=torch.int32))), ValueError, r"packed \(THD\) hidden_states must be \[T, 1, hidden\]"),
]


@pytest.mark.parametrize("kind", "WM")
@pytest.mark.parametrize("make,kwargs,error,words", BAD_LAYER_INPUTS)
def test_bad_layer_input(layers, kind, make, kwargs, error, words):
    with pytest.raises(error, match=words):
        layers[kind](make(), **kwargs)


# ================================================================== valid layer edge cases
def _forward(layer, hidden, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return layer(hidden, **kwargs)[0]


@pytest.mark.parametrize("kind", "WCHM")
@pytest.mark.parametrize("seqlen", [1, 7, 17], ids=["S1", "S7-below-ratio-8", "S17-not-divisible"])
def test_prefix_equals_the_longer_run(layers, kind, seqlen):
    """Causality: a sequence of `seqlen` tokens (S = 1, S below the compress ratio, S not divisible by
    the ratios) gives exactly the first `seqlen` rows of a 24-token run with the same prefix."""
    long = _hidden(24)
    torch.testing.assert_close(_forward(layers[kind], long[:seqlen]), _forward(layers[kind], long)[:seqlen],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", "WCHM")
def test_non_contiguous_input_equals_contiguous(layers, kind):
    """A transposed view `[S, B, d]` (batch-major storage) gives the same output as its copy."""
    batch_major = torch.randn(2, 12, 128, dtype=F64)
    view = batch_major.transpose(0, 1)
    assert not view.is_contiguous()
    torch.testing.assert_close(_forward(layers[kind], view), _forward(layers[kind], view.contiguous()),
                               rtol=0, atol=0)


@pytest.mark.parametrize("kind", "WCHM")
def test_batch_rows_equal_single_runs(layers, kind):
    hidden = _hidden(13, batch=3)
    together = _forward(layers[kind], hidden)
    for b in range(3):
        torch.testing.assert_close(together[:, b], _forward(layers[kind], hidden[:, b:b + 1])[:, 0],
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", "WCHM")
@pytest.mark.parametrize("lengths", [(5, 0, 9), (1, 1, 1), (0, 0, 6)], ids=["empty-middle", "single-tokens",
                                                                          "leading-empty"])
def test_packed_equals_separate_with_empty_segments(layers, kind, lengths):
    """Packed with empty segments and a NaN padding tail == each non-empty segment run alone."""
    segments = random_segments(lengths, 128)
    packed = pack(segments, pads=[1] * len(lengths), tail=2)
    out = _forward(layers[kind], packed.hidden, packed_seq_params=packed.params)
    for rows, segment in zip(packed.real, segments):
        if segment.shape[0]:
            torch.testing.assert_close(out[rows, 0], _forward(layers[kind], segment.unsqueeze(1))[:, 0],
                                       rtol=1e-10, atol=1e-12)
    assert torch.equal(out[packed.filler], torch.zeros_like(out[packed.filler]))


@pytest.mark.parametrize("kind", "WCHM")
def test_document_mask_equals_packed(layers, kind):
    """A document attention mask (causal within documents of 5 and 7 tokens) == the packed run."""
    hidden = _hidden(12)
    document = torch.tensor([0] * 5 + [1] * 7)
    position = torch.arange(12)
    mask = (position[None, :] > position[:, None]) | (document[:, None] != document[None, :])
    packed = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32), max_seqlen_q=7)
    torch.testing.assert_close(_forward(layers[kind], hidden, attention_mask=mask[None, None]),
                               _forward(layers[kind], hidden, packed_seq_params=packed), rtol=1e-12, atol=1e-12)


# ================================================================== packed metadata
def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _params(**fields) -> PackedSeqParams:
    fields.setdefault("cu_seqlens_q", _i32([0, 6, 6, 15]))
    return PackedSeqParams(**fields)


ROWS = 20
BAD_PACKED_VALUES = [
    case("q-not-starting-at-0", _params(cu_seqlens_q=_i32([2, 6, 15])), "cu_seqlens_q must start at 0, got 2"),
    case("q-decreasing", _params(cu_seqlens_q=_i32([0, 9, 6, 15])), "cu_seqlens_q must be non-decreasing"),
    case("q-past-rows", _params(cu_seqlens_q=_i32([0, 6, 21])), r"cu_seqlens_q\[-1\] = 21 exceeds .* T = 20"),
    case("q-negative-start", _params(cu_seqlens_q=_i32([-1, 6, 15])), "cu_seqlens_q must start at 0, got -1"),
    case("kv-differs", _params(cu_seqlens_kv=_i32([0, 6, 7, 15])), "cu_seqlens_kv must equal its cu_seqlens_q"),
    case("kv-shifted", _params(cu_seqlens_kv=_i32([1, 7, 7, 16])), "cu_seqlens_kv must start at 0"),
    case("kv-padded-without-q-padded", _params(cu_seqlens_kv_padded=_i32([0, 8, 9, 18])),
         "cu_seqlens_kv_padded must equal its cu_seqlens_q_padded counterpart"),
    case("kv-padded-differs", _params(cu_seqlens_q_padded=_i32([0, 8, 9, 18]),
                                      cu_seqlens_kv_padded=_i32([0, 8, 10, 18])),
         "cu_seqlens_kv_padded must equal"),
    case("padded-shorter", _params(cu_seqlens_q_padded=_i32([0, 8, 9, 17])),
         "segment 2 is shorter padded than unpadded"),
    case("padded-decreasing", _params(cu_seqlens_q_padded=_i32([0, 8, 7, 18])),
         "cu_seqlens_q_padded must be non-decreasing"),
    case("padded-past-rows", _params(cu_seqlens_q_padded=_i32([0, 8, 9, 25])),
         r"cu_seqlens_q_padded\[-1\] = 25 exceeds"),
    case("max_seqlen-too-small", _params(max_seqlen_q=8), r"max_seqlen_q \(8\) is smaller than the longest"),
    case("max_seqlen-too-small-padded", _params(cu_seqlens_q_padded=_i32([0, 8, 9, 18]), max_seqlen_q=8),
         r"max_seqlen_q \(8\) is smaller than the longest \(padded\) segment \(9\)"),
    case("max_seqlen-zero", _params(max_seqlen_q=0), r"max_seqlen_q \(0\) is smaller"),
]


@pytest.mark.parametrize("params,words", BAD_PACKED_VALUES)
def test_bad_packed_values_rejected_on_host_and_by_the_device_rule(params, words):
    """The host check names the rule; the device-side rule (what CUDA metadata is asserted with,
    without a sync) rejects the same input."""
    with pytest.raises(ValueError, match=words):
        validate_packed_seq_params(params, ROWS)
    assert not bool(packed_values_hold(params, ROWS))


GOOD_PACKED = [
    case("plain", _params()),
    case("with-padding", _params(cu_seqlens_q_padded=_i32([0, 8, 9, 18]), max_seqlen_q=9)),
    case("kv-equal-copies", _params(cu_seqlens_kv=_i32([0, 6, 6, 15]), max_seqlen_q=9)),
    case("kv-padded-equal", _params(cu_seqlens_q_padded=_i32([0, 8, 9, 18]),
                                    cu_seqlens_kv_padded=_i32([0, 8, 9, 18]))),
    case("all-empty", _params(cu_seqlens_q=_i32([0, 0, 0]))),
    case("fills-every-row", _params(cu_seqlens_q=_i32([0, 20]), max_seqlen_q=20)),
]


@pytest.mark.parametrize("params", GOOD_PACKED)
def test_good_packed_metadata_passes_both_checks(params):
    validate_packed_seq_params(params, ROWS)
    assert bool(packed_values_hold(params, ROWS))


BAD_PACKED_STRUCTURE = [
    case("int64", _params(cu_seqlens_q=torch.tensor([0, 6, 15])), TypeError, "cu_seqlens_q must be int32"),
    case("float", _params(cu_seqlens_q=torch.tensor([0.0, 6.0])), TypeError, "cu_seqlens_q must be int32"),
    case("list", _params(cu_seqlens_q=[0, 6, 15]), TypeError, "cu_seqlens_q must be a torch.Tensor, got list"),
    case("two-d", _params(cu_seqlens_q=_i32([[0, 6, 15]])), ValueError, "cu_seqlens_q must be 1-D"),
    case("one-entry", _params(cu_seqlens_q=_i32([0])), ValueError, r"nseg \+ 1 >= 2 entries"),
    case("kv-int64", _params(cu_seqlens_kv=torch.tensor([0, 6, 6, 15])), TypeError, "cu_seqlens_kv must be int32"),
    case("padded-fewer-entries", _params(cu_seqlens_q_padded=_i32([0, 8, 18])), ValueError,
         "cu_seqlens_q_padded has 3 entries but cu_seqlens_q has 4"),
    case("format-sbhd", _params(qkv_format="sbhd"), ValueError, "qkv_format must be 'thd'"),
    case("max_seqlen-float", _params(max_seqlen_q=9.0), TypeError, "max_seqlen_q must be a non-negative host int"),
    case("max_seqlen-tensor", _params(max_seqlen_q=torch.tensor(9)), TypeError, "max_seqlen_q must be a non-negative"),
    case("max_seqlen-negative", _params(max_seqlen_q=-1), TypeError, "max_seqlen_q must be a non-negative"),
    case("max_seqlen-bool", _params(max_seqlen_q=True), TypeError, "max_seqlen_q must be a non-negative"),
    case("max_seqlen_kv-float", _params(max_seqlen_kv=2.5), TypeError, "max_seqlen_kv must be a non-negative"),
]


@pytest.mark.parametrize("params,error,words", BAD_PACKED_STRUCTURE)
def test_bad_packed_structure(params, error, words):
    with pytest.raises(error, match=words):
        validate_packed_seq_params(params, ROWS)


@pytest.mark.parametrize("kind", "WM")
@pytest.mark.parametrize("params,words", BAD_PACKED_VALUES[:6])
def test_bad_packed_values_through_the_layer(layers, kind, params, words):
    with pytest.raises(ValueError, match=words):
        layers[kind](_hidden(ROWS), packed_seq_params=params)


def test_reading_device_values_back_runs_the_host_rules():
    """`read_device_values=True` on host tensors is the same check (the CUDA path copies first)."""
    with pytest.raises(ValueError, match="cu_seqlens_kv must equal"):
        validate_packed_seq_params(_params(cu_seqlens_kv=_i32([0, 5, 6, 15])), ROWS, read_device_values=True)


@pytest.mark.gpu
def test_cuda_packed_metadata_rejected_like_cpu():
    """On CUDA: `read_device_values=True` raises the CPU error for a differing cu_seqlens_kv; without it,
    a subprocess running the layer dies on the device-side assert (it used to train on silently)."""
    import subprocess
    import sys

    cuda = {name: _i32(v).cuda() for name, v in (("q", [0, 6, 6, 15]), ("kv", [0, 6, 7, 15]))}
    with pytest.raises(ValueError, match="cu_seqlens_kv must equal"):
        validate_packed_seq_params(PackedSeqParams(cu_seqlens_q=cuda["q"], cu_seqlens_kv=cuda["kv"],
                                                   max_seqlen_q=9), ROWS, read_device_values=True)
    script = ("import torch\nfrom megatron_dsa.packed_seq import PackedSeqParams, validate_packed_seq_params\n"
              "q = torch.tensor([0, 6, 6, 15], dtype=torch.int32, device='cuda')\n"
              "validate_packed_seq_params(PackedSeqParams(cu_seqlens_q=q, cu_seqlens_kv=q + 1, max_seqlen_q=9), 20)\n"
              "torch.cuda.synchronize()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "device-side assert" in done.stderr, done.stderr[-2000:]


# ================================================================== backends
BAD_BACKEND_CHOICES = [
    case("unknown-backend", dict(attention_backend="fastest"), ValueError, r"unknown backend\(s\) \['fastest'\]"),
    case("unknown-op", dict(attention_backend_overrides={"attention": "unfused"}), ValueError,
         r"attention_backend_overrides names unknown op families \['attention'\]"),
    case("unknown-override-backend", dict(attention_backend_overrides={"rope": "magic"}), ValueError,
         r"unknown backend\(s\) \['magic'\]"),
    case("flash_attn-on-cpu", dict(attention_backend_overrides={"dense_attention": "flash_attn"}),
         BackendUnavailableError, "backend 'flash_attn' cannot run dense_attention: .*"),
    case("cudnn-on-cpu", dict(attention_backend_overrides={"sparse_attention_bwd": "cudnn"}),
         BackendUnavailableError, "backend 'cudnn' cannot run sparse_attention_bwd: .*"),
    case("flashmla-on-cpu", dict(attention_backend_overrides={"sparse_attention_fwd": "flashmla"}),
         BackendUnavailableError, "backend 'flashmla' cannot run sparse_attention_fwd: .*"),
    case("triton-on-cpu", dict(attention_backend="triton"), BackendUnavailableError, "backend 'triton' cannot run"),
    case("unfused-lacks-nothing", dict(attention_backend_overrides={"topk": "flashmla"}), BackendUnavailableError,
         "backend 'flashmla' cannot run topk: no topk implementation"),
]


@pytest.mark.parametrize("changes,error,words", BAD_BACKEND_CHOICES)
def test_explicit_backend_that_cannot_run_is_named_at_construction(changes, error, words):
    config = HybridAttentionConfig.from_preset("tiny", **changes)
    with pytest.raises(error, match=words):
        HybridAttention(config, kind="C")


def test_cpu_torch_sdpa_declines_packed_layouts_with_its_reason():
    layer = make_layer("M", attention_backend_overrides={"dense_attention": "torch_sdpa"})
    packed = pack(random_segments([5, 7], 128))
    with pytest.raises(BackendUnavailableError, match="torch_sdpa.*packed/padded layouts unsupported"):
        layer(packed.hidden, packed_seq_params=packed.params)


def test_dispatch_of_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'nope' for rope; choose 'auto' or one of"):
        dispatch(OpFamily.ROPE, "nope", device=torch.device("cpu"), dtype=F64)


def test_reserved_backend_name():
    with pytest.raises(ValueError, match="'auto' is reserved"):
        registry.register_backend(registry.Backend(name="auto"))


# ================================================================== main-job checkpoints and CLI
def _tiny_model():
    job = train.JobConfig.from_dict(_tiny_job())
    model = train.build_model(job, torch.device("cpu"))
    return model, train.build_optimizer(model, job.train)


@pytest.mark.parametrize("layout", ["missing-directory", "empty-directory", "a-file"])
def test_loading_a_checkpoint_that_is_not_there(tmp_path, layout):
    path = tmp_path / "step_00000002"
    if layout == "empty-directory":
        path.mkdir()
    elif layout == "a-file":
        path.write_text("not a checkpoint")
    model, optimizer = _tiny_model()
    with pytest.raises(FileNotFoundError, match=f"no complete checkpoint at {path}"):
        load_checkpoint(path, model, optimizer, None)


def test_latest_checkpoint_of_an_empty_run_is_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def _write_job(tmp_path: Path, **train_fields) -> Path:
    job = _tiny_job()
    job["train"].update(train_fields)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


BAD_TRAIN_CLI = [
    case("resume-without-checkpoint", ["--resume"], "--resume: no checkpoint in"),
    case("tp-without-torchrun", ["--tp", "2"], "--tp 2 --cp 1 needs 2 processes: launch with torchrun"),
    case("cp-without-torchrun", ["--cp", "2"], "--tp 1 --cp 2 needs 2 processes"),
    case("missing-config", ["--config", "does-not-exist.yaml"], "does-not-exist.yaml"),
]


@pytest.mark.parametrize("args,words", BAD_TRAIN_CLI)
def test_bad_train_cli(tmp_path, capsys, args, words):
    job = _write_job(tmp_path, steps=1, out_dir=str(tmp_path / "run"))
    argv = (["--config", str(job)] if "--config" not in args else []) + args
    with pytest.raises(SystemExit) as stopped:
        train.main(argv)
    assert stopped.value.code not in (0, None)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in last and words in last, last


# ================================================================== converter CLI
@pytest.fixture(scope="module")
def attention_yaml() -> Path:
    return REPO_ROOT / "configs" / "tiny.yaml"


def _state_file(tmp_path: Path, name: str = "in.pt") -> Path:
    path = tmp_path / name
    torch.save({"decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(2, 2)}, path)
    return path


BAD_CONVERT = [
    case("one-path", lambda t, cfg: ["ours-to-megatron", str(_state_file(t)), "--config", str(cfg)],
         "give at least one input file and the output file"),
    case("merge-one-shard", lambda t, cfg: ["tp-merge", str(_state_file(t)), str(t / "o.pt"), "--config", str(cfg)],
         "tp-merge takes two or more shards"),
    case("split-without-tp", lambda t, cfg: ["tp-split", str(_state_file(t)), str(t / "o.pt"), "--config", str(cfg)],
         "tp-split takes one TP = 1 file and --tp N with N >= 2"),
    case("same-in-out", lambda t, cfg: ["ours-to-megatron", str(_state_file(t)), str(t / "in.pt"), "--config", str(cfg)],
         "in.pt"),
    case("output-exists", lambda t, cfg: ["ours-to-megatron", str(_state_file(t)), str(_state_file(t, "out.pt")),
                                          "--config", str(cfg)], "--force"),
    case("missing-input", lambda t, cfg: ["ours-to-megatron", str(t / "nothing.pt"), str(t / "o.pt"), "--config", str(cfg)],
         "nothing.pt"),
    case("config-unknown-field", lambda t, cfg: ["ours-to-megatron", str(_state_file(t)), str(t / "o.pt"), "--config",
                                                 str(_yaml(t, {"attention": {"preset": "tiny"}}))],
         "unknown HybridAttentionConfig field(s): ['preset']"),
    case("config-a-number", lambda t, cfg: ["ours-to-megatron", str(_state_file(t)), str(t / "o.pt"), "--config",
                                            str(_yaml(t, 3))], "needs a mapping"),
    case("config-missing", lambda t, cfg: ["ours-to-megatron", str(_state_file(t)), str(t / "o.pt"), "--config",
                                           str(t / "none.yaml")], "none.yaml"),
    case("corrupt-input", lambda t, cfg: ["ours-to-megatron", str(_corrupt(t)), str(t / "o.pt"), "--config", str(cfg)],
         "corrupt.pt"),
]


def _yaml(tmp_path: Path, values: Any) -> Path:
    path = tmp_path / "attention.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _corrupt(tmp_path: Path) -> Path:
    path = tmp_path / "corrupt.pt"
    path.write_bytes(b"\x00garbage" * 10)
    return path


@pytest.mark.parametrize("make_args,words", BAD_CONVERT)
def test_bad_convert_cli(tmp_path, attention_yaml, capsys, make_args, words):
    from megatron_dsa import convert
    with pytest.raises(SystemExit) as stopped:
        convert.main(make_args(tmp_path, attention_yaml))
    code = stopped.value.code
    message = code if isinstance(code, str) else capsys.readouterr().err
    assert code not in (0, None) and "error" in message and words in message, message


# ================================================================== distributed runs (gloo)
PARALLEL_SIZES_THAT_DO_NOT_FIT = [  # (tp, cp, words) on a world of 2 ranks
    (3, 1, r"world size 2 must be divisible by tp_size × cp_size = 3 × 1"),
    (2, 2, r"world size 2 must be divisible by tp_size × cp_size = 2 × 2"),
    (0, 1, r"world size 2 must be divisible by tp_size × cp_size = 0 × 1"),
]


def _parallel_sizes_body(rank: int, world: int) -> None:
    from megatron_dsa.parallel import initialize_parallel_state
    for tp, cp, words in PARALLEL_SIZES_THAT_DO_NOT_FIT:
        with pytest.raises(ValueError, match=words):
            initialize_parallel_state(tp_size=tp, cp_size=cp)


def test_parallel_sizes_that_do_not_fit_the_world():
    """Three cases on one 2-rank gloo group (spawning ranks costs seconds): each raises on every rank,
    and no rank is left waiting in a group creation."""
    from distributed import run_distributed
    run_distributed(_parallel_sizes_body, 2, timeout_s=60)


def test_parallel_state_without_a_process_group():
    from megatron_dsa.parallel import initialize_parallel_state
    with pytest.raises(RuntimeError, match="needs torch.distributed.init_process_group first"):
        initialize_parallel_state(tp_size=2)
