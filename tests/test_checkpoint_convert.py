"""Attention checkpoints between Megatron and our layout, TP merge/split, and the converter CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.convert import main as convert_main
from megatron_dsa.integrations.checkpoint import convert_attention, join_layers

CONFIG = HybridAttentionConfig.from_preset("tiny", num_layers=5, layer_pattern="WCHCM")


def attention_layers() -> dict[int, dict[str, torch.Tensor]]:
    return {i: HybridAttention(CONFIG, layer_number=i + 1).state_dict() for i in range(CONFIG.num_layers)}


def assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def test_megatron_round_trip_and_strict_load() -> None:
    layers = attention_layers()
    megatron = join_layers(layers, "megatron")
    megatron["embedding.word_embeddings.weight"] = torch.zeros(3, 3)
    [ours], skipped = convert_attention([megatron], CONFIG, "megatron", "ours")
    assert skipped == ["embedding.word_embeddings.weight"]
    assert_same(ours, join_layers(layers, "ours"))
    for i in range(CONFIG.num_layers):  # strict=True: every name and shape of our layer
        prefix = f"layers.{i}.self_attention."
        HybridAttention(CONFIG, layer_number=i + 1).load_state_dict(
            {k[len(prefix):]: v for k, v in ours.items() if k.startswith(prefix)})
    [back], _ = convert_attention([ours], CONFIG, "ours", "megatron")
    assert_same(back, join_layers(layers, "megatron"))


def test_tp_split_then_merge_is_identity_and_splits_heads() -> None:
    ours = join_layers(attention_layers(), "ours")
    shards, _ = convert_attention([ours], CONFIG, "ours", "megatron", tp_size=2)
    q_up = ours["layers.1.self_attention.linear_q_up_proj.weight"]
    torch.testing.assert_close(shards[1]["decoder.layers.1.self_attention.linear_q_up_proj.weight"],
                               q_up[q_up.shape[0] // 2:])
    sink = shards[0]["decoder.layers.1.self_attention.core_attention.attn_sink"]
    assert sink.shape == (CONFIG.num_attention_heads // 2,) and sink.dtype == torch.float32
    assert torch.equal(shards[0]["decoder.layers.1.self_attention.linear_q_down_proj.weight"],
                       ours["layers.1.self_attention.linear_q_down_proj.weight"])  # replicated
    [merged], _ = convert_attention(shards, CONFIG, "megatron", "ours")
    assert_same(merged, ours)


def test_transformer_engine_names_and_wrapper_prefix_are_read() -> None:
    layers = attention_layers()
    megatron = {}
    for key, value in join_layers(layers, "megatron").items():
        key = key.replace("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight")
        megatron["module." + key] = value
    megatron["module.decoder.layers.0.self_attention.linear_proj._extra_state"] = torch.empty(0)
    [ours], _ = convert_attention([megatron], CONFIG, "megatron", "ours")
    assert_same(ours, join_layers(layers, "ours"))


def test_missing_unexpected_and_misshaped_keys_are_listed_together() -> None:
    megatron = join_layers(attention_layers(), "megatron")
    prefix = "decoder.layers.1.self_attention."
    del megatron[prefix + "core_attention.indexer.linear_wq_b.weight"]
    megatron[prefix + "linear_qkv.weight"] = torch.zeros(1)
    megatron[prefix + "linear_kv_proj.weight"] = torch.zeros(7, CONFIG.hidden_size)
    with pytest.raises(ValueError) as error:
        convert_attention([megatron], CONFIG, "megatron", "ours")
    message = str(error.value)
    assert message.startswith("layer 1 (C): missing key 'core_attention.indexer.linear_wq_b.weight'")
    assert "unexpected key 'linear_qkv.weight'" in message
    assert "'linear_kv_proj.weight' has shape (7, 128), expected (32, 128)" in message


def test_layer_count_must_match_the_config() -> None:
    megatron = join_layers(attention_layers(), "megatron")
    with pytest.raises(ValueError, match=r"attention layers \[0, 1, 2, 3, 4\], the config .* expects \[0, 1, 2\]"):
        convert_attention([megatron], CONFIG.replace(num_layers=3, layer_pattern="WCH"), "megatron", "ours")


def test_cli_converts_splits_and_merges(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config_path = tmp_path / "attention.yaml"
    CONFIG.to_yaml(config_path)
    ours = join_layers(attention_layers(), "ours")
    megatron = join_layers(attention_layers(), "megatron")
    torch.save({"model": megatron, "iteration": 3}, tmp_path / "megatron.pt")
    config = ["--config", str(config_path)]
    assert convert_main(["megatron-to-ours", str(tmp_path / "megatron.pt"), str(tmp_path / "ours.pt"), *config]) == 0
    assert torch.load(tmp_path / "ours.pt").keys() == ours.keys()
    assert convert_main(["tp-split", str(tmp_path / "ours.pt"), str(tmp_path / "s.pt"), "--tp", "2", *config]) == 0
    shards = [str(tmp_path / f"s_tp{rank}.pt") for rank in range(2)]
    assert convert_main(["tp-merge", *shards, str(tmp_path / "merged.pt"), *config]) == 0
    assert_same(torch.load(tmp_path / "merged.pt"), torch.load(tmp_path / "ours.pt"))
    assert "wrote" in capsys.readouterr().out


def test_cli_reports_errors_without_a_traceback(tmp_path: Path) -> None:
    config_path = tmp_path / "attention.yaml"
    CONFIG.to_yaml(config_path)
    torch.save({"layers.0.self_attention.linear_proj.weight": torch.zeros(2, 2)}, tmp_path / "bad.pt")
    with pytest.raises(SystemExit, match="error: the state dict has attention layers"):
        convert_main(["ours-to-megatron", str(tmp_path / "bad.pt"), str(tmp_path / "o.pt"),
                      "--config", str(config_path)])
    with pytest.raises(SystemExit, match="tp-split takes one TP = 1 file"):
        convert_main(["tp-split", str(tmp_path / "bad.pt"), str(tmp_path / "o.pt"), "--config", str(config_path)])


class TrainingArguments:
    """A Python object in a checkpoint, as Megatron stores its `args` (weights_only refuses it; a
    standard type such as a Path may be allow-listed by other packages in the same process)."""


def test_cli_never_destroys_files(tmp_path: Path) -> None:
    """in == out is refused, an existing output needs --force, and a truncated, empty or pickled file
    is named for what it is (a damaged file is not a reason to turn pickle safety off)."""
    config = ["--config", str(tmp_path / "attention.yaml")]
    CONFIG.to_yaml(tmp_path / "attention.yaml")
    ours = tmp_path / "ours.pt"
    torch.save(join_layers(attention_layers(), "ours"), ours)
    before = ours.read_bytes()
    with pytest.raises(SystemExit, match="is also an input"):
        convert_main(["ours-to-megatron", str(ours), str(ours), *config])
    assert ours.read_bytes() == before
    out = tmp_path / "megatron.pt"
    out.write_bytes(b"keep me")
    with pytest.raises(SystemExit, match="exists; pass --force"):
        convert_main(["ours-to-megatron", str(ours), str(out), *config])
    assert out.read_bytes() == b"keep me"
    assert convert_main(["ours-to-megatron", str(ours), str(out), *config, "--force"]) == 0
    assert torch.load(out).keys() == join_layers(attention_layers(), "megatron").keys()
    assert not list(tmp_path.glob("*.partial"))
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "truncated.pt").write_bytes(before[: len(before) // 2])
    for damaged in ("empty.pt", "truncated.pt"):
        with pytest.raises(SystemExit, match="truncated or corrupt") as error:
            convert_main(["ours-to-megatron", str(tmp_path / damaged), str(tmp_path / "x.pt"), *config])
        assert "--trust-pickle" not in str(error.value)
    torch.save({"model": join_layers(attention_layers(), "ours"), "args": TrainingArguments()}, tmp_path / "pickled.pt")
    with pytest.raises(SystemExit, match="holds Python objects besides tensors.*--trust-pickle"):
        convert_main(["ours-to-megatron", str(tmp_path / "pickled.pt"), str(tmp_path / "y.pt"), *config])
