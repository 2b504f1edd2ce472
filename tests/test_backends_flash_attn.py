"""The `flash_attn` backend's FlashAttention-2 and -3 generations on CPU, against fakes of their modules
(`vendor_fakes.py`): the varlen glue, the order FA4 > FA3 > FA2, what each declines, the one-time
self-test that guards the two adapters we could not run on a GPU, the `auto` ranking against cuDNN
SDPA, and what `info` shows.

The fakes take bf16/fp16 only, as the kernels do, and run the reference math on the same bf16 inputs:
glue tests compare with the reference at float32 rounding of the lse (1e-6) and bf16 rounding of
outputs and gradients (the chunking of the two reference runs differs); layer tests at cosine > 0.999 /
relative error < 2e-2 like the other bf16 layer tests."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.__main__ import main
from megatron_dsa.backends import BackendUnavailableError, OpFamily, probes, registry, resolve, variant_counts
from megatron_dsa.backends.flash_attn import (
    FLASH_ATTENTION_2,
    FLASH_ATTENTION_3,
    FLASH_ATTENTION_4,
    ShapeClass,
    describe_generations,
    serving_generation,
)
from megatron_dsa.ops.dense_attention import causal_attention
from megatron_dsa.ops.layout import TokenLayout
from distributed import cosine, relative_error
from test_backends_adapters import LOGGER, clear_probe_caches, m_layer_runs, on_gpu_generation, packed_problem
from test_backends_adapters import vendors  # noqa: F401 - the fixture
from vendor_fakes import fake_flash_attn_2, fake_flash_attn_3, fake_flash_attn_cute, install

DENSE = OpFamily.DENSE_ATTENTION
CPU = torch.device("cpu")
FAKES = {"FA3": (FLASH_ATTENTION_3, fake_flash_attn_3), "FA2": (FLASH_ATTENTION_2, fake_flash_attn_2)}


def installed(monkeypatch: pytest.MonkeyPatch, modules: dict) -> None:
    """Put a fake's modules in place (None removes one) and let the probes look again."""
    for name, module in modules.items():
        install(monkeypatch, name, module)
    clear_probe_caches()


def dense_call(layout: TokenLayout, head_dim: int = 16, v_head_dim: int = 16, heads: int = 4, groups: int = 2,
               dtype: torch.dtype = torch.bfloat16) -> dict:
    """The call description the M layer gives (CPU tensors; tests fake the GPU generation)."""
    return dict(device=CPU, dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim, heads=heads, groups=groups,
                layout=layout, lse_grad=False)


def bf16_problem(lengths, padded, tail, dqk=16, dv=16, **shape):
    """`packed_problem` in bf16 (what the kernels take), by default with `dense_call`'s dims."""
    layout, *tensors = packed_problem(lengths, padded, tail, dqk=dqk, dv=dv, **shape)
    return layout, *(t.detach().bfloat16().requires_grad_() for t in tensors)


def assert_matches_reference(layout, q, k, v, out, lse, rows: slice = slice(None)) -> None:
    """out, lse and the q/k/v gradients of a loss on `rows` equal the reference's on the same inputs."""
    out_ref, lse_ref = causal_attention(q, k, v, layout, 0.3)
    torch.testing.assert_close(out[rows], out_ref[rows])
    torch.testing.assert_close(lse[rows], lse_ref[rows], rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out[rows])
    got = torch.autograd.grad(out[rows], (q, k, v), grad)
    expected = torch.autograd.grad(out_ref[rows], (q, k, v), grad)
    for name, a, b in zip(("dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, msg=name)


# ---------------------------------------------------------------- glue
@pytest.mark.parametrize("name, dims", [("FA3", dict(dqk=16, dv=8)), ("FA2", dict(dqk=16, dv=16))])
def test_glue_matches_the_reference_with_padding_tail_rows_and_gqa(vendors, name, dims) -> None:
    generation, fake = FAKES[name]
    calls: list = []
    installed(vendors, fake(calls))
    layout, q, k, v = bf16_problem([3, 5], [4, 6], tail=2, heads=4, groups=2, **dims)
    out, lse = generation.attend(q, k, v, layout, 0.3)
    assert out.shape == (12, 4, dims["dv"]) and lse.shape == (12, 4) and lse.dtype == torch.float32
    assert not lse.requires_grad  # the kernels drop an lse gradient: it must not look differentiable
    assert_matches_reference(layout, q, k, v, out, lse)
    seen = calls[-1]
    assert seen["cu"].tolist() == [0, 4, 12] and seen["cu"].dtype == torch.int32  # tail rows join segment 2
    assert seen["max_seqlen"] == 12 and seen["k"].shape[1] == 2 and seen["scale"] == 0.3  # GQA as is


@pytest.mark.parametrize("name", ["FA3", "FA2"])
def test_the_bound_covers_a_tail_past_max_seqlen_and_stays_tight_for_uniform_batches(vendors, name) -> None:
    """The kernels skip rows past `max_seqlen` (the fakes assert every segment fits): a packed layout
    gets T, as the host cannot see whether a tail runs the last segment past `max_seqlen`; its real rows
    equal the reference. A uniform layout (no tail) keeps S."""
    generation, fake = FAKES[name]
    calls: list = []
    installed(vendors, fake(calls))
    boundaries = torch.tensor([0, 4, 7])
    layout = TokenLayout.packed(boundaries, 12, CPU, max_seqlen=4)  # rows 7-11: a 5-row tail
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, h, 16, generator=gen).bfloat16().requires_grad_() for h in (4, 2, 2))
    out, lse = generation.attend(q, k, v, layout, 0.3)
    assert calls[-1]["max_seqlen"] == 12
    assert_matches_reference(layout, q, k, v, out, lse, rows=slice(0, 7))
    uniform = TokenLayout.uniform(3, 4, CPU)
    generation.attend(q, k, v, uniform, 0.3)
    assert calls[-1]["max_seqlen"] == 4 and calls[-1]["cu"].tolist() == [0, 4, 8, 12]


def test_fa3_builds_that_always_return_the_lse_are_served(vendors) -> None:
    """Builds before PR #1851 have no `return_attn_probs` and return `(out, lse)` unasked."""
    installed(vendors, fake_flash_attn_3([], api="always"))
    layout, q, k, v = bf16_problem([3, 5], [4, 6], tail=2, dqk=16, dv=8)
    out, lse = FLASH_ATTENTION_3.attend(q, k, v, layout, 0.3)
    assert_matches_reference(layout, q, k, v, out, lse)


# ---------------------------------------------------------------- order and declines
def test_generations_are_tried_fa4_then_fa3_then_fa2(vendors) -> None:
    on_gpu_generation(vendors, (9, 0))
    calls = {"FA4": [], "FA3": [], "FA2": []}
    installed(vendors, {"flash_attn.cute": fake_flash_attn_cute(calls["FA4"]), **fake_flash_attn_3(calls["FA3"]),
                        **fake_flash_attn_2(calls["FA2"])})
    layout, q, k, v = bf16_problem([3, 5], [4, 6], tail=2)
    for name, module in (("FA4", "flash_attn.cute"), ("FA3", "flash_attn_interface"),
                         ("FA2", "flash_attn.flash_attn_interface")):
        chosen, attend = resolve(DENSE, "flash_attn", **dense_call(layout))  # runs the self-test (FA3/FA2)
        before = {key: len(value) for key, value in calls.items()}
        attend(q, k, v, layout, 0.3)
        assert {key: len(value) - before[key] for key, value in calls.items()} == {
            key: int(key == name) for key in calls}, name
        assert variant_counts().get(("flash_attn", DENSE.value, name.lower()), 0) == 1, variant_counts()
        installed(vendors, {module: None})
    assert calls["FA4"][0]["max_seqlen"] == layout.max_seqlen  # FA4 keeps the given bound (dense_layout)


def test_older_gpus_skip_to_the_generation_that_runs_there(vendors) -> None:
    installed(vendors, {"flash_attn.cute": fake_flash_attn_cute([]), **fake_flash_attn_3([]),
                        **fake_flash_attn_2([])})
    on_gpu_generation(vendors, (8, 0))
    generation, declined = serving_generation(ShapeClass.of_call(dense_call(None)))
    assert generation is FLASH_ATTENTION_2
    assert declined == ["FlashAttention-4: FlashAttention-4 needs SM9x/SM10x/SM11x, this GPU is SM80",
                        "FlashAttention-3: FlashAttention-3 needs SM9x, this GPU is SM80"]


@pytest.mark.parametrize("fakes, capability, change, reason", [
    (dict(fa2={}), (9, 0), dict(head_dim=192, v_head_dim=128),
     "FlashAttention-2 needs one head dim for q, k and v, got qk 192 and v 128 (not padded"),
    (dict(fa2=dict(version="2.5.9")), (9, 0), {}, "flash-attn 2.5.9 is older than 2.6"),
    (dict(fa2={}), (9, 0), dict(dtype=torch.float32), "dtype torch.float32 unsupported"),
    (dict(fa3={}), (8, 0), {}, "FlashAttention-3 needs SM9x, this GPU is SM80"),
    (dict(fa3={}), (9, 0), dict(head_dim=256, v_head_dim=128),
     "FlashAttention-3 runs qk head dim 256 with v head dim 128 only as qk in (128, 192]"),
    (dict(fa3={}, fa2={}), (9, 0), dict(head_dim=256, v_head_dim=128), "FlashAttention-2 needs one head dim"),
])
def test_what_fa2_and_fa3_decline_is_reported_and_auto_falls_back(vendors, caplog, fakes, capability, change,
                                                                  reason) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    calls: list = []
    if "fa3" in fakes:
        installed(vendors, fake_flash_attn_3(calls, **fakes["fa3"]))
    if "fa2" in fakes:
        installed(vendors, fake_flash_attn_2(calls, **fakes["fa2"]))
    on_gpu_generation(vendors, capability)
    call = {**dense_call(bf16_problem([3, 5], [4, 6], tail=2)[0]), **change}
    with pytest.raises(BackendUnavailableError, match="cannot run dense_attention: .*" + re.escape(reason)):
        resolve(DENSE, "flash_attn", **call)
    assert resolve(DENSE, **call)[0] == "unfused"  # CPU: neither SDPA backend takes it under auto
    assert reason in [r.getMessage() for r in caplog.records if r.name == LOGGER][-1]
    assert calls == []  # declined before any self-test


def test_explicit_flash_attn_without_any_generation_names_what_to_install(vendors) -> None:
    config = HybridAttentionConfig.from_preset("tiny", attention_backend_overrides={"dense_attention": "flash_attn"})
    with pytest.raises(BackendUnavailableError) as error:
        HybridAttention(config, kind="M")
    message = str(error.value)
    assert "'flash_attn' cannot run dense_attention: FlashAttention-4: package flash_attn.cute" in message
    assert "pip install 'megatron_dsa[flash-attn]'" in message  # FA4
    assert "flash-attention repository's hopper/ directory" in message  # FA3
    assert "pip install flash-attn --no-build-isolation" in message  # FA2


# ---------------------------------------------------------------- the self-test
@pytest.mark.parametrize("name", ["FA3", "FA2"])
@pytest.mark.parametrize("corrupt, metric", [("lse", "|Δlse|"), ("out", "max |Δout|/max |out|")])
def test_a_failing_self_test_declines_and_auto_falls_back_with_one_log_line(vendors, caplog, name, corrupt,
                                                                           metric) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    generation, fake = FAKES[name]
    calls: list = []
    installed(vendors, fake(calls, corrupt=corrupt))
    on_gpu_generation(vendors, (9, 0))
    call = dense_call(bf16_problem([3, 5], [4, 6], tail=2)[0])
    for _ in range(3):
        assert resolve(DENSE, **call)[0] == "unfused"
    with pytest.raises(BackendUnavailableError, match=f"{generation.name} .* failed its self-test against the "
                                                      f"reference .*; please report"):
        resolve(DENSE, "flash_attn", **call)
    assert len(calls) == 1  # one self-test, its verdict kept
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    choices = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and f"{metric} " in warnings[0] and "please report" in warnings[0]
    assert len(choices) == 1 and "uses backend 'unfused'" in choices[0] and "failed its self-test" in choices[0]


def test_a_build_without_an_lse_fails_its_self_test_with_the_reason(vendors) -> None:
    installed(vendors, fake_flash_attn_3([], api="out_only"))
    on_gpu_generation(vendors, (9, 0))
    with pytest.raises(BackendUnavailableError, match=r"FlashAttention-3 \(flash_attn_3 .*\) failed its self-test "
                                                      r"\(RuntimeError: this FlashAttention-3 build returns no LSE"):
        resolve(DENSE, "flash_attn", **dense_call(None))


def test_the_self_test_runs_once_per_call_class_and_keeps_the_random_state(vendors) -> None:
    calls: list = []
    installed(vendors, fake_flash_attn_3(calls))
    on_gpu_generation(vendors, (9, 0))
    layout = bf16_problem([3, 5], [4, 6], tail=2)[0]
    state = torch.get_rng_state()
    for change in ({}, {}, dict(heads=2, groups=2), dict(dtype=torch.float16), dict(head_dim=24)):
        assert resolve(DENSE, **{**dense_call(layout), **change})[0] == "flash_attn"
    assert torch.equal(torch.get_rng_state(), state)
    assert len(calls) == 4  # GQA, MHA, fp16 and new dims are new classes; a repeated call is not
    gqa, mha, fp16, dims = calls
    assert gqa["cu"].tolist() == [0, 5, 16] and gqa["q"].shape[1] == 4 and gqa["k"].shape[1] == 2
    assert mha["k"].shape[1] == 4 and fp16["q"].dtype == torch.float16 and dims["q"].shape[-1] == 24


def test_a_verdict_kept_before_a_capture_serves_inside_it(vendors) -> None:
    """Where the dispatcher asks the probe again during a CUDA-graph capture (a choice it does not
    remember), the warm-up step's verdict must answer there (a decline would switch kernels, or fail an
    explicit `flash_attn`), and a class first seen inside the capture declines unkept."""
    calls: list = []
    installed(vendors, fake_flash_attn_3(calls))
    on_gpu_generation(vendors, (9, 0))
    call = dense_call(bf16_problem([3, 5], [4, 6], tail=2)[0])
    assert resolve(DENSE, "flash_attn", **call)[0] == "flash_attn"
    vendors.setattr(probes, "capturing", lambda device: True)
    registry.forget_choices()  # the probe itself answers inside the capture
    assert resolve(DENSE, "flash_attn", **call)[0] == "flash_attn"
    with pytest.raises(BackendUnavailableError, match="while a CUDA graph is captured"):
        resolve(DENSE, "flash_attn", **{**call, "dtype": torch.float16})
    assert len(calls) == 1


# ---------------------------------------------------------------- the layer and the ranking
@pytest.mark.parametrize("name, qk_head_dim", [("FA3", 16), ("FA2", 24)])  # M dims 24/32 (FA3), 32/32 (FA2)
def test_m_layer_through_fa3_and_fa2_fakes_equals_unfused(vendors, name, qk_head_dim) -> None:
    generation, fake = FAKES[name]
    calls: list = []
    installed(vendors, fake(calls))
    on_gpu_generation(vendors, (9, 0))
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("tiny", qk_head_dim=qk_head_dim, kv_lora_rank=16, num_query_groups=2)
    results = m_layer_runs(config, "flash_attn", torch.randn(9, 2, config.hidden_size).bfloat16())
    assert results[0][3][("flash_attn", "dense_attention")] == 1
    assert len(calls) == 2 and calls[-1]["cu"].tolist() == [0, 9, 18]  # the self-test, then the layer's call
    for a, b in zip([results[0][0], results[0][1], *results[0][2]], [results[1][0], results[1][1], *results[1][2]]):
        assert cosine(a.float(), b.float()) > 0.999 and relative_error(a.float(), b.float()) < 2e-2


def test_auto_leaves_whole_sequence_batches_to_cudnn_sdpa_rather_than_fa2(vendors, caplog) -> None:
    """FA2 on Hopper: uniform batches go to cuDNN SDPA, packed ones (which it declines) to FA2; FA3 keeps
    its place before cuDNN; named, FA2 runs anyway; on SM80 (no cuDNN SDPA there) FA2 serves both."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    on_gpu_generation(vendors, (9, 0))
    vendors.setattr(torch.backends.cudnn, "is_available", lambda: True)
    installed(vendors, fake_flash_attn_2([]))
    uniform = dense_call(TokenLayout.uniform(2, 8, CPU))
    packed = dense_call(bf16_problem([3, 5], [4, 6], tail=2)[0])
    assert resolve(DENSE, **uniform)[0] == "cudnn"
    line = [r.getMessage() for r in caplog.records if r.name == LOGGER][-1]
    assert "flash_attn: FlashAttention-2 would serve, but cuDNN SDPA runs whole-sequence batches faster" in line
    assert resolve(DENSE, **packed)[0] == "flash_attn"
    assert resolve(DENSE, "flash_attn", **uniform)[0] == "flash_attn"
    installed(vendors, fake_flash_attn_3([]))
    assert resolve(DENSE, **uniform)[0] == "flash_attn"
    assert serving_generation(ShapeClass.of_call(uniform))[0] is FLASH_ATTENTION_3
    installed(vendors, {"flash_attn_interface": None})
    on_gpu_generation(vendors, (8, 0))
    assert resolve(DENSE, **uniform)[0] == "flash_attn"


# ---------------------------------------------------------------- info
def line_of(text: str, generation: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(generation))


def test_info_shows_the_importable_generations_and_the_one_that_serves(vendors, capsys) -> None:
    installed(vendors, {**fake_flash_attn_3([]), **fake_flash_attn_2([])})
    on_gpu_generation(vendors, (9, 0))
    text = describe_generations()
    assert "package flash_attn.cute not importable" in line_of(text, "FlashAttention-4 (flash-attn-4 ")
    assert line_of(text, "FlashAttention-3 (flash_attn_3 ").endswith("): importable, serves here")
    assert line_of(text, "FlashAttention-2 (flash-attn ").endswith("): importable, FlashAttention-3 goes first")
    on_gpu_generation(vendors, (8, 0))
    assert main(["info", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert line_of(text, "FlashAttention-3").endswith("): importable, FlashAttention-3 needs SM9x, this GPU is SM80")
    assert line_of(text, "FlashAttention-2").endswith("): importable, serves here")
    assert FLASH_ATTENTION_4.name in text and "flash_attn_3" in line_of(text, "flash_attn ")
