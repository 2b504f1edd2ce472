"""Kernel dispatch: `auto`'s order table, choice and fallback, its one log line, explicit requests, typed call
descriptions, call and variant counters, and which op families a whole layer forward of each kind
dispatches."""

from __future__ import annotations

import ast
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import (
    FAMILY_KEYS,
    Backend,
    BackendUnavailableError,
    CallDescriptionError,
    OpFamily,
    auto_order,
    call_counts,
    dispatch,
    register_backend,
    registered_backends,
    reset_call_counts,
    resolve,
    set_auto_order,
    variant_counts,
)
from megatron_dsa.backends import registry
from megatron_dsa.backends.registry import HostLayout
from megatron_dsa.ops.layout import TokenLayout

OP = OpFamily.SPARSE_ATTENTION_FWD
DECLINE_REASON = "head dim 96 unsupported"
LOGGER = "megatron_dsa.backends"


def fake_sparse_attention(*args: Any, **kwargs: Any) -> str:
    return "fake result"


def fake_probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    return DECLINE_REASON if call.get("head_dim") == 96 else None


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of the registry state, so registrations, auto orders, logged choices and counts made
    by a test are undone afterwards."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    monkeypatch.setattr(registry, "AUTO_ORDER", dict(registry.AUTO_ORDER))
    monkeypatch.setattr(registry, "_LOGGED_CHOICES", set())
    monkeypatch.setattr(registry, "_CALL_COUNTS", Counter())
    monkeypatch.setattr(registry, "_VARIANT_COUNTS", Counter())
    registry.forget_choices()
    yield
    registry.forget_choices()


def register_first(backend: Backend, *ops: OpFamily) -> None:
    """Register `backend` and put it first in `auto`'s order for `ops`."""
    register_backend(backend)
    for op in ops:
        set_auto_order(op, (backend.name, *auto_order(op)))


@pytest.fixture
def fake_backend(clean_registry: None) -> Backend:
    """First in `auto`'s order; runs sparse attention only, and declines head dim 96."""
    backend = Backend(name="fake", ops={OP: fake_sparse_attention}, probe=fake_probe)
    register_first(backend, OP)
    return backend


def test_auto_takes_the_first_accepting_backend_of_the_family_s_order(fake_backend: Backend) -> None:
    assert resolve(OP, head_dim=64) == ("fake", fake_sparse_attention)


def test_the_auto_order_is_per_family(clean_registry: None) -> None:
    """One backend can be first for one family and after another for the next (a kernel measured slower for
    one family only), and a backend a family's row leaves out runs it only when named."""
    other = OpFamily.ROPE
    for name in ("fast", "slow_here"):
        register_backend(Backend(name=name, ops={OP: fake_sparse_attention, other: fake_sparse_attention}))
    set_auto_order(OP, ("fast", "slow_here", "unfused"))
    set_auto_order(other, ("slow_here", "unfused"))
    assert resolve(OP, head_dim=64)[0] == "fast"
    assert resolve(other)[0] == "slow_here"
    assert resolve(other, "fast")[0] == "fast"


# The order the backends' priorities gave before the table replaced them (flashmla 30, flash_attn 30, cudnn 20
# with indexer_loss 12, triton 15 with topk 25, torch_sdpa 10, unfused 0): the table must keep every choice.
PRIORITY_ORDER = {
    "sparse_attention_fwd": ("flashmla", "cudnn", "triton", "unfused"),
    "sparse_attention_bwd": ("cudnn", "triton", "unfused"),
    "indexer_scores": ("cudnn", "triton", "unfused"),
    "topk": ("triton", "cudnn", "unfused"),
    "selection_rows": ("triton", "unfused"),
    "indexer_loss": ("triton", "cudnn", "unfused"),
    "indexer_kl_bwd": ("cudnn", "triton", "unfused"),
    "compressor": ("triton", "unfused"),
    "rope": ("triton", "unfused"),
    "norm_rope": ("triton", "unfused"),
    "rms_norm": ("triton", "unfused"),
    "dense_attention": ("flash_attn", "cudnn", "triton", "torch_sdpa", "unfused"),
    "dense_attention_block_fwd": ("flash_attn", "triton", "torch_sdpa", "unfused"),
    "dense_attention_block_bwd": ("flash_attn", "triton", "torch_sdpa", "unfused"),
    "decode_attention": ("triton", "unfused"),
    "decode_indexer_scores": ("triton", "unfused"),
    # Came after the table: Triton's few-rows kernel first (its probe declines more than 64 rows).
    "fp8_gemm": ("triton", "torch_scaled_mm", "unfused"),
    "decode_compressor": ("triton", "unfused"),  # came after the table: first the kernel, the reference last
    "decode_append": ("triton", "unfused"),  # likewise
    # Came after the table: FlashMLA's FP8 sparse decode where built, else the reference; the Triton row write.
    "paged_decode_attention": ("flashmla", "triton", "unfused"),
    "paged_rows_write": ("triton", "unfused"),
}


def test_the_auto_order_table_keeps_the_order_the_priorities_gave() -> None:
    assert {op.value: auto_order(op) for op in OpFamily} == PRIORITY_ORDER
    assert [backend.name for backend in registered_backends(OpFamily.TOPK)] == ["triton", "cudnn", "unfused"]


def test_the_auto_order_names_only_backends_that_implement_the_family(clean_registry: None) -> None:
    register_backend(Backend(name="rope_only", ops={OpFamily.ROPE: fake_sparse_attention}))
    for names, reason in ((("nope", "unfused"), "'nope' is not a registered backend"),
                          (("rope_only", "unfused"), "backend 'rope_only' has no sparse_attention_fwd implementation"),
                          (("unfused", "unfused"), "a backend is named twice")):
        with pytest.raises(ValueError, match=f"auto order for sparse_attention_fwd .*{reason}"):
            set_auto_order(OP, names)
    assert auto_order(OP) == PRIORITY_ORDER[OP.value]  # unchanged by the refusals
    # The package's own check: every registered backend that implements a family has its place in the row.
    with pytest.raises(ValueError, match=r"AUTO_ORDER\[rope\] leaves out \['rope_only'\]"):
        registry.check_auto_order()
    set_auto_order(OpFamily.ROPE, ("triton", "rope_only", "unfused"))
    registry.check_auto_order()


def counting(asked: list) -> Callable[[OpFamily, Mapping[str, Any]], Optional[str]]:
    """`fake_probe` that records every description it is asked."""
    def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
        asked.append(dict(call))
        return fake_probe(op, call)
    return probe


def test_a_choice_is_remembered_per_call_description_until_forgotten(clean_registry: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes run once per (op, requested, description); `forget_choices`, a new registration and a new
    auto order ask again; nothing is remembered during a CUDA-graph capture (a self-test declines there
    only)."""
    asked: list = []
    register_first(Backend(name="fake", ops={OP: fake_sparse_attention}, probe=counting(asked)), OP)
    for _ in range(3):
        assert resolve(OP, head_dim=64, dtype=torch.bfloat16)[0] == "fake"
        assert resolve(OP, head_dim=96, dtype=torch.bfloat16)[0] == "unfused"
    assert [call["head_dim"] for call in asked] == [64, 96]
    assert resolve(OP, "fake", head_dim=64, dtype=torch.bfloat16)[0] == "fake"  # by name: its own entry
    assert len(asked) == 3 and asked[-1]["explicit"]
    registry.forget_choices()
    resolve(OP, head_dim=64, dtype=torch.bfloat16)
    assert len(asked) == 4
    register_backend(Backend(name="other", ops={OP: fake_sparse_attention}))
    resolve(OP, head_dim=64, dtype=torch.bfloat16)
    assert len(asked) == 5
    set_auto_order(OP, auto_order(OP))
    resolve(OP, head_dim=64, dtype=torch.bfloat16)
    assert len(asked) == 6
    monkeypatch.setattr(registry, "MAX_REMEMBERED_CHOICES", 2)  # bounded: full means start again
    for rows in (1, 2, 3):
        resolve(OP, head_dim=64, kv_rows=rows)
    assert len(registry._CHOICES) <= 2
    assert len(asked) == 9
    registry.forget_choices()
    monkeypatch.setattr(registry, "capturing_now", lambda: True)  # a capture: asked every time
    for _ in range(2):
        resolve(OP, head_dim=64, dtype=torch.bfloat16)
    assert len(asked) == 11 and not registry._CHOICES


def test_a_layout_is_remembered_as_what_probes_see_of_it(clean_registry: None) -> None:
    """Probes see a `TokenLayout` as its `HostLayout` (whether it is B whole sequences of S tokens): two
    layouts of one uniform shape share a choice, a packed one is asked once more, and the probe never
    holds the layout object itself."""
    asked: list = []
    dense = OpFamily.DENSE_ATTENTION
    register_first(Backend(name="fake", ops={dense: fake_sparse_attention}, probe=counting(asked)), dense)
    cpu = torch.device("cpu")
    packed = TokenLayout.packed(torch.tensor([0, 3, 8]), 8, cpu, max_seqlen=5)
    for layout in (TokenLayout.uniform(2, 4, cpu), TokenLayout.uniform(2, 4, cpu), packed, packed):
        assert resolve(dense, head_dim=64, layout=layout)[0] == "fake"
    assert [call["layout"] for call in asked] == [HostLayout((2, 4)), HostLayout(None)]


ADAPTERS = ("cudnn", "flash_attn", "flashmla", "torch_sdpa", "triton", "unfused")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_an_adapter_imports_no_other_adapter(adapter: str) -> None:
    """Backends share rules through the registry, `probes` and the layout glue, never through each other's
    modules (so one backend's rules live in one place)."""
    source = Path(registry.__file__).with_name(f"{adapter}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
    others = {f"megatron_dsa.backends.{name}" for name in ADAPTERS if name != adapter}
    assert not imported & others, sorted(imported & others)


# ---------------------------------------------------------------- typed call descriptions
def test_a_misspelt_or_mistyped_call_key_names_the_key_and_the_family(clean_registry: None) -> None:
    with pytest.raises(CallDescriptionError, match="key 'head_dims', which the sparse_attention_fwd call "
                                                   "description does not declare \\(did you mean 'head_dim'\\?\\)"):
        dispatch(OP, head_dims=64)
    with pytest.raises(CallDescriptionError, match="key 'head_dim', which the rope call description does not "
                                                   "declare; it takes device, dtype"):
        resolve(OpFamily.ROPE, "unfused", head_dim=64)
    with pytest.raises(CallDescriptionError, match="sparse_attention_fwd call description's 'heads' must be int"):
        resolve(OP, heads=64.0)
    with pytest.raises(CallDescriptionError, match="may not set 'explicit': the dispatcher sets it"):
        resolve(OP, explicit=True)
    with pytest.raises(CallDescriptionError, match="key 'lse_grad', which the sparse_attention_fwd"):
        Backend(name="direct", ops={OP: fake_sparse_attention}).decline_reason(OP, {"lse_grad": True})


def test_a_probe_reading_an_undeclared_key_raises_instead_of_declining(clean_registry: None) -> None:
    """`call.get("head_dims")` in a probe is a bug: an error naming the key and the family, not a `None`
    that quietly accepts every head dim."""
    def misspelt(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
        return "too wide" if (call.get("head_dims") or 0) > 128 else None

    register_first(Backend(name="misspelt", ops={OP: fake_sparse_attention}, probe=misspelt), OP)
    with pytest.raises(CallDescriptionError, match="a probe names key 'head_dims', which the sparse_attention_fwd"):
        resolve(OP, head_dim=256)
    with pytest.raises(CallDescriptionError, match="'head_dims'"):
        resolve(OP, "misspelt", head_dim=256)


def test_every_family_declares_the_keys_its_call_sites_pass() -> None:
    """The declared keys are known keys, and device and dtype describe every family."""
    for op in OpFamily:
        assert FAMILY_KEYS[op] <= set(registry.CALL_KEYS), op
        assert {"device", "dtype"} <= FAMILY_KEYS[op], op


def test_auto_falls_back_and_logs_the_choice_once(fake_backend: Backend,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(2):
        name, _ = resolve(OP, head_dim=96)
        assert name == "unfused"
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(messages) == 1
    assert "'unfused'" in messages[0] and "fake" in messages[0] and DECLINE_REASON in messages[0]


def test_auto_falls_back_for_an_op_the_backend_lacks(fake_backend: Backend) -> None:
    name, _ = resolve(OpFamily.TOPK)
    assert name == "unfused"


def test_explicit_declining_backend_raises_with_its_reason(fake_backend: Backend) -> None:
    with pytest.raises(BackendUnavailableError, match=DECLINE_REASON):
        resolve(OP, "fake", head_dim=96)
    with pytest.raises(BackendUnavailableError, match="no topk implementation"):
        resolve(OpFamily.TOPK, "fake")


def test_explicit_unknown_backend_lists_the_choices(fake_backend: Backend) -> None:
    with pytest.raises(ValueError, match="unknown backend 'nope'") as error:
        resolve(OP, "nope")
    assert all(choice in str(error.value) for choice in ("'auto'", "'fake'", "'unfused'"))


def test_call_counters_count_per_backend_and_op_and_reset(fake_backend: Backend) -> None:
    fake = dispatch(OP, head_dim=64)
    assert fake() == "fake result"
    fake()
    dispatch(OpFamily.TOPK, "unfused")(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), 2)
    assert call_counts() == {("fake", OP.value): 2, ("unfused", OpFamily.TOPK.value): 1}
    reset_call_counts()
    assert call_counts() == {}


def test_variant_counts_show_which_kernel_of_a_backend_ran(clean_registry: None) -> None:
    """A backend with several kernels for one family counts the one it ran beside the call count; both
    reset together, and the `(backend, op)` call counts keep their keys."""
    def two_kernels(wide: bool) -> str:
        registry.count_variant("variants", OP, "wide" if wide else "narrow")
        return "ran"

    register_first(Backend(name="variants", ops={OP: two_kernels}), OP)
    kernel = dispatch(OP, head_dim=64)
    for wide in (True, False, False):
        kernel(wide)
    assert call_counts() == {("variants", OP.value): 3}
    assert variant_counts() == {("variants", OP.value, "wide"): 1, ("variants", OP.value, "narrow"): 2}
    reset_call_counts()
    assert call_counts() == {} and variant_counts() == {}


# ---------------------------------------------------------------- a whole layer
EXPECTED_OPS = {
    "W": {"rms_norm", "rope", "norm_rope", "sparse_attention_fwd"},
    "C": {"rms_norm", "rope", "norm_rope", "compressor", "indexer_scores", "topk", "selection_rows",
          "sparse_attention_fwd", "indexer_loss"},
    "H": {"rms_norm", "rope", "norm_rope", "compressor", "sparse_attention_fwd"},
    "M": {"rms_norm", "rope", "dense_attention"},
}


def tiny_config(**overrides: Any) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", **overrides)


def forward_counts(kind: str, training: bool) -> dict[tuple[str, str], int]:
    layer = HybridAttention(tiny_config(attention_backend="unfused"), kind=kind).train(training)
    hidden = torch.randn(40, 2, layer.config.hidden_size)
    reset_call_counts()
    layer(hidden)
    return call_counts()


@pytest.mark.parametrize("kind", sorted(EXPECTED_OPS))
def test_layer_forward_dispatches_the_expected_op_families(clean_registry: None, kind: str) -> None:
    counts = forward_counts(kind, training=True)
    assert {backend for backend, _ in counts} == {"unfused"}
    assert {op for _, op in counts} == EXPECTED_OPS[kind]


def test_csa_layer_computes_the_indexer_loss_only_in_training(clean_registry: None) -> None:
    counts = forward_counts("C", training=False)
    assert {op for _, op in counts} == EXPECTED_OPS["C"] - {"indexer_loss"}


@pytest.mark.parametrize("sparse_loss,forward_calls", [(True, 12), (False, 13)])
def test_a_csa_training_step_makes_the_dispatched_calls_the_architecture_doc_counts(
        clean_registry: None, sparse_loss: bool, forward_calls: int) -> None:
    """docs/architecture.md (5.3) prices the remembered choices by these counts: forward 12 dispatched calls (13
    with the dense indexer loss, whose target scores every visible entry), backward 2 more (the selection is
    scored in one chunk here)."""
    layer = HybridAttention(tiny_config(attention_backend="unfused", dsa_indexer_use_sparse_loss=sparse_loss), kind="C")
    hidden = torch.randn(40, 2, layer.config.hidden_size, requires_grad=True)
    reset_call_counts()
    out, _ = layer(hidden)
    assert sum(call_counts().values()) == forward_calls, call_counts()
    out.square().mean().backward()
    assert sum(call_counts().values()) == forward_calls + 2, call_counts()


def test_unknown_config_backend_fails_at_construction(clean_registry: None) -> None:
    with pytest.raises(ValueError, match=r"unknown backend\(s\) \['nope'\].*'unfused'"):
        HybridAttention(tiny_config(attention_backend="nope"), kind="W")


def test_auto_never_picks_the_triton_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TRITON_INTERPRET=1 on a CPU, Triton serves only calls that name it: `auto` keeps the
    unfused reference (the interpreter is a test tool, orders of magnitude slower)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    for op in (OpFamily.SPARSE_ATTENTION_FWD, OpFamily.INDEXER_SCORES, OpFamily.ROPE, OpFamily.RMS_NORM):
        assert resolve(op, device=cpu, dtype=torch.float32)[0] == "unfused"
        assert resolve(op, "triton", device=cpu, dtype=torch.float32)[0] == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    registry.forget_choices()  # what runs here changed
    with pytest.raises(BackendUnavailableError, match="Triton needs CUDA"):
        resolve(OpFamily.ROPE, "triton", device=cpu, dtype=torch.float32)


def test_the_architecture_doc_lists_auto_order_as_the_registry_has_it():
    """docs/architecture.md's table of `auto`'s order per family (section 5.2) is what `AUTO_ORDER` says:
    every family once, its backends in order."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    table = doc[doc.index("| family | `auto` tries |"):].split("\n\n")[0].splitlines()[2:]
    listed = {}
    for row in table:
        families, order = (cell.strip() for cell in row.strip("|").split("|"))
        for family in families.split(", "):
            assert family.strip("`") not in listed, f"{family} listed twice"
            listed[family.strip("`")] = tuple(name.split(" (")[0] for name in order.split(" > "))
    assert listed == {op.value: names for op, names in registry.AUTO_ORDER.items()}
