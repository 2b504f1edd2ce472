"""Megatron `TransformerConfig` ↔ `HybridAttentionConfig` translation (duck-typed: no megatron-core needed)."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest

from megatron_dsa import HybridAttentionConfig
from megatron_dsa.integrations.megatron_config import (DSV4_FIELDS, SHARED_FIELDS, hybrid_config_from_megatron,
                                                       layer_pattern_from_ratios, to_megatron_kwargs)

TINY = HybridAttentionConfig.from_preset("tiny")
DEV_FIELDS = set(SHARED_FIELDS) | set(DSV4_FIELDS) | {"csa_compress_ratios", "cp_comm_type", "cp_partition_mode"}


def megatron(fields=None, config=TINY, **changes) -> tuple[SimpleNamespace, dict]:
    kwargs, overrides = to_megatron_kwargs(config, fields)
    return SimpleNamespace(**{**kwargs, **changes}), overrides


def same_layer(a: HybridAttentionConfig, b: HybridAttentionConfig) -> bool:
    """Equal up to the M-layer fields given explicitly on one side and derived on the other."""
    derived = ("mla_qk_head_dim", "mla_kv_lora_rank", "mla_num_query_groups")
    plain = lambda c: {**c.to_dict(), "qk_head_dim": None, "kv_lora_rank": None, "num_query_groups": None}  # noqa: E731
    return plain(a) == plain(b) and all(getattr(a, d) == getattr(b, d) for d in derived)


@pytest.mark.parametrize("fields", [None, DEV_FIELDS], ids=["released", "dev"])
@pytest.mark.parametrize("preset", ["tiny", "dsv4-flash"])
def test_round_trip(fields, preset: str) -> None:
    config = HybridAttentionConfig.from_preset(preset, attention_backend="unfused", cp_comm_type="all_gather")
    namespace, overrides = megatron(fields, config)
    assert same_layer(hybrid_config_from_megatron(namespace, **overrides), config)
    if fields is DEV_FIELDS:  # the dev config carries the pattern as its ratio list
        assert "layer_pattern" not in overrides and namespace.cp_comm_type == "allgather"


def test_conflicting_override_names_both_values() -> None:
    namespace, overrides = megatron()
    with pytest.raises(ValueError, match="conflicting values for hidden_size: the Megatron TransformerConfig "
                                         "has 128, the override 256"):
        hybrid_config_from_megatron(namespace, **{**overrides, "hidden_size": 256})


def test_unknown_and_fixed_overrides_raise() -> None:
    namespace, overrides = megatron()
    with pytest.raises(ValueError, match=r"unknown HybridAttentionConfig field\(s\) in overrides: \['o_group'\]"):
        hybrid_config_from_megatron(namespace, **overrides, o_group=2)
    with pytest.raises(ValueError, match="set_indexer_loss_scale"):
        hybrid_config_from_megatron(namespace, **overrides, indexer_loss_backward_scale=2.0)


@pytest.mark.parametrize("field, value, message", [
    ("add_bias_linear", True, "TransformerConfig.add_bias_linear must be False/None here"),
    ("softmax_scale", 0.1, "TransformerConfig.softmax_scale must be False/None here"),
    ("mtp_num_layers", 1, "TransformerConfig.mtp_num_layers must be False/None here"),
    ("experimental_attention_variant", "dsa", "experimental_attention_variant must be None or 'dsv4_hybrid'"),
    ("cp_comm_type", "a2a", "cp_comm_type must be 'p2p' or 'allgather' for every layer"),
    ("attention_backend", "sdpa", "attention_backend 'sdpa' is not one of"),
])
def test_settings_the_layer_cannot_honour_raise(field: str, value, message: str) -> None:
    namespace, overrides = megatron(**{field: value})
    with pytest.raises(ValueError, match=message):
        hybrid_config_from_megatron(namespace, **overrides)


def test_attention_backend_enum_and_per_layer_comm_type() -> None:
    backend = Enum("AttnBackend", "flash fused unfused local auto")
    namespace, overrides = megatron(attention_backend=backend.local, cp_comm_type=["allgather"] * 4)
    overrides.pop("cp_comm_type")  # now on the Megatron side
    config = hybrid_config_from_megatron(namespace, **overrides)
    assert config.attention_backend == "unfused" and config.cp_comm_type == "all_gather"
    namespace.attention_backend = backend.auto  # auto leaves the choice to the override
    assert hybrid_config_from_megatron(namespace, **overrides, attention_backend="unfused").attention_backend == "unfused"


def test_pattern_from_ratios_and_conflicts() -> None:
    # MTP entry ignored
    assert layer_pattern_from_ratios([0, 0, 4, 128, 4, 0], 5) == ("WWCHC", {"hca_compress_ratio": 128})
    assert layer_pattern_from_ratios([0, 4], 2) == ("WC", {})
    with pytest.raises(ValueError, match="mixes HCA ratios"):
        layer_pattern_from_ratios([16, 128], 2)
    with pytest.raises(ValueError, match=r"csa_compress_ratios\[1\] = 2: hca_compress_ratio must be >= 8"):
        layer_pattern_from_ratios([0, 2], 2)
    with pytest.raises(ValueError, match=r"csa_compress_ratios\[0\] = 'x' names no layer kind: W takes 0, C takes 4, "
                                         r"H takes hca_compress_ratio"):
        layer_pattern_from_ratios(["x"], 1)
    namespace, overrides = megatron(DEV_FIELDS)
    overrides.pop("hca_compress_ratio")
    with pytest.raises(ValueError, match="conflicting values for layer_pattern: csa_compress_ratios gives 'WCHC'"):
        hybrid_config_from_megatron(namespace, "WCCC", **overrides)
    namespace.csa_compress_ratios = None
    with pytest.raises(ValueError, match="give layer_pattern"):
        hybrid_config_from_megatron(namespace, **overrides)


def test_integration_imports_without_megatron_core_and_names_the_extra() -> None:
    """Blocks `megatron` in a fresh interpreter: the package imports, building asks for the extra."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['megatron'] = None\n"
            "import megatron_dsa.integrations.megatron as m, megatron_dsa.convert\n"
            "try:\n    m.hybrid_layer_spec(None)\nexcept ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == 'this needs megatron-core: pip install "megatron_dsa[megatron]"'
