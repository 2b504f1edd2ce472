"""Decode attention over an FP8 attention-row cache: the `paged_decode_attention` family.

The reference (`ops.decode_attention.paged_decode_attention`) is held to the bf16 cache's reference on the rows
the pages stand for; the FlashMLA adapter's glue (one cache block per sequence, the window as the extra cache,
ids `b · slots + slot` padded to blocks of 64, lengths for the window and kind H, head padding with −inf sinks, the
inverse RoPE after) runs on CPU against a fake FlashMLA written from FlashMLA's own description of its cache
(`vendor_fakes.FakeFlashMLADecode`), and on a GPU where FlashMLA is built against the reference.

Tolerances: the fake computes in float64 from the same bytes and returns bf16, as FlashMLA does, so the glue test
allows that rounding (2⁻⁷ of the output scale) and asks cosine > 0.99999; on the GPU FlashMLA's bf16 P·V and
its own rounding of the query give cosine > 0.9995 and a relative error below 1.5e-2 against the float32 reference
on the same pages.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import megatron_dsa.backends.flashmla as flashmla_backend
from megatron_dsa.backends import BackendUnavailableError, OpFamily, call_counts, probes, registry, reset_call_counts
from megatron_dsa.backends.registry import resolve
from megatron_dsa.ops.decode_attention import decode_attention, paged_decode_attention
from megatron_dsa.ops.paged_rows import PagedRows, all_rows, write_rows
from distributed import cosine, relative_error
from vendor_fakes import FakeFlashMLADecode, install

D, P = 512, 64


def filled_pages(batch: int, slots: int, gen: torch.Generator, device: str = "cpu") -> PagedRows:
    paged = PagedRows.empty(batch, slots, D, P, device)
    rows = torch.randn(batch * slots, D, generator=gen, dtype=torch.float64).to(device)
    sequences = torch.arange(batch, device=device).repeat_interleave(slots)
    write_rows(paged, sequences, torch.arange(slots, device=device).repeat(batch), rows)
    return paged


def decode_case(kind: str, heads: int, seed: int = 0, device: str = "cpu", window: int = 128, entry_slots: int = 96,
                ratio: int = 4, topk: int = 40):
    """Inputs of one decode step of `kind` over random FP8 pages: 4 sequences whose new tokens sit at positions
    from 0 (the window holds only the new row) past the window and the entries' ends; C's picks hold −1, repeated
    and not-yet-visible entries."""
    gen = torch.Generator().manual_seed(seed)
    batch = 4
    seqlens = torch.tensor([0, 57, 300, 383])
    query = (torch.randn(batch, heads, D, generator=gen, dtype=torch.float64) * 0.3).to(device)
    sink = torch.linspace(-3.0, 3.0, heads, dtype=torch.float32).to(device)
    window_rows = filled_pages(batch, window, gen, device)
    entries, entry_ids = None, None
    if kind != "W":
        entries = filled_pages(batch, entry_slots, gen, device)
    if kind == "C":
        entry_ids = torch.randint(0, entry_slots, (batch, topk), generator=gen)
        entry_ids[:, :3] = -1
        entry_ids[2, 5] = entry_ids[2, 6]
        entry_ids = entry_ids.to(device)
    freq = 1.0 / (10000 ** (torch.arange(0, P, 2, dtype=torch.float64) / P))
    return dict(query=query, window_rows=window_rows, seqlens=seqlens.to(device), window=window, entries=entries,
                entry_ids=entry_ids, ratio=ratio, sink=sink, scale=D ** -0.5, inverse_rope_freq=freq.to(device))


@pytest.mark.parametrize("kind", ["W", "C", "H"])
def test_the_reference_is_decode_attention_over_the_rows_the_pages_hold(kind):
    """The paged reference against the bf16-cache reference given the dequantized rows: the ring of W slots holds
    the new row at `p % W`, so the bf16 form's ring is the other W − 1 slots in ring order and kv_new that row."""
    case = decode_case(kind, heads=8)
    got = paged_decode_attention(**case)
    window_rows, seqlens, window = case["window_rows"], case["seqlens"], case["window"]
    rows = all_rows(window_rows).double()  # [B, W, D]
    batch = rows.shape[0]
    own = seqlens % window
    kv_new = rows[torch.arange(batch), own]
    # bf16 form: slot i of a W − 1 ring holds the row of the i-th position before p that the window keeps;
    # the reference reads valid slots i < min(p, W − 1) in any order, so list positions p − 1, p − 2, … there.
    back = (seqlens.unsqueeze(1) - 1 - torch.arange(window - 1)) % window
    ring = rows[torch.arange(batch).unsqueeze(1), back]
    entries = None if case["entries"] is None else all_rows(case["entries"]).double()
    want = decode_attention(case["query"], kv_new, ring, seqlens, window, entries, case["entry_ids"],
                            case["ratio"], case["sink"], case["scale"], case["inverse_rope_freq"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.fixture
def fake_flashmla(monkeypatch):
    """FlashMLA with its sparse decode installed (faked), probe caches cleared before and after."""
    fake = FakeFlashMLADecode()
    monkeypatch.setattr(registry, "_CALL_COUNTS", Counter())
    install(monkeypatch, "flash_mla", fake)

    def clear():
        registry.forget_choices()
        probes.import_problem.cache_clear()
        flashmla_backend.decode_package_problem.cache_clear()

    clear()
    yield fake
    clear()


@pytest.mark.parametrize("kind", ["W", "C", "H"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_flashmla_glue_matches_the_reference(fake_flashmla, kind, heads):
    case = decode_case(kind, heads=heads, seed=1)
    case["query"] = case["query"].bfloat16()
    want = paged_decode_attention(**{**case, "query": case["query"].double()})
    got = flashmla_backend.paged_decode_attention(**case)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2 ** -7 * float(want.abs().max()))
    assert cosine(got.double(), want) > 0.99999
    call = fake_flashmla.calls[-1]
    assert call["heads"] == (64 if heads <= 64 else 128) and call["extra"] == (kind != "W")
    assert not call["lengths"]  # rows not attended are −1 ids: FlashMLA's plan then depends on shapes only


def test_one_scheduling_plan_serves_every_step_of_a_shape(fake_flashmla, monkeypatch):
    """FlashMLA plans its work split with a kernel of its own (27 µs a step at B = 32 on an H200): planned once per
    call shape and reused while the positions advance, planned anew for another batch."""
    monkeypatch.setattr(flashmla_backend, "_SCHEDULES", {})
    plans = []
    monkeypatch.setattr(fake_flashmla, "get_mla_metadata", lambda: plans.append(object()) or (plans[-1], None))
    case = decode_case("C", heads=64, seed=3)
    case["query"] = case["query"].bfloat16()
    for step in range(3):
        flashmla_backend.paged_decode_attention(**{**case, "seqlens": case["seqlens"] + step})
    assert len(plans) == 1
    smaller = {**case, "query": case["query"][:2], "seqlens": case["seqlens"][:2], "entry_ids": case["entry_ids"][:2],
               "window_rows": PagedRows(case["window_rows"].pages[:2], 128, D, P),
               "entries": PagedRows(case["entries"].pages[:2], 96, D, P)}
    flashmla_backend.paged_decode_attention(**smaller)
    assert len(plans) == 2


def test_auto_takes_flashmla_where_it_runs_and_the_reference_elsewhere(fake_flashmla, monkeypatch):
    call = dict(device=torch.device("cpu"), dtype=torch.bfloat16, heads=64, head_dim=D, selected=True)
    assert resolve(OpFamily.PAGED_DECODE_ATTENTION, **call)[0] == "unfused"  # FlashMLA needs a GPU
    monkeypatch.setattr(probes, "cuda_capability", lambda device: (9, 0))
    registry.forget_choices()
    assert resolve(OpFamily.PAGED_DECODE_ATTENTION, **call)[0] == "flashmla"
    registry.forget_choices()
    assert resolve(OpFamily.PAGED_DECODE_ATTENTION, **{**call, "head_dim": 128})[0] == "unfused"
    registry.forget_choices()
    assert resolve(OpFamily.PAGED_DECODE_ATTENTION, **{**call, "dtype": torch.float32})[0] == "unfused"


def test_a_flashmla_build_without_the_sparse_decode_is_named(monkeypatch):
    import types

    old = types.ModuleType("flash_mla")
    old.flash_mla_with_kvcache = lambda q, k_cache, block_table, cache_seqlens, head_dim_v, meta: None
    install(monkeypatch, "flash_mla", old)
    registry.forget_choices()
    probes.import_problem.cache_clear()
    flashmla_backend.decode_package_problem.cache_clear()
    try:
        with pytest.raises(BackendUnavailableError, match="no FP8 sparse decode with an extra cache"):
            resolve(OpFamily.PAGED_DECODE_ATTENTION, "flashmla", device=torch.device("cpu"), dtype=torch.bfloat16)
    finally:
        flashmla_backend.decode_package_problem.cache_clear()
        probes.import_problem.cache_clear()
        registry.forget_choices()


def test_flashmla_refuses_rows_of_other_dims(fake_flashmla):
    case = decode_case("W", heads=64)
    small = PagedRows.empty(4, 128, 512, 32)
    with pytest.raises(ValueError, match="P = 64 RoPE columns, got D = 512, P = 32"):
        flashmla_backend.paged_decode_attention(**{**case, "query": case["query"].bfloat16(), "window_rows": small})


@pytest.mark.parametrize("change, error, message", [
    (dict(window=64), ValueError, "window ring must have W = 64 slots"),
    (dict(window_rows="rows"), TypeError, "must be ops.paged_rows.PagedRows"),
    (dict(query=torch.zeros(4, 8, 256, dtype=torch.float64)), ValueError, r"query must be \[B, H, D\] = \[4, H, 512\]"),
    (dict(entry_ids=torch.zeros(3, 2, dtype=torch.long)), ValueError, "entry_ids must be"),
    (dict(ratio=1), ValueError, "ratio must be an int >= 2"),
], ids=["window", "pages_type", "query", "entry_ids", "ratio"])
def test_bad_paged_inputs_are_named(change, error, message):
    case = {**decode_case("C", heads=8), **change}
    with pytest.raises(error, match=message):
        paged_decode_attention(**case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["W", "C", "H"])
@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("batch", [1, 32])
def test_the_triton_kernel_matches_the_reference_on_the_gpu(kind, heads, batch):
    """The Triton decode kernels reading FP8 pages in bf16 (dsv4 dims: 448 codes, 64 RoPE columns) against the
    float32 reference on the same pages, batches 1 (two value parts) and 32, with the inverse RoPE in the combine:
    cosine > 0.9995, relative error < 1.5e-2 (bf16 probabilities in P·V, as the bf16-row kernel)."""
    case = decode_case(kind, heads=heads, seed=4, device="cuda", entry_slots=8192, topk=512)
    if batch == 32:
        for name in ("query", "seqlens", "entry_ids"):
            if case[name] is not None:
                case[name] = case[name].repeat(8, *[1] * (case[name].dim() - 1))
        for name in ("window_rows", "entries"):
            if case[name] is not None:
                paged = case[name]
                case[name] = PagedRows(paged.pages.repeat(8, 1), paged.slots, D, P)
    elif batch == 1:
        case = {**case, "query": case["query"][3:], "seqlens": case["seqlens"][3:],
                "entry_ids": None if case["entry_ids"] is None else case["entry_ids"][3:],
                "window_rows": PagedRows(case["window_rows"].pages[3:], case["window"], D, P),
                "entries": None if case["entries"] is None else PagedRows(case["entries"].pages[3:], 8192, D, P)}
    case["seqlens"] = case["seqlens"].clone()
    case["seqlens"][-1] = 32000
    query = case["query"].bfloat16()
    want = paged_decode_attention(**{**case, "query": query.float()})
    reset_call_counts()
    got = registry.dispatch(OpFamily.PAGED_DECODE_ATTENTION, "triton", device=query.device, dtype=query.dtype,
                            heads=heads, head_dim=D, selected=kind == "C")(**{**case, "query": query})
    assert call_counts().get(("triton", "paged_decode_attention"), 0) == 1, call_counts()
    assert cosine(got.float(), want) > 0.9995 and relative_error(got.float(), want) < 1.5e-2


needs_flashmla = pytest.mark.skipif(
    not torch.cuda.is_available() or flashmla_backend.decode_package_problem() is not None,
    reason="needs a CUDA GPU and FlashMLA built with its FP8 sparse decode")


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("kind", ["W", "C", "H"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_flashmla_matches_the_reference_on_the_gpu(kind, heads):
    case = decode_case(kind, heads=heads, seed=2, device="cuda", entry_slots=8192, topk=512)
    case["seqlens"] = torch.tensor([0, 57, 9000, 32000], device="cuda")
    query = case["query"].bfloat16()
    want = paged_decode_attention(**{**case, "query": query.float()})
    reset_call_counts()
    got = registry.dispatch(OpFamily.PAGED_DECODE_ATTENTION, device=query.device, dtype=query.dtype, heads=heads,
                            head_dim=D, selected=kind == "C")(**{**case, "query": query})
    assert call_counts().get(("flashmla", "paged_decode_attention"), 0) == 1, call_counts()
    assert cosine(got.float(), want) > 0.9995 and relative_error(got.float(), want) < 1.5e-2


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("kind", ["W", "C", "H"])
@torch.no_grad()
def test_a_dsv4_layer_decodes_through_flashmla_as_through_the_reference(kind):
    """A dsv4-flash layer (bf16, 64 heads, rows of 448 + 64) with FP8 attention rows: a 300-token prompt of two
    sequences, then decode steps eagerly and replayed from a `DecodeGraph`, against a twin whose paged attention is
    the reference on the same pages: FlashMLA ran every step (counters), outputs agree to cosine > 0.999 (FlashMLA
    rounds P to bf16 for P·V; the reference does not)."""
    from megatron_dsa import HybridAttentionConfig
    from megatron_dsa.layers import DecodeGraph
    from megatron_dsa.layers.decoding import LayerCache
    from megatron_dsa.layers.kinds import build_attention

    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind)
    torch.manual_seed(0)
    layer = build_attention(config, kind=kind).cuda().bfloat16().eval()
    twin = build_attention(config.replace(attention_backend_overrides={"paged_decode_attention": "unfused"}),
                           kind=kind).cuda().bfloat16().eval()
    twin.load_state_dict(layer.state_dict())
    hidden = torch.randn(316, 2, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    caches = [LayerCache.for_layer(m, 2, 316, fp8_attention_rows=True) for m in (layer, twin)]
    for model, cache in zip((layer, twin), caches):
        model(hidden[:300], inference_cache=cache)
    reset_call_counts()
    fused = [layer(hidden[t:t + 1], inference_cache=caches[0])[0] for t in range(300, 308)]
    assert call_counts()[("flashmla", "paged_decode_attention")] == 8, call_counts()
    graph = DecodeGraph(lambda x: layer(x, inference_cache=caches[0])[0], hidden[308:309], [caches[0]])
    fused += [graph(hidden[t:t + 1]).clone() for t in range(308, 316)]
    reference = [twin(hidden[t:t + 1], inference_cache=caches[1])[0] for t in range(300, 316)]
    assert call_counts()[("unfused", "paged_decode_attention")] == 16, call_counts()
    fused, reference = torch.cat(fused).float(), torch.cat(reference).float()
    assert cosine(fused, reference) > 0.999, cosine(fused, reference)
