"""Vendor-kernel adapters on CPU: the dispatcher's choices with monkeypatched packages and GPU
generations, and the layout glue of each adapter (head padding with −inf sinks, −1 index padding to
the kernel's tile, int32 global ids, LSE base and orientation, slicing back) run against fake vendor
modules that implement the vendor contracts with the reference math (`vendor_fakes.py`).

Tolerances: fp64 glue tests compare with the reference at 1e-10 (same math, only the layout differs);
bf16 end-to-end tests at cosine > 0.999 / relative error < 2e-2 (bf16 rounding of the inputs the
padded kernels see is the only difference)."""

from __future__ import annotations

import logging
import math
import types
from collections import Counter

import pytest
import torch

import megatron_dsa.backends.cudnn as cudnn_backend
import megatron_dsa.backends.flash_attn as flash_attn_backend
import megatron_dsa.backends.flashmla as flashmla_backend
import megatron_dsa.backends.sparse_layout as sparse_layout
import megatron_dsa.backends.triton_kernels.availability as triton_availability
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import (
    BackendUnavailableError,
    OpFamily,
    call_counts,
    probes,
    registry,
    reset_call_counts,
    resolve,
    variant_counts,
)
from megatron_dsa.backends.dispatched_sparse_attention import sparse_attention
from megatron_dsa.ops.dense_attention import block_attention_backward, block_attention_forward, causal_attention
from megatron_dsa.ops.indexer import indexer_scores as reference_indexer_scores
from megatron_dsa.backends.triton_kernels.indexer_loss import kl_per_row as triton_kl_per_row
from megatron_dsa.ops.indexer_loss import indexer_kl as reference_indexer_kl
from megatron_dsa.ops.indexer_loss import indexer_kl_backward as reference_indexer_kl_backward
from megatron_dsa.ops.indexer_loss import kl_per_row as reference_kl_per_row
from megatron_dsa.ops.indices import topk_columns, visible_compressed_entries
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.sparse_attention import sparse_attention as reference_sparse_attention
from megatron_dsa.ops.sparse_attention import sparse_attention_backward, sparse_attention_forward
from distributed import cosine, relative_error
from live_memory import LiveBytes
from vendor_fakes import (FakeCudnnDSA, FakeFlashMLA, fake_cudnn, fake_flash_attn_2, fake_flash_attn_cute,
                          fake_flash_attn_cute_interface, fake_sparse_inputs, install)

LOGGER = "megatron_dsa.backends"
EXACT = dict(rtol=1e-10, atol=1e-10)


def clear_probe_caches() -> None:
    """Forget what the probes found and the choices made from it (after installing or faking a package)."""
    registry.forget_choices()
    probes.import_problem.cache_clear()
    cudnn_backend.package_problem.cache_clear()
    cudnn_backend.wrapper_problem.cache_clear()
    flashmla_backend.package_problem.cache_clear()
    flashmla_backend._lse_is_base2.cache_clear()
    probes.forget_self_tests()
    triton_availability._package_problem.cache_clear()


@pytest.fixture
def vendors(monkeypatch: pytest.MonkeyPatch):
    """Fresh registry state and probe caches; no vendor package importable unless a test installs one."""
    monkeypatch.setattr(registry, "_LOGGED_CHOICES", set())
    monkeypatch.setattr(registry, "_CALL_COUNTS", Counter())
    monkeypatch.setattr(registry, "_VARIANT_COUNTS", Counter())
    for name in ("cudnn", "flash_mla", "flash_attn", "flash_attn.cute", "flash_attn.cute.interface",
                 "flash_attn.flash_attn_interface", "flash_attn_interface", "triton"):
        install(monkeypatch, name, None)
    clear_probe_caches()
    yield monkeypatch
    clear_probe_caches()


def on_gpu_generation(monkeypatch: pytest.MonkeyPatch, capability) -> None:
    monkeypatch.setattr(probes, "cuda_capability", lambda device: capability)


def with_cudnn(monkeypatch: pytest.MonkeyPatch, alignment: int = 128) -> FakeCudnnDSA:
    dsa = FakeCudnnDSA(alignment)
    install(monkeypatch, "cudnn", fake_cudnn(dsa))
    clear_probe_caches()
    return dsa


# ---------------------------------------------------------------- dispatcher
def test_auto_falls_back_without_packages_and_logs_once_per_choice(vendors, caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(3):
        assert resolve(OpFamily.TOPK, dtype=torch.float32, topk=8)[0] == "unfused"
        assert resolve(OpFamily.SPARSE_ATTENTION_FWD, dtype=torch.bfloat16)[0] == "unfused"
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2  # one per distinct (op, choice, reasons)
    topk_line = next(line for line in lines if "topk" in line)
    assert "'unfused'" in topk_line and "package cudnn not importable" in topk_line
    assert "flash_mla" in next(line for line in lines if "sparse_attention_fwd" in line)


def test_explicit_backend_without_its_package_fails_at_layer_construction(vendors) -> None:
    config = HybridAttentionConfig.from_preset("tiny", attention_backend_overrides={"topk": "cudnn"})
    with pytest.raises(BackendUnavailableError, match=r"'cudnn' cannot run topk: package cudnn not "
                                                      r"importable.*\[cudnn\] extra"):
        HybridAttention(config, kind="C")


def test_unknown_names_in_the_backend_choice_raise_naming_them(vendors) -> None:
    with pytest.raises(ValueError, match=r"unknown op families \['topkk'\]"):
        HybridAttention(HybridAttentionConfig.from_preset(
            "tiny", attention_backend_overrides={"topkk": "unfused"}), kind="C")
    with pytest.raises(ValueError, match=r"unknown backend\(s\) \['nope'\]"):
        HybridAttention(HybridAttentionConfig.from_preset(
            "tiny", attention_backend_overrides={"topk": "nope"}), kind="C")
    with pytest.raises(ValueError, match="attention_backend_overrides must map"):
        HybridAttentionConfig.from_preset("tiny", attention_backend_overrides={"topk": 3})


def test_per_op_overrides_round_trip_through_yaml_and_pick_per_op(vendors, tmp_path) -> None:
    config = HybridAttentionConfig.from_preset(
        "tiny", attention_backend_overrides={"sparse_attention_bwd": "unfused", "topk": "auto"})
    config.to_yaml(tmp_path / "c.yaml")
    loaded = HybridAttentionConfig.from_yaml(tmp_path / "c.yaml")
    assert loaded.attention_backend_overrides == config.attention_backend_overrides
    assert loaded.backend_for("sparse_attention_bwd") == "unfused"
    assert loaded.backend_for("rope") == "auto"


@pytest.mark.parametrize("capability, call, expected", [
    ((8, 0), {}, "needs SM9x/SM10x, this GPU is SM80"),
    ((9, 0), dict(lse_grad=True), "no lse-gradient input"),
    ((9, 0), dict(dtype=torch.float32), "dtype torch.float32 unsupported"),
    ((9, 0), dict(head_dim=576), "head dim 576 unsupported"),
    ((10, 0), dict(heads=256), "256 local heads unsupported"),
    ((9, 0), dict(heads=8, head_dim=512, dtype=torch.bfloat16, topk=200), None),
    ((10, 0), dict(heads=128, head_dim=512, dtype=torch.float16), None),
])
def test_cudnn_sparse_backward_probe_table(vendors, capability, call, expected) -> None:
    with_cudnn(vendors)
    on_gpu_generation(vendors, capability)
    reason = cudnn_backend.CUDNN.decline_reason(OpFamily.SPARSE_ATTENTION_BWD, call)
    assert reason is None if expected is None else expected in reason


def test_cudnn_topk_declines_k_above_2048_and_float64(vendors) -> None:
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    assert "2049" in cudnn_backend.CUDNN.decline_reason(OpFamily.TOPK, dict(topk=2049))
    assert "float64" in cudnn_backend.CUDNN.decline_reason(OpFamily.TOPK, dict(dtype=torch.float64))
    assert cudnn_backend.CUDNN.decline_reason(OpFamily.TOPK, dict(topk=2048, dtype=torch.float32)) is None


def test_cudnn_older_than_1_32_is_declined(vendors) -> None:
    module = fake_cudnn(FakeCudnnDSA())
    module.__version__ = "1.23.0"
    install(vendors, "cudnn", module)
    clear_probe_caches()
    assert "older than 1.32" in cudnn_backend.package_problem()


# ---------------------------------------------------------------- sparse glue (fp64, exact)
@pytest.mark.parametrize("heads, width", [(3, 5), (64, 128), (70, 130)])
def test_cudnn_sparse_backward_glue_matches_the_reference(vendors, heads, width) -> None:
    dsa = with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    query, kv, indices, sink = fake_sparse_inputs(6, heads, 16, 11, width, torch.float64, seed=heads)
    out, lse = sparse_attention_forward(query, kv, indices, sink, 0.37)
    grad_out = torch.randn_like(out)
    # The kernel takes a float32 lse: the reference gets the same rounded lse, so only layout differs.
    expected = sparse_attention_backward(query, kv, indices, sink, 0.37, out, lse.float().double(),
                                         grad_out, None)
    got = cudnn_backend.sparse_attention_backward(query, kv, indices, sink, 0.37, out, lse, grad_out, None)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **EXACT)
    seen = dsa.calls[-1][1]
    padded = 64 if heads <= 64 else 128
    assert seen["q"].shape[1] == padded and seen["ids"].shape[1] == -(-width // 128) * 128
    assert torch.isneginf(seen["sink"][heads:]).all() and seen["scale"] == 0.37  # raw scale, once
    assert seen["ids"].dtype == torch.int32 and (seen["ids"][:, width:] == -1).all()
    assert (seen["ids"][0, 0] == -1) and (seen["ids"][1] == -1).all()  # id ≥ M and the empty row


def test_cudnn_sparse_backward_pads_indices_to_64_on_sm100(vendors) -> None:
    dsa = with_cudnn(vendors, alignment=64)
    on_gpu_generation(vendors, (10, 0))
    query, kv, indices, sink = fake_sparse_inputs(4, 2, 8, 9, 70, torch.float64, seed=3)
    out, lse = sparse_attention_forward(query, kv, indices, sink.double(), 0.5)
    cudnn_backend.sparse_attention_backward(query, kv, indices, sink.double(), 0.5, out, lse,
                                            torch.ones_like(out), None)
    assert dsa.calls[-1][1]["ids"].shape[1] == 128


@pytest.mark.parametrize("lse_base2", [False, True])
@pytest.mark.parametrize("heads, width", [(3, 5), (128, 256)])
def test_flashmla_forward_glue_matches_the_reference(vendors, lse_base2, heads, width) -> None:
    fake = FakeFlashMLA(lse_base2)
    install(vendors, "flash_mla", fake)
    clear_probe_caches()
    query, kv, indices, sink = fake_sparse_inputs(5, heads, 512, 9, width, torch.float64, seed=width)
    out, lse = flashmla_backend.sparse_attention_forward(query, kv, indices, sink, 0.05)
    out_ref, lse_ref = sparse_attention_forward(query, kv, indices, sink, 0.05)
    torch.testing.assert_close(out, out_ref, **EXACT)
    torch.testing.assert_close(lse, lse_ref.float(), rtol=1e-6, atol=1e-6)  # lse in float32
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()  # empty row: −inf, not FlashMLA's +inf
    seen = fake.calls[0]  # calls[1] is the one-off LSE-base calibration
    assert seen["q"].shape[1] == (64 if heads <= 64 else 128) and seen["ids"].shape[-1] % 128 == 0
    assert torch.isneginf(seen["sink"][heads:]).all() and seen["scale"] == 0.05


# ---------------------------------------------------------------- padded heads in row chunks
def rows_per_padded_chunk(monkeypatch: pytest.MonkeyPatch, rows: int, head_dim: int) -> None:
    """Let the glue pad `rows` rows (of 64 padded heads) at a time."""
    monkeypatch.setattr(sparse_layout, "PADDED_CHUNK_ELEMENTS", rows * 64 * head_dim)


def test_padded_heads_run_in_row_chunks_with_the_reference_results(vendors) -> None:
    """32 heads (a TP-2 rank's share of 64): FlashMLA's forward and cuDNN's backward pad 4 rows at a time
    (chunks of 4, 4, 3 rows), and give the reference results; the dkv and sink gradients are summed over
    the chunks."""
    fake, dsa = FakeFlashMLA(), with_cudnn(vendors)
    install(vendors, "flash_mla", fake)
    clear_probe_caches()
    on_gpu_generation(vendors, (9, 0))
    rows_per_padded_chunk(vendors, 4, 512)
    query, kv, indices, sink = fake_sparse_inputs(11, 32, 512, 9, 130, torch.float64, seed=5)
    out, lse = flashmla_backend.sparse_attention_forward(query, kv, indices, sink, 0.05)
    out_ref, lse_ref = sparse_attention_forward(query, kv, indices, sink, 0.05)
    torch.testing.assert_close(out, out_ref, **EXACT)
    torch.testing.assert_close(lse, lse_ref.float(), rtol=1e-6, atol=1e-6)
    grad_out = torch.randn_like(out)
    expected = sparse_attention_backward(query, kv, indices, sink, 0.05, out, lse.double(), grad_out, None)
    got = cudnn_backend.sparse_attention_backward(query, kv, indices, sink, 0.05, out, lse, grad_out, None)
    for a, b in zip(got[:2], expected[:2]):
        torch.testing.assert_close(a, b, **EXACT)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-6, atol=1e-6)  # float32 sink: summed per chunk
    forward_rows = [call["q"].shape[0] for call in fake.calls if call["q"].shape[0] != 1]  # not the calibration
    assert forward_rows == [4, 4, 3] and all(call["q"].shape[1] == 64 for call in fake.calls)
    assert [call[1]["q"].shape[:2] for call in dsa.calls] == [(4, 64), (4, 64), (3, 64)]


def test_cudnn_sm100_forward_pads_heads_in_row_chunks(vendors) -> None:
    """The SM100 forward glue (bf16, D = 512): chunks of 4 rows give the one-call result."""
    dsa = with_cudnn(vendors)
    query, kv, indices, sink = fake_sparse_inputs(10, 32, 512, 9, 70, torch.bfloat16, seed=6)
    whole = cudnn_backend.sparse_attention_forward(query, kv, indices, sink, 0.09)
    rows_per_padded_chunk(vendors, 4, 512)
    chunked = cudnn_backend.sparse_attention_forward(query, kv, indices, sink, 0.09)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b)
    assert [call[1]["q"].shape[:2] for call in dsa.calls[1:]] == [(4, 64), (4, 64), (2, 64)]


class ZeroSparseKernels(types.ModuleType):
    """FlashMLA's sparse forward and cuDNN's sparse backward returning zeros of their outputs' shapes:
    measuring the glue around them measures what the glue allocates."""

    def __init__(self) -> None:
        super().__init__("flash_mla")
        self.DSA = self

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        assert q.shape[1] % 64 == 0
        stats = q.new_zeros(q.shape[:2], dtype=torch.float32)
        return q.new_zeros((*q.shape[:2], d_v)), stats, stats

    def sparse_attention_backward_wrapper(self, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None):
        assert q.shape[1] % 64 == 0
        return {"dq": torch.zeros_like(q), "dkv": torch.zeros_like(kv, dtype=torch.float32),
                "d_sink": torch.zeros_like(attn_sink)}


def padded_glue_memory(heads: int) -> tuple[int, int]:
    """Peak bytes the FlashMLA forward glue and the cuDNN backward glue allocate for 256 bf16 rows of
    `heads` heads (D = 128, 64 indices per row; the inputs and output gradient made before)."""
    rows, head_dim = 256, 128
    query, kv, indices, sink = fake_sparse_inputs(rows, heads, head_dim, 80, 64, torch.bfloat16, seed=heads)
    out, lse = torch.zeros_like(query), torch.zeros(rows, heads)
    grad_out = torch.randn_like(query)
    with LiveBytes(query, kv, indices, sink) as forward:
        flashmla_backend.sparse_attention_forward(query, kv, indices, sink, 0.1)
    with LiveBytes(query, kv, indices, sink, out, lse, grad_out) as backward:
        cudnn_backend.sparse_attention_backward(query, kv, indices, sink, 0.1, out, lse, grad_out, None)
    return forward.peak, backward.peak


def test_padded_heads_cost_no_full_size_copies(vendors) -> None:
    """A TP-2 rank's 32 heads of 64: the forward and backward glue allocate at most 0.75 of what 64 heads
    need (measured 0.58 / 0.66 with 8-row chunks; their own output is half, the chunk copies and the
    ids add the rest). Padding every row at once made it 1.95 / 3.83 (padded copies of q, out and dO and a
    padded dq twice the rank's own tensors): splitting the heads saved no memory on the GPU."""
    kernels = ZeroSparseKernels()
    install(vendors, "flash_mla", kernels)
    install(vendors, "cudnn", kernels)
    clear_probe_caches()
    rows_per_padded_chunk(vendors, 8, 128)
    full_forward, full_backward = padded_glue_memory(64)
    split_forward, split_backward = padded_glue_memory(32)
    assert split_forward <= 0.75 * full_forward, f"forward {split_forward / full_forward:.2f} of 64 heads'"
    assert split_backward <= 0.75 * full_backward, f"backward {split_backward / full_backward:.2f} of 64 heads'"


def test_cudnn_topk_matches_topk_columns_exactly(vendors) -> None:
    dsa = with_cudnn(vendors)
    scores = torch.randint(0, 4, (7, 13)).float()  # many ties
    valid = torch.rand(7, 13) < 0.7
    valid[2] = False  # no candidate
    valid[3, 5:] = False  # fewer candidates than k
    valid[4, :] = True
    for k in (1, 6, 13, 20):
        got = cudnn_backend.topk(scores, valid, k)
        assert torch.equal(got, topk_columns(scores, valid, k)), k
        assert got.dtype == torch.long
    values, seq_lens = dsa.calls[-1][1]["values"], dsa.calls[-1][1]["seq_lens"]
    assert values.shape[1] == 16 and torch.isneginf(values[:, 13:]).all()  # 32-byte rows
    assert seq_lens[2] == 0 and seq_lens[3] <= 5


def test_cudnn_topk_with_prefix_counts_scans_only_the_prefixes(vendors) -> None:
    """With the `counts` hint (a decode step's: `valid[t]` is the prefix `[0, counts[t])`) the kernel gets the
    counts as its scan lengths and the scores unmasked (finite garbage past a prefix must not matter); the result
    is still `topk_columns`'s."""
    dsa = with_cudnn(vendors)
    scores = torch.randint(0, 4, (5, 24)).float()  # ties
    counts = torch.tensor([0, 1, 7, 23, 24])
    valid = torch.arange(24) < counts.unsqueeze(1)
    for k in (1, 6, 24, 30):
        got = cudnn_backend.topk(scores, valid, k, None, counts)
        assert torch.equal(got, topk_columns(scores, valid, k)), k
        call = dsa.calls[-1][1]
        assert torch.equal(call["seq_lens"], counts.int()) and torch.equal(call["values"][:, :24], scores)


def test_cudnn_topk_unordered_with_counts_returns_the_kernels_picks(vendors) -> None:
    """`ordered=False` with the counts hint (a decode step): the kernel's picks as it returns them (in its own
    order, as int64), no ordering pass; as a set, `topk_columns`'s."""
    dsa = with_cudnn(vendors)
    vendors.setattr(cudnn_backend, "order_picks", lambda *args: pytest.fail("an unordered top-k sorted its picks"))
    vendors.setattr(cudnn_backend, "_in_reference_order", lambda *args: pytest.fail("an unordered top-k sorted"))
    scores = torch.randn(5, 24)
    counts = torch.tensor([0, 1, 7, 23, 24])
    valid = torch.arange(24) < counts.unsqueeze(1)
    for k in (1, 6, 24):
        got = cudnn_backend.topk(scores, valid, k, None, counts, ordered=False)
        call = dsa.calls[-1][1]
        assert got.dtype == torch.long and torch.equal(got, dsa.last_topk.long())
        assert torch.equal(pick_set(got, counts), pick_set(topk_columns(scores, valid, k), counts)), k
        assert torch.equal(call["seq_lens"], counts.int())


def pick_set(picks: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Top-k picks as a set per row: the picks inside the row's valid prefix `[0, counts[t])`, highest first, −1
    after them (an unordered top-k's slots without a pick may hold −1 or a column past the prefix)."""
    inside = (picks >= 0) & (picks < counts.unsqueeze(1))
    return torch.where(inside, picks, -1).sort(dim=1, descending=True).values


@torch.no_grad()
def test_c_decode_steps_hand_cudnn_topk_their_entry_counts(vendors) -> None:
    """A C layer's decode steps with top-k on the (fake) cuDNN kernel: each step's scan lengths are the new
    tokens' visible entry counts `(p + 1) // r` (the decode hint, not lengths rebuilt from the mask), and the
    outputs are those of the same steps on the unfused top-k."""
    from megatron_dsa.layers.decoding import LayerCache

    dsa = with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    hints = []
    kernel = registry.backend_op("cudnn", OpFamily.TOPK)
    vendors.setitem(registry.backend_named("cudnn").ops, OpFamily.TOPK,
                    lambda scores, valid, k, visible=None, counts=None, ordered=True:
                    hints.append(counts) or kernel(scores, valid, k, visible, counts, ordered))
    config = HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern="C", dsa_indexer_topk=3)
    torch.manual_seed(0)
    fused = HybridAttention(config.replace(attention_backend_overrides={"topk": "cudnn"}), kind="C").eval()
    reference = HybridAttention(config.replace(attention_backend="unfused"), kind="C").eval()
    reference.load_state_dict(fused.state_dict())
    hidden = torch.randn(20, 2, config.hidden_size)
    outputs = []
    for layer in (fused, reference):
        cache = LayerCache.for_layer(layer, 2, 20)
        layer(hidden[:9], inference_cache=cache)
        outputs.append(torch.cat([layer(hidden[p:p + 1], inference_cache=cache)[0] for p in range(9, 20)]))
    ratio = fused.core_attention.indexer.compressor.ratio
    steps = [call for name, call in dsa.calls if name == "topk"]
    assert [call["seq_lens"].tolist() for call in steps[-11:]] == [[(p + 1) // ratio] * 2 for p in range(9, 20)]
    assert [None if h is None else h.tolist() for h in hints[-11:]] == [[(p + 1) // ratio] * 2 for p in range(9, 20)]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [slice(0, 26), slice(5, 20), slice(14, 15)])
def test_cudnn_topk_with_the_uniform_structure_scans_only_visible_prefixes(vendors, chunk) -> None:
    """With the `visible` hint the kernel gets each row's visible count as its scan length and the scores
    unmasked (finite garbage past the prefix must not matter); the result is still `topk_columns`'s.
    The counts are built once per row structure and reused."""
    dsa = with_cudnn(vendors)
    _, _, _, entries = uniform_indexer_problem(batch=2, seqlen=13)
    candidates, visible = entries.rows(chunk), entries.uniform_rows(chunk)
    valid = candidates >= 0
    scores = torch.randint(0, 3, candidates.shape).float()  # ties; invalid columns hold finite values too
    for k in (1, 2, 3, 5):
        got = cudnn_backend.topk(scores, valid, k, visible)
        assert torch.equal(got, topk_columns(scores, valid, k)), k
    calls = [call for name, call in dsa.calls if name == "topk"]
    assert torch.equal(calls[-1]["seq_lens"], valid.sum(1).int())
    assert calls[0]["seq_lens"] is calls[-1]["seq_lens"]  # kept, not rebuilt
    with pytest.raises(ValueError, match="visible rows"):
        cudnn_backend.topk(scores[:, :2], valid[:, :2], 2, visible)


def indexer_kl_problem(rows: int, heads: int, width: int, keys: int = 9):
    """bf16 indexer inputs (DI = 128), candidates with −1 slots and an empty row, a teacher target, the
    reference student scores, and non-negative row weights with a zero (padding) row."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(rows, heads, 128, generator=gen).bfloat16()
    k = torch.randn(keys, 128, generator=gen).bfloat16()
    weights = torch.randn(rows, heads, generator=gen).bfloat16()
    candidates = torch.randint(0, keys, (rows, width), generator=gen)
    candidates[:, -2:] = -1
    candidates[2] = -1
    mass = torch.rand(rows, width, generator=gen) * (candidates >= 0)
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    student = reference_indexer_scores(q, k, weights, candidates, 0.09)
    grad_rows = torch.rand(rows, generator=gen) * 1e-3
    grad_rows[5] = 0.0
    return q, k, weights, candidates, target, student, grad_rows


def test_cudnn_indexer_kl_backward_matches_the_reference(vendors) -> None:
    """Row weights through the target, 128-wide slots, 64 heads, row chunks: the same gradients as the
    reference `indexer_kl_bwd` (both in float32 from the same bf16 inputs, outputs rounded to bf16)."""
    dsa = with_cudnn(vendors)
    vendors.setattr(cudnn_backend, "INDEXER_ROW_CHUNK", 5)
    problem = indexer_kl_problem(rows=11, heads=4, width=6)
    got = cudnn_backend.indexer_kl_backward(*problem, 0.09)
    expected = reference_indexer_kl_backward(*problem, 0.09)
    for name, a, b in zip(("dq", "dk", "dweights"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert relative_error(a.float(), b.float()) <= 1e-2, name  # bf16 rounding of equal float32 sums
    calls = [call for kind, call in dsa.calls if kind == "indexer_bwd"]
    assert [call["q"].shape[1] for call in calls] == [5, 5, 1]  # row chunks
    assert all(call["q"].shape[2] == 64 and call["ids"].shape[-1] == 128 for call in calls)
    assert [float(call["grad_loss"]) for call in calls] == [5.0, 5.0, 1.0]  # undoes the kernel's mean
    first = calls[0]
    assert (first["ids"][0, :, 4:] == -1).all() and (first["target"][0, :, 4:] == 0).all()
    assert (first["target"][0, 2] == 0).all()  # the row without candidates


def test_cudnn_indexer_kl_backward_declines_what_it_cannot_run(vendors) -> None:
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    call = dict(device=torch.device("cuda"), dtype=torch.bfloat16, heads=64, head_dim=128, topk=512, dense=False)
    assert cudnn_backend.probe(OpFamily.INDEXER_KL_BWD, call) is None
    for change, reason in ((dict(dense=True), "dense"), (dict(dtype=torch.float32), "float32"),
                           (dict(head_dim=64), "head dim"), (dict(heads=128), "heads"),
                           (dict(topk=4096), "top-k")):
        problem = cudnn_backend.probe(OpFamily.INDEXER_KL_BWD, {**call, **change})
        assert problem is not None and reason in problem, (change, problem)


def uniform_indexer_problem(batch: int, seqlen: int, ratio: int = 4, heads: int = 64):
    """bf16 indexer queries, keys and weights of a uniform batch, and its visible entries."""
    layout = TokenLayout.uniform(batch, seqlen, torch.device("cpu"))
    compressed = layout.compressed(ratio)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(layout.num_rows, heads, 128, generator=gen).bfloat16()
    k = torch.randn(compressed.capacity, 128, generator=gen).bfloat16()
    weights = torch.randn(layout.num_rows, heads, generator=gen).bfloat16()
    return q, k, weights, visible_compressed_entries(compressed)


@pytest.mark.parametrize("chunk", [slice(0, 26), slice(5, 20), slice(13, 26), slice(14, 15)])
def test_cudnn_indexer_scores_match_the_reference_on_row_chunks(vendors, chunk) -> None:
    """Chunks of two 13-token sequences (ratio 4: 3 entries each) that start mid-sequence and span
    both: the dense kernel's THD segments, offsets and −inf limits give exactly the candidates' scores
    (float32 sums of the same bf16 inputs; only the summation order differs)."""
    dsa = with_cudnn(vendors)
    q, k, weights, entries = uniform_indexer_problem(batch=2, seqlen=13)
    candidates, visible = entries.rows(chunk), entries.uniform_rows(chunk)
    assert visible is not None and visible.entries == 3 == candidates.shape[1]
    got = cudnn_backend.indexer_scores(q[chunk], k, weights[chunk], candidates, 0.09, visible)
    expected = reference_indexer_scores(q[chunk], k, weights[chunk], candidates, 0.09)
    assert got.dtype == torch.float32 and torch.equal(torch.isneginf(got), candidates < 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    call = dsa.calls[-1][1]
    first_sequence = chunk.start // 13
    assert call["offsets"][0] == chunk.start - 13 * first_sequence and (call["offsets"][1:] == 0).all()
    assert call["k"].shape[0] == int(call["cu_k"][-1])  # only the touched sequences' keys
    cudnn_backend.indexer_scores(q[chunk], k, weights[chunk], candidates, 0.09, visible)
    again = dsa.calls[-1][1]
    assert all(again[name] is call[name] for name in ("cu_q", "cu_k", "offsets"))  # kept per row structure


@pytest.mark.parametrize("cp_rank, chunk", [(0, slice(None)), (1, slice(None)), (1, slice(3, 40)), (0, slice(30, 31))])
def test_cudnn_indexer_scores_match_the_reference_on_cp_row_segments(vendors, cp_rank, chunk) -> None:
    """A CP-2 rank's extended rows of an SBHD batch (two 32-token sequences, zigzag, halo 5, ratio 4: each rank
    holds two pieces of each sequence, all but the first with halo rows): its `SegmentedVisibleRows` score, through
    the kernel's THD segments over keys gathered in sequence order, exactly the candidates' scores, also for
    chunks that cut segments (float32 sums of the same bf16 inputs)."""
    from megatron_dsa.layers.context_parallel import ContextParallelRows
    from megatron_dsa.parallel.context import ContextParallelPlan

    dsa = with_cudnn(vendors)
    plan = ContextParallelPlan.build((32, 32), 2, "zigzag")
    rows = ContextParallelRows(plan, cp_rank, None, 5, torch.device("cpu"), batch=2)
    entries = rows.visible_entries(4)
    gathered = 2 * len(rows.pieces) * rows.slots_per_piece(4)
    gen = torch.Generator().manual_seed(cp_rank)
    q = torch.randn(rows.layout.num_rows, 64, 128, generator=gen).bfloat16()
    k = torch.randn(gathered, 128, generator=gen).bfloat16()
    weights = torch.randn(rows.layout.num_rows, 64, generator=gen).bfloat16()
    candidates, segmented = entries.rows(chunk), entries.segmented_rows(chunk)
    assert entries.uniform_rows(chunk) is None and segmented is not None and segmented.keys == 8
    got = cudnn_backend.indexer_scores(q[chunk], k, weights[chunk], candidates, 0.09, segmented)
    expected = reference_indexer_scores(q[chunk], k, weights[chunk], candidates, 0.09)
    assert torch.equal(torch.isneginf(got), candidates < 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    call = dsa.calls[-1][1]
    assert call["k"].shape[0] == int(call["cu_k"][-1]) == 8 * (len(call["cu_q"]) - 1)  # each segment's own keys
    assert entries.segmented_rows(chunk) is segmented  # kept per chunk


def test_cp_row_segments_only_for_sbhd_batches() -> None:
    """Packed input under CP (sequences of different lengths, padding) keeps the candidates path: no segments."""
    from megatron_dsa.layers.context_parallel import ContextParallelRows
    from megatron_dsa.parallel.context import ContextParallelPlan

    plan = ContextParallelPlan.build((32, 16), 2, "zigzag", (30, 16))
    rows = ContextParallelRows(plan, 0, None, 5, torch.device("cpu"))
    assert rows.visible_entries(4).segmented_rows(slice(None)) is None


def test_cudnn_indexer_scores_need_the_uniform_structure(vendors) -> None:
    """Auto takes cuDNN for the selection of a uniform batch only; without the structure (packed or
    CP layouts, the loss's own scoring) it declines with the reason and Triton/unfused serve it."""
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    call = dict(device=torch.device("cuda"), dtype=torch.bfloat16, heads=64, head_dim=128, visible=True)
    assert cudnn_backend.probe(OpFamily.INDEXER_SCORES, call) is None
    for change, reason in ((dict(visible=False), "needs the visible-entry structure"), (dict(dtype=torch.float32),
                           "float32"), (dict(head_dim=64), "head dim"), (dict(heads=8), "heads"),
                           (dict(heads=32, ratio=2), "ratio 2")):
        problem = cudnn_backend.probe(OpFamily.INDEXER_SCORES, {**call, **change})
        assert problem is not None and reason in problem, (change, problem)
    packed = TokenLayout.packed(torch.tensor([0, 13, 26]), 26, torch.device("cpu"), max_seqlen=13)
    assert visible_compressed_entries(packed.compressed(4)).uniform_rows(slice(0, 26)) is None
    q, k, weights, entries = uniform_indexer_problem(batch=1, seqlen=8)
    with pytest.raises(ValueError, match="no backward"):
        cudnn_backend.indexer_scores(q.requires_grad_(), k, weights, entries.rows(), 0.1, entries.uniform_rows(slice(0, 8)))


def test_c_layer_selection_through_cudnn_indexer_scores_equals_unfused(vendors) -> None:
    """A bf16 C layer (two 48-token sequences, 16 indexer heads of 128 dims) whose selection scores run
    on the (fake) cuDNN indexer forward picks what the unfused layer picks and gives its outputs and
    gradients: top-k 8 of at most 12 entries, so near-ties in the float32 sums may not flip a pick."""
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("tiny", dsa_indexer_n_heads=16, dsa_indexer_head_dim=128)
    fused = HybridAttention(config.replace(attention_backend_overrides={"indexer_scores": "cudnn"}),
                            kind="C").bfloat16()
    reference = HybridAttention(config.replace(attention_backend="unfused"), kind="C").bfloat16()
    reference.load_state_dict(fused.state_dict())
    hidden = torch.randn(48, 2, config.hidden_size).bfloat16()
    results = []
    for layer in (fused, reference):
        x = hidden.clone().requires_grad_()
        reset_call_counts()
        out, _ = layer(x)
        out.float().square().sum().backward()
        results.append((layer.core_attention.last_selection.entries, out, x.grad, call_counts()))
    assert results[0][3][("cudnn", "indexer_scores")] == 1
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1:3], results[1][1:3]):
        assert cosine(a.float(), b.float()) > 0.999 and relative_error(a.float(), b.float()) < 2e-2


# ---------------------------------------------------------------- indexer loss teacher (sparse loss)
TEACHER_SCALE = 0.37  # not 512^-1/2: a kernel that ignored our scale would fail


def teacher_problem(rows: int, heads: int, width: int):
    """fp64 sparse-loss inputs: student scores (−inf at −1), query, kv, candidates (−1 slots, an id ≥ M in
    row 0, row 1 without candidates) and the layer's full normaliser `logaddexp(lse, sink)`, rounded to
    float32 as the kernel takes it. Row 2's normaliser is raised by 40, so its mass sums to far below
    the kernel's ε = 1e-10: without our renormalisation its target would not sum to 1."""
    query, kv, candidates, sink = fake_sparse_inputs(rows, heads, 16, 2 * rows, width, torch.float64, seed=heads)
    _, lse = sparse_attention_forward(query, kv, candidates, sink, TEACHER_SCALE)
    full_lse = torch.logaddexp(lse, sink.double()).float()
    full_lse[2] += 40.0
    gen = torch.Generator().manual_seed(width)
    student = torch.randn(rows, width, generator=gen, dtype=torch.float64).masked_fill(candidates < 0, -math.inf)
    return student, query, kv, candidates, full_lse


@pytest.mark.parametrize("heads, width", [(3, 5), (64, 128), (70, 130)])
def test_cudnn_teacher_matches_the_unfused_indexer_loss(vendors, heads, width) -> None:
    """The (fake) SM90 target kernel + our renormalisation and KL give the unfused `indexer_kl` target and
    per-row KL. Tolerance: the kernel returns its target in float32, renormalised in float32: a few
    float32 ulps (rtol 1e-6 on the target, 1e-5 on the KL, a sum of terms of both signs)."""
    dsa = with_cudnn(vendors)
    student, query, kv, candidates, full_lse = teacher_problem(6, heads, width)
    kl, target = cudnn_backend.indexer_loss(student, query, kv, candidates, full_lse, TEACHER_SCALE,
                                            return_target=True)
    kl_ref, target_ref = reference_indexer_kl(student, query, kv, candidates, full_lse.double(), TEACHER_SCALE,
                                              return_target=True)
    torch.testing.assert_close(target, target_ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-5, atol=1e-9)
    assert (target[1] == 0).all() and kl[1] == 0  # the row without candidates
    assert (target[:, -1] == 0).all() and target[0, 0] == 0  # −1 slots and the id ≥ M
    assert abs(float(target[2].sum()) - 1.0) < 1e-6  # the row below the kernel's ε
    seen = dsa.calls[-1][1]
    assert seen["q"].shape == (1, 6, 64 if heads <= 64 else 128, 16) and seen["scale"] == TEACHER_SCALE
    assert torch.isposinf(seen["lse"][0, :, heads:]).all()  # padding heads carry no mass
    assert seen["ids"].shape == (1, 6, -(-width // 128) * 128) and (seen["ids"][0, :, width:] == -1).all()
    assert seen["ids"][0, 0, 0] == -1 and seen["ids_global"]  # the id ≥ M became −1


def test_cudnn_teacher_runs_the_triton_kl_where_triton_runs(vendors) -> None:
    student = torch.zeros(2, 3)
    assert cudnn_backend._kl_kernel(student) is reference_kl_per_row  # no Triton here
    vendors.setattr(cudnn_backend, "triton_decline_reason", lambda device: None)
    assert cudnn_backend._kl_kernel(student) is triton_kl_per_row
    assert cudnn_backend._kl_kernel(student.double()) is reference_kl_per_row  # Triton's KL is float32


def test_cudnn_teacher_refuses_heads_split_over_tensor_parallel_ranks(vendors) -> None:
    with_cudnn(vendors)
    vendors.setattr(cudnn_backend, "group_size", lambda group: 2)
    with pytest.raises(ValueError, match=r"tp_group \(2 ranks\)"):
        cudnn_backend.indexer_loss(*teacher_problem(4, 3, 5), TEACHER_SCALE)


TEACHER_CALL = dict(device=torch.device("cuda"), dtype=torch.bfloat16, heads=64, head_dim=512, topk=512,
                    dense=False, tp_size=1)


def test_cudnn_teacher_declines_what_it_cannot_run(vendors) -> None:
    on_gpu_generation(vendors, (9, 0))
    assert "package cudnn not importable" in cudnn_backend.probe(OpFamily.INDEXER_LOSS, TEACHER_CALL)
    dsa = with_cudnn(vendors)
    assert cudnn_backend.probe(OpFamily.INDEXER_LOSS, TEACHER_CALL) is None
    for change, reason in ((dict(dense=True), "the dense indexer loss"), (dict(tp_size=2), "2 tensor-parallel"),
                           (dict(dtype=torch.float32), "float32"), (dict(head_dim=576), "head dim 576"),
                           (dict(heads=256), "256 local heads"), (dict(topk=4096), "top-k 4096")):
        problem = cudnn_backend.probe(OpFamily.INDEXER_LOSS, {**TEACHER_CALL, **change})
        assert problem is not None and reason in problem, (change, problem)
    on_gpu_generation(vendors, (10, 0))
    assert "SM90 only (the SM100 target kernel" in cudnn_backend.probe(OpFamily.INDEXER_LOSS, TEACHER_CALL)
    on_gpu_generation(vendors, (9, 0))
    without = types.SimpleNamespace(**{name: getattr(dsa, name) for name in (
        "sparse_attention_backward_wrapper", "indexer_top_k_wrapper", "indexer_backward_wrapper",
        "indexer_forward_wrapper")})
    module = fake_cudnn(dsa)
    module.DSA = without
    install(vendors, "cudnn", module)
    clear_probe_caches()
    assert "sparse_attn_score_recompute_wrapper not usable" in cudnn_backend.probe(OpFamily.INDEXER_LOSS,
                                                                                    TEACHER_CALL)


@pytest.mark.parametrize("change, reason", [(dict(dense=True), "the dense indexer loss"),
                                            (dict(dtype=torch.float16), "dtype torch.float16 unsupported")])
def test_cudnn_teacher_dispatch_falls_back_or_raises_with_the_reason(vendors, caplog, change, reason) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    assert resolve(OpFamily.INDEXER_LOSS, **TEACHER_CALL)[0] == "cudnn"
    assert resolve(OpFamily.INDEXER_LOSS, **{**TEACHER_CALL, **change})[0] == "unfused"  # no Triton here
    line = [r.getMessage() for r in caplog.records if r.name == LOGGER][-1]
    assert "'unfused'" in line and f"cudnn: {reason}" in line
    with pytest.raises(BackendUnavailableError, match=f"'cudnn' cannot run indexer_loss: {reason}"):
        resolve(OpFamily.INDEXER_LOSS, "cudnn", **{**TEACHER_CALL, **change})


def teacher_layers(**overrides):
    """A bf16 C layer (D = 512, 4 heads) whose indexer loss runs on the (fake) cuDNN teacher, and the
    unfused layer with the same weights."""
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("tiny", v_head_dim=512, attention_backend="unfused", **overrides)
    fused = HybridAttention(config.replace(attention_backend_overrides={"indexer_loss": "cudnn"}),
                            kind="C").bfloat16()
    reference = HybridAttention(config, kind="C").bfloat16()
    reference.load_state_dict(fused.state_dict())
    return fused, reference


def test_c_layer_with_the_cudnn_teacher_equals_unfused(vendors) -> None:
    """Only the teacher differs: the outputs are bitwise equal, the indexer loss agrees to float32
    rounding of the target (the fake sums the same bf16 inputs in float64, the reference in float32:
    rtol 1e-4), and the indexer's bf16 gradients to their rounding (cosine > 0.999, rel. error < 2e-2)."""
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    hidden = torch.randn(48, 2, 128).bfloat16()
    results = []
    for layer in teacher_layers():
        reset_call_counts()
        out, _ = layer(hidden)
        out.float().square().sum().backward()
        grads = {name: p.grad for name, p in layer.named_parameters() if "indexer" in name and p.grad is not None}
        results.append((out, layer.last_indexer_loss, grads, call_counts()))
    (out, loss, grads, counts), (out_ref, loss_ref, grads_ref, counts_ref) = results
    assert counts[("cudnn", "indexer_loss")] == 1 and ("unfused", "indexer_loss") in counts_ref
    assert torch.equal(out, out_ref)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=0.0)
    assert grads.keys() == grads_ref.keys() and grads
    for name in grads:
        a, b = grads[name].float(), grads_ref[name].float()
        assert cosine(a, b) > 0.999 and relative_error(a, b) < 2e-2, name


def test_c_layer_dense_loss_with_explicit_cudnn_teacher_raises(vendors) -> None:
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    fused, _ = teacher_layers(dsa_indexer_use_sparse_loss=False)
    with pytest.raises(BackendUnavailableError, match="'cudnn' cannot run indexer_loss: the dense indexer loss"):
        fused(torch.randn(48, 2, 128).bfloat16())


# ---------------------------------------------------------------- autograd composition
def loss_of(out: torch.Tensor, lse: torch.Tensor, use_lse: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    loss = (out.float() * torch.randn(out.shape, generator=gen)).sum()
    if use_lse:
        finite = torch.where(torch.isfinite(lse), lse, 0.0)
        loss = loss + (finite.float() * torch.randn(lse.shape, generator=gen)).sum()
    return loss


def assert_dispatched_sparse_autograd_matches_unfused(overrides: dict[str, str], use_lse: bool,
                                                      expected_counts: dict) -> None:
    """Forward and backward of a bf16 sparse problem through the backends `overrides` pick equal the
    unfused autograd (out, lse, dq, dkv, dsink; cosine > 0.999, relative error < 2e-2: bf16 kernels
    against the bf16 reference), after exactly the dispatched calls `expected_counts`."""
    base = fake_sparse_inputs(12, 8, 512, 20, 40, torch.bfloat16, seed=9)
    config = HybridAttentionConfig.from_preset("tiny", attention_backend_overrides=overrides)

    def run(fn):
        query, kv, sink = (t.detach().clone().requires_grad_() for t in (base[0], base[1], base[3]))
        out, lse = fn(query, kv, base[2], sink)
        loss_of(out, lse, use_lse).backward()
        return out, lse, query.grad, kv.grad, sink.grad

    reset_call_counts()
    fused = run(lambda q, kv, idx, s: sparse_attention(q, kv, idx, s, 0.05, config))
    assert call_counts() == expected_counts
    reference = run(lambda q, kv, idx, s: reference_sparse_attention(q, kv, idx, s, 0.05))
    for name, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), fused, reference):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), name
        assert cosine(a[finite], b[finite]) > 0.999 and relative_error(a[finite], b[finite]) < 2e-2, name


@pytest.mark.parametrize("use_lse", [False, True])
def test_flashmla_forward_with_cudnn_backward_equals_unfused_autograd(vendors, use_lse) -> None:
    with_cudnn(vendors)
    install(vendors, "flash_mla", FakeFlashMLA())
    clear_probe_caches()
    on_gpu_generation(vendors, (9, 0))
    expected_bwd = "unfused" if use_lse else "cudnn"  # cuDNN has no lse-gradient input: auto falls back
    assert_dispatched_sparse_autograd_matches_unfused(
        {"sparse_attention_fwd": "flashmla", "sparse_attention_bwd": "auto"}, use_lse,
        {("flashmla", "sparse_attention_fwd"): 1, (expected_bwd, "sparse_attention_bwd"): 1})


def test_explicit_cudnn_backward_raises_when_lse_needs_a_gradient(vendors) -> None:
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    query, kv, indices, sink = fake_sparse_inputs(4, 2, 512, 6, 3, torch.bfloat16, seed=1)
    query.requires_grad_()
    config = HybridAttentionConfig.from_preset("tiny", attention_backend_overrides={
        "sparse_attention_bwd": "cudnn"})
    _, lse = sparse_attention(query, kv, indices, sink, 0.05, config)
    with pytest.raises(BackendUnavailableError, match="no lse-gradient input"):
        torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()


# ---------------------------------------------------------------- dense attention glue
def packed_problem(lengths, padded, tail, heads=4, groups=2, dqk=12, dv=8):
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    real = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    rows = int(cu[-1]) + tail
    layout = TokenLayout.packed(real, rows, torch.device("cpu"), cu_seqlens_padded=cu, max_seqlen=max(padded) + tail)
    gen = torch.Generator().manual_seed(len(lengths))
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return layout, make(rows, heads, dqk), make(rows, groups, dqk), make(rows, groups, dv)


def test_fa4_dense_glue_matches_the_reference_with_padding_and_tail_rows(vendors) -> None:
    calls: list = []
    install(vendors, "flash_attn.cute", fake_flash_attn_cute(calls))
    layout, q, k, v = packed_problem([3, 5], [4, 6], tail=2)
    out, lse = flash_attn_backend.FLASH_ATTENTION_4.attend(q, k, v, layout, 0.3)
    out_ref, lse_ref = causal_attention(q, k, v, layout, 0.3)
    torch.testing.assert_close(out, out_ref, **EXACT)
    torch.testing.assert_close(lse, lse_ref.float())  # FA4 returns [H, T]: transposed back
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(out_ref, (q, k, v), grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **EXACT)
    assert calls[-1]["cu"].tolist() == [0, 4, 12]  # last boundary moved to T: tail rows join segment 2


def test_torch_sdpa_cpu_kernel_is_explicit_only_and_matches_the_reference(vendors) -> None:
    layout = TokenLayout.uniform(2, 7, torch.device("cpu"))
    call = dict(device=torch.device("cpu"), dtype=torch.float64, head_dim=16, v_head_dim=8, heads=4,
                groups=2, layout=layout, lse_grad=False)
    assert resolve(OpFamily.DENSE_ATTENTION, **call)[0] == "unfused"
    name, attend = resolve(OpFamily.DENSE_ATTENTION, "torch_sdpa", **call)
    packed = packed_problem([3, 5], [4, 6], tail=0)[0]
    with pytest.raises(BackendUnavailableError, match="packed/padded layouts unsupported"):
        resolve(OpFamily.DENSE_ATTENTION, "torch_sdpa", **{**call, "layout": packed})
    with pytest.raises(BackendUnavailableError, match="lse carries no gradient"):
        resolve(OpFamily.DENSE_ATTENTION, "torch_sdpa", **{**call, "lse_grad": True})
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(14, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
               for h, d in ((4, 16), (2, 16), (2, 8)))
    out, lse = attend(q, k, v, layout, 0.3)
    out_ref, lse_ref = causal_attention(q, k, v, layout, 0.3)
    torch.testing.assert_close(out, out_ref, **EXACT)
    torch.testing.assert_close(lse, lse_ref.float())
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(out_ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, **EXACT)


def test_torch_sdpa_declines_float64_on_a_gpu_where_its_kernel_has_none(vendors) -> None:
    """A float64 M layer on a GPU (a float64 reference run there) must keep the reference: the CUDA
    memory-efficient kernel raises inside aten for float64 (seen on an H200 when nothing else declined)."""
    on_gpu_generation(vendors, (9, 0))
    call = dict(device=torch.device("cuda"), head_dim=16, v_head_dim=8, heads=4, groups=2,
                layout=TokenLayout.uniform(2, 7, torch.device("cpu")), lse_grad=False)
    assert resolve(OpFamily.DENSE_ATTENTION, "torch_sdpa", **call, dtype=torch.bfloat16)[0] == "torch_sdpa"
    assert resolve(OpFamily.DENSE_ATTENTION, **call, dtype=torch.float64)[0] == "unfused"
    with pytest.raises(BackendUnavailableError, match="dtype torch.float64 unsupported"):
        resolve(OpFamily.DENSE_ATTENTION, "torch_sdpa", **call, dtype=torch.float64)


def m_layer_runs(config: HybridAttentionConfig, backend: str, hidden: torch.Tensor) -> list[tuple]:
    """An M layer with `dense_attention` on `backend` and an unfused one with the same weights, each run
    forward and backward on `hidden`: `(out, d hidden, parameter grads, call counts)` per layer."""
    fused = HybridAttention(config.replace(attention_backend_overrides={"dense_attention": backend}),
                            kind="M").to(hidden.dtype)
    reference = HybridAttention(config.replace(attention_backend="unfused"), kind="M").to(hidden.dtype)
    reference.load_state_dict(fused.state_dict())
    results = []
    for layer in (fused, reference):
        x = hidden.clone().requires_grad_()
        reset_call_counts()
        out, _ = layer(x)
        out.double().square().sum().backward()
        results.append((out, x.grad, [p.grad for p in layer.parameters()], call_counts()))
    return results


def test_m_layer_with_explicit_torch_sdpa_matches_unfused(vendors) -> None:
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("tiny", qk_head_dim=16, kv_lora_rank=16, num_query_groups=2)
    outputs = m_layer_runs(config, "torch_sdpa", torch.randn(9, 2, config.hidden_size, dtype=torch.float64))
    assert outputs[0][3][("torch_sdpa", "dense_attention")] == 1
    torch.testing.assert_close(outputs[0][0], outputs[1][0], **EXACT)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], rtol=1e-9, atol=1e-9)
    for a, b in zip(outputs[0][2], outputs[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)

# ---------------------------------------------------------------- dense attention blocks (M under CP)
def block_problem(rows: int, keys: int, dtype: torch.dtype, heads: int = 4, groups: int = 2, dqk: int = 16,
                  dv: int = 8, seed: int = 5):
    """q, k, v of one ring block and a merged `(out, lse)` and output gradient to differentiate against:
    the block's own `lse` plus 0.4 (other blocks' keys add mass), so backward must use the merged values."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = draw(rows, heads, dqk), draw(keys, groups, dqk), draw(keys, groups, dv)
    out, grad_out = draw(rows, heads, dv), draw(rows, heads, dv)
    return q, k, v, out, grad_out


BLOCK_CALL = dict(head_dim=16, v_head_dim=8, heads=4, groups=2, lse_grad=False)


@pytest.mark.parametrize("rows,keys,causal", [(7, 7, True), (5, 9, False)])
def test_torch_sdpa_block_ops_match_the_reference_with_merged_lse(vendors, rows, keys, causal) -> None:
    """The CPU flash kernel (explicit only) runs a ring block forward, and its backward from a merged
    out/LSE, exactly as the reference block ops (fp64)."""
    call = dict(device=torch.device("cpu"), dtype=torch.float64, **BLOCK_CALL)
    for family in (OpFamily.DENSE_ATTENTION_BLOCK_FWD, OpFamily.DENSE_ATTENTION_BLOCK_BWD):
        assert resolve(family, **call)[0] == "unfused"  # auto keeps the reference on a CPU
    _, forward = resolve(OpFamily.DENSE_ATTENTION_BLOCK_FWD, "torch_sdpa", **call)
    _, backward = resolve(OpFamily.DENSE_ATTENTION_BLOCK_BWD, "torch_sdpa", **call)
    q, k, v, out, grad_out = block_problem(rows, keys, torch.float64)
    got, expected = forward(q, k, v, 0.3, causal), block_attention_forward(q, k, v, 0.3, causal)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **EXACT)
    lse = expected[1] + 0.4
    got = backward(q, k, v, out, lse, grad_out, 0.3, causal)
    for a, b in zip(got, block_attention_backward(q, k, v, out, lse, grad_out, 0.3, causal)):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("rows,keys,causal", [(6, 6, True), (4, 10, False)])
def test_fa4_block_glue_matches_the_reference(vendors, rows, keys, causal) -> None:
    """FA4 forward (one varlen segment, causal or not) and `_flash_attn_bwd` (batched, merged out/LSE)
    against the reference block ops on the same bf16 inputs (the fakes compute in float32 underneath)."""
    on_gpu_generation(vendors, (10, 0))
    forward_calls, backward_calls = [], []
    install(vendors, "flash_attn.cute", fake_flash_attn_cute(forward_calls))
    install(vendors, "flash_attn.cute.interface", fake_flash_attn_cute_interface(backward_calls))
    clear_probe_caches()
    call = dict(device=torch.device("cuda"), dtype=torch.bfloat16, **BLOCK_CALL)
    assert resolve(OpFamily.DENSE_ATTENTION_BLOCK_FWD, **call)[0] == "flash_attn"
    assert resolve(OpFamily.DENSE_ATTENTION_BLOCK_BWD, **call)[0] == "flash_attn"
    q, k, v, out, grad_out = block_problem(rows, keys, torch.bfloat16)
    got = flash_attn_backend.block_forward(q, k, v, 0.3, causal)
    expected = block_attention_forward(q, k, v, 0.3, causal)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[1].shape == (rows, 4)
    torch.testing.assert_close(got[0], expected[0].to(torch.bfloat16).float(), rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    assert forward_calls[-1]["causal"] is causal and forward_calls[-1]["cu_k"].tolist() == [0, keys]
    lse = expected[1] + 0.4
    got = flash_attn_backend.block_backward(q, k, v, out, lse, grad_out, 0.3, causal)
    reference = block_attention_backward(q, k, v, out.to(torch.bfloat16), lse, grad_out, 0.3, causal)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert backward_calls[-1]["causal"] is causal
    assert variant_counts() == {("flash_attn", "dense_attention_block_fwd", "fa4"): 1,
                                ("flash_attn", "dense_attention_block_bwd", "fa4"): 1}


def test_block_ops_decline_with_reasons_and_auto_falls_back(vendors, caplog) -> None:
    """FA2 serves the block forward but not its backward (only FA4's backward is wired); head dims above
    256 and an LSE gradient are declined by every fused backend; `auto` then runs the reference and
    logs why, and an explicit request raises with the reason."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    on_gpu_generation(vendors, (8, 0))  # CPU tensors on a faked Ampere GPU: FA2's self-test runs on the fake
    calls: list = []
    for name, module in fake_flash_attn_2(calls).items():
        install(vendors, name, module)
    clear_probe_caches()
    call = dict(device=torch.device("cpu"), dtype=torch.bfloat16, **{**BLOCK_CALL, "v_head_dim": 16})
    name, forward = resolve(OpFamily.DENSE_ATTENTION_BLOCK_FWD, **call)
    assert name == "flash_attn"
    q, k, v, _, _ = block_problem(4, 10, torch.bfloat16, dv=16)
    for a, b in zip(forward(q, k, v, 0.3, False), block_attention_forward(q, k, v, 0.3, False)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # FA2 rounds out to bf16
    assert calls[-1]["causal"] is False
    with pytest.raises(BackendUnavailableError, match="only FlashAttention-4's backward"):
        resolve(OpFamily.DENSE_ATTENTION_BLOCK_BWD, "flash_attn", **call)
    assert resolve(OpFamily.DENSE_ATTENTION_BLOCK_BWD, **call)[0] == "unfused"
    assert "only FlashAttention-4's backward" in caplog.text
    wide = {**call, "head_dim": 512, "v_head_dim": 512}
    assert resolve(OpFamily.DENSE_ATTENTION_BLOCK_FWD, **wide)[0] == "unfused"
    assert "head_dim 512 unsupported" in caplog.text
    for family in (OpFamily.DENSE_ATTENTION_BLOCK_FWD, OpFamily.DENSE_ATTENTION_BLOCK_BWD):
        with pytest.raises(BackendUnavailableError, match="head_dim 512 unsupported"):
            resolve(family, "torch_sdpa", **wide)
        with pytest.raises(BackendUnavailableError, match="lse carries no gradient"):
            resolve(family, "flash_attn", **{**call, "lse_grad": True})
