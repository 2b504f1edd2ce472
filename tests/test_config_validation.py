"""Config fields are checked for type and range, and YAML mistakes become one-line errors naming
the field, the value and the rule (never a truthy string, a NaN, or a traceback from deep inside)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from megatron_dsa import HybridAttentionConfig
from megatron_dsa import train
from megatron_dsa.model import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]

BAD_ATTENTION = [
    (dict(csa_dense_mode="false"), "csa_dense_mode must be true or false, got 'false'"),
    (dict(qk_layernorm="false"), "qk_layernorm must be true or false"),
    (dict(dsa_indexer_use_sparse_loss=1), "dsa_indexer_use_sparse_loss must be true or false"),
    (dict(num_layers="4"), "num_layers must be an integer, got '4'"),
    (dict(num_attention_heads=4.0), "num_attention_heads must be an integer"),
    (dict(rotary_base=0), "rotary_base must be > 0"),
    (dict(rotary_base=-10000.0), "rotary_base must be > 0"),
    (dict(csa_compress_rotary_base=0), "csa_compress_rotary_base must be > 0"),
    (dict(original_max_position_embeddings=0), "original_max_position_embeddings must be > 0"),
    (dict(dsa_indexer_loss_coeff=math.nan), "dsa_indexer_loss_coeff must be a finite number, got nan"),
    (dict(layernorm_epsilon=math.inf), "layernorm_epsilon must be a finite number, got inf"),
    (dict(layernorm_epsilon="tiny"), "layernorm_epsilon must be a finite number, got 'tiny'"),
    (dict(beta_fast=1.0, beta_slow=32.0), r"beta_fast \(1.0\) must be greater than beta_slow \(32.0\)"),
    (dict(init_method_std=0.0), "init_method_std must be > 0"),
    (dict(attention_backend=3), "attention_backend must be a string"),
]


@pytest.mark.parametrize("changes,message", BAD_ATTENTION, ids=[str(c) for c, _ in BAD_ATTENTION])
def test_bad_attention_fields_name_the_field_value_and_rule(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        HybridAttentionConfig.from_preset("tiny", **changes)


def test_unambiguous_values_are_converted() -> None:
    config = HybridAttentionConfig.from_preset("tiny", layernorm_epsilon="1e-5", rotary_base=10000)
    assert config.layernorm_epsilon == 1e-5 and isinstance(config.rotary_base, float)
    assert ModelConfig.from_dict(None) == ModelConfig()  # an empty YAML section: the defaults


def test_yaml_mistakes_are_clear(tmp_path) -> None:
    job = yaml.safe_load((REPO_ROOT / "configs" / "tiny.yaml").read_text())
    assert isinstance(yaml.safe_load("x: 1e-5")["x"], str)  # YAML 1.1: no dot, no float
    job["attention"]["layernorm_epsilon"] = "1e-5"
    assert train.JobConfig.from_dict(job).attention.layernorm_epsilon == 1e-5
    with pytest.raises(TypeError, match="job config is a mapping"):
        train.JobConfig.from_dict(["hello"])
    with pytest.raises(TypeError, match="HybridAttentionConfig needs a mapping"):
        train.JobConfig.from_dict({**job, "attention": ["hidden_size", 128]})
    with pytest.raises(TypeError, match="train: section must be a mapping"):
        train.JobConfig.from_dict({**job, "train": "fast"})
    with pytest.raises(ValueError, match="train.steps must be an integer|steps must be an integer"):
        train.JobConfig.from_dict({**job, "train": {**job["train"], "steps": "300"}})


def test_the_cli_reports_a_config_mistake_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("attention:\n  csa_dense_mode: 'false'\n")
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", str(path)])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("error: csa_dense_mode must be true or false, got 'false' (a str)")
    path.write_text("- a list\n- not a mapping\n")
    with pytest.raises(SystemExit):
        train.main(["--config", str(path)])
    assert "job config is a mapping" in capsys.readouterr().err
