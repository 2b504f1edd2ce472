"""Kernel dispatch: `auto` choice and fallback, its one log line, explicit requests, call counters, and
which op families a whole layer forward of each kind dispatches."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Mapping, Optional

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import (
    Backend,
    BackendUnavailableError,
    OpFamily,
    call_counts,
    dispatch,
    register_backend,
    reset_call_counts,
    resolve,
)
from megatron_dsa.backends import registry

OP = OpFamily.SPARSE_ATTENTION_FWD
DECLINE_REASON = "head dim 96 unsupported"
LOGGER = "megatron_dsa.backends"


def fake_sparse_attention(*args: Any, **kwargs: Any) -> str:
    return "fake result"


def fake_probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    return DECLINE_REASON if call.get("head_dim") == 96 else None


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of the registry state, so registrations, logged choices and counts made by a
    test are undone afterwards."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    monkeypatch.setattr(registry, "_LOGGED_CHOICES", set())
    monkeypatch.setattr(registry, "_CALL_COUNTS", Counter())


@pytest.fixture
def fake_backend(clean_registry: None) -> Backend:
    """Outranks `unfused`; runs sparse attention only, and declines head dim 96."""
    backend = Backend(name="fake", priority=100, ops={OP: fake_sparse_attention}, probe=fake_probe)
    register_backend(backend)
    return backend


def test_auto_takes_the_accepting_higher_priority_backend(fake_backend: Backend) -> None:
    assert resolve(OP, head_dim=64) == ("fake", fake_sparse_attention)


def test_a_per_op_priority_ranks_a_backend_below_another_for_that_op_only(clean_registry: None) -> None:
    """`op_priority` (a kernel measured slower for one op) reorders `auto` for that op alone."""
    other = OpFamily.ROPE
    fast = Backend(name="fast", priority=50, ops={OP: fake_sparse_attention, other: fake_sparse_attention})
    slow_here = Backend(name="slow_here", priority=60, ops={OP: fake_sparse_attention, other: fake_sparse_attention},
                        op_priority={OP: 40})
    register_backend(fast)
    register_backend(slow_here)
    assert resolve(OP, head_dim=64)[0] == "fast"
    assert resolve(other)[0] == "slow_here"


def test_a_choice_is_remembered_per_call_description_until_forgotten(clean_registry: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes run once per (op, requested, description); a description holding a non-plain value (a
    layout object) is asked every time; `forget_choices` and a new registration ask again; nothing is
    remembered during a CUDA-graph capture (a self-test declines there only)."""
    asked = []

    def counting_probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
        asked.append(dict(call))
        return fake_probe(op, call)

    register_backend(Backend(name="fake", priority=100, ops={OP: fake_sparse_attention}, probe=counting_probe))
    for _ in range(3):
        assert resolve(OP, head_dim=64, dtype=torch.bfloat16)[0] == "fake"
        assert resolve(OP, head_dim=96, dtype=torch.bfloat16)[0] == "unfused"
    assert [call["head_dim"] for call in asked] == [64, 96]
    assert resolve(OP, "fake", head_dim=64, dtype=torch.bfloat16)[0] == "fake"  # by name: its own entry
    assert len(asked) == 3 and asked[-1]["explicit"]
    for _ in range(2):
        resolve(OP, head_dim=64, layout=object())
    assert len(asked) == 5
    registry.forget_choices()
    resolve(OP, head_dim=64, dtype=torch.bfloat16)
    assert len(asked) == 6
    register_backend(Backend(name="other", priority=1, ops={OP: fake_sparse_attention}))
    resolve(OP, head_dim=64, dtype=torch.bfloat16)
    assert len(asked) == 7
    monkeypatch.setattr(registry, "MAX_REMEMBERED_CHOICES", 2)  # bounded: full means start again
    for rows in (1, 2, 3):
        resolve(OP, head_dim=64, kv_rows=rows)
    assert len(registry._CHOICES) <= 2
    assert len(asked) == 10
    registry.forget_choices()
    monkeypatch.setattr(registry, "capturing_now", lambda: True)  # a capture: asked every time
    for _ in range(2):
        resolve(OP, head_dim=64, dtype=torch.bfloat16)
    assert len(asked) == 12 and not registry._CHOICES


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
