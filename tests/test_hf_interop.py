"""DeepSeek-V4 checkpoints from Hugging Face / the release: config, FP8 dequantization, the converter,
and output parity with transformers' own implementation.

Parity runs transformers' `DeepseekV4Attention` and a whole small `DeepseekV4ForCausalLM` on CPU in
float64 with random weights. transformers computes its RMS norms, rotations and indexer scores in
float32 inside a float64 model, so agreement is at float32 level: observed max |ours − theirs| is
about 1e-6 for outputs of magnitude ~8 (~1.5e-7 relative); the bound is 1e-5 relative. Top-k: transformers uses
`torch.topk` (unspecified order among equal scores), ours is stable (the lower entry wins), so
inputs are checked tie-free: every query's k-th and (k+1)-th visible indexer scores differ by far
more than float32 rounding. The transformers tests skip without transformers (`pip install
"megatron_dsa[hf]"`); the released-format test also needs accelerate (transformers' FP8 loader).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.config import PRESETS
from megatron_dsa.integrations.hf import (HF_CONFIG_FIELDS, NAMES, NAMINGS, dequantize_fp8, detect_naming,
                                          from_hf_config)

OFFICIAL_NAMES = NAMINGS["official"].from_ours()

# The released config.json values that concern attention (DeepSeek-V4-Flash and -Pro).
_RELEASED_ROPE = {"rope_theta": 10000, "compress_rope_theta": 160000,
                  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                   "original_max_position_embeddings": 65536, "type": "yarn"},
                  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}
RELEASED = {
    "dsv4-flash-release": dict(
        model_type="deepseek_v4", hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6,
        max_position_embeddings=1048576, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], **_RELEASED_ROPE),
    "dsv4-pro-release": dict(
        model_type="deepseek_v4", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
        sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=1024, rms_norm_eps=1e-6,
        max_position_embeddings=1048576, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0], **_RELEASED_ROPE),
}


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_released_configs_give_the_release_presets(preset: str) -> None:
    """The MTP layer's trailing ratio is ignored; the RoPE is the release's, not the recipe's."""
    config = from_hf_config(RELEASED[preset])
    expected = HybridAttentionConfig.from_preset(preset)
    assert {f: getattr(config, f) for f in HF_CONFIG_FIELDS} == {f: getattr(expected, f) for f in HF_CONFIG_FIELDS}
    recipe = HybridAttentionConfig.from_preset(preset.removesuffix("-release"))
    assert recipe.layer_pattern == expected.layer_pattern
    assert (recipe.csa_compress_rotary_base, recipe.rotary_scaling_factor) == (40000.0, 4.0)
    assert (expected.csa_compress_rotary_base, expected.rotary_scaling_factor) == (160000.0, 16.0)
    assert set(PRESETS) >= {preset, preset.removesuffix("-release")}


def test_transformers_style_config_and_overrides() -> None:
    values = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25,
                  o_groups=2, index_head_dim=16,
                  layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                  rope_parameters={"main": {"rope_type": "default", "rope_theta": 20000.0},
                                   "compress": {"rope_type": "yarn", "rope_theta": 80000.0, "factor": 2.0,
                                                "original_max_position_embeddings": 512, "attention_factor": 1.0}})
    config = from_hf_config(values, dsa_indexer_loss_coeff=0.01)
    assert (config.layer_pattern, config.hca_compress_ratio, config.qk_pos_emb_head_dim) == ("WCH", 16, 8)
    assert (config.rotary_base, config.csa_compress_rotary_base, config.rotary_scaling_factor) == (20000.0, 80000.0, 2.0)
    assert config.original_max_position_embeddings == 512 and config.dsa_indexer_loss_coeff == 0.01
    unscaled = from_hf_config({**values, "rope_parameters": None})  # no YaRN: plain rotations everywhere
    assert (unscaled.rotary_scaling_factor, unscaled.csa_compress_rotary_base) == (1.0, 160000.0)


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=None), "no per-layer attention kinds: expected 'layer_types'"),
    (dict(compress_rates={"compressed_sparse_attention": 8}), "our C layers .* compress by 4"),
    (dict(layer_types=None, compress_ratios=[0, 16, 32]), r"compress_ratios mixes HCA ratios \[16, 32\]: H layers "
                                                          r"take one ratio per model"),
    (dict(layer_types=None, compress_ratios=[0, 4, 2]), r"compress_ratios\[2\] = 2: hca_compress_ratio must be >= 8"),
    (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]), "unknown \\['full_attention'\\]"),
    (dict(num_key_value_heads=2), "num_key_value_heads is 2"),
    (dict(rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                        "attention_factor": 1.2}), "attention_factor 1.2"),
    (dict(rope_parameters={"main": {"rope_type": "yarn"}, "compress": {}}), "sliding-window rope is 'yarn'"),
    (dict(model_type="deepseek_v3"), "model_type is 'deepseek_v3'"),
])
def test_config_errors_name_the_key(change: dict, message: str) -> None:
    values = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
                  o_groups=2, layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    with pytest.raises(ValueError, match=message):
        from_hf_config({**values, **change})


def test_fp8_dequantization_is_exact_blockwise() -> None:
    """Power-of-two scales times FP8 values are exact in float32; ragged edge blocks are covered."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(20, 36, generator=gen).to(torch.float8_e4m3fn)
    exponents = torch.randint(-6, 4, (3, 5), generator=gen)
    expected = weight.float().clone()
    for i in range(3):
        for j in range(5):
            expected[8 * i:8 * i + 8, 8 * j:8 * j + 8] *= 2.0 ** exponents[i, j].item()
    scale = torch.exp2(exponents.float())
    assert torch.equal(dequantize_fp8(weight, scale, (8, 8)), expected)
    assert torch.equal(dequantize_fp8(weight, scale.to(torch.float8_e8m0fnu), (8, 8)), expected)
    assert torch.equal(dequantize_fp8(weight, (exponents + 127).to(torch.uint8), (8, 8), "ue8m0"), expected)
    with pytest.raises(ValueError, match=r"w: block scale has shape \(3, 5\), expected \(2, 3\)"):
        dequantize_fp8(weight, scale, (16, 16), name="w")
    with pytest.raises(ValueError, match="scale_fmt = 'ue8m0'"):
        dequantize_fp8(weight, (exponents + 127).to(torch.uint8), (8, 8))


def test_naming_is_detected_or_both_are_listed() -> None:
    assert detect_naming(["model.layers.0.self_attn.q_a_proj.weight", "lm_head.weight"]) == "hf"
    assert detect_naming(["layers.0.attn.wq_a.weight", "mtp.0.attn.wq_a.weight"]) == "official"
    with pytest.raises(ValueError, match="neither of the known namings: hf .*; official .*layers.0.attn.wq_a"):
        detect_naming(["decoder.layers.0.self_attention.linear_qkv.weight"])


# ------------------------------------------------------------------------------ transformers parity

KIND_TO_TYPE = {"W": "sliding_attention", "C": "compressed_sparse_attention", "H": "heavily_compressed_attention"}
SEQLEN, BATCH, WINDOW, TOPK, CSA_RATIO = 41, 2, 6, 3, 4


def require_transformers():
    """transformers with DeepSeek-V4 (5.24 and later), or skip."""
    return pytest.importorskip("transformers", minversion="5.24")


def small_hf_config(pattern: str):
    transformers = require_transformers()
    config = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(pattern), num_attention_heads=4,
        head_dim=32, q_lora_rank=48, partial_rotary_factor=0.25, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=[KIND_TO_TYPE[k] for k in pattern], sliding_window=WINDOW, o_groups=2, o_lora_rank=16,
        compress_rates={"compressed_sparse_attention": CSA_RATIO, "heavily_compressed_attention": 8},
        index_n_heads=16, index_head_dim=16, index_topk=TOPK, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        compress_rope_theta=160000.0)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the grouped-GEMM default has no float64
    return config


def randomize_attention_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter of every `DeepseekV4Attention` in `module` random (transformers initialises
    sinks and position biases to 0, norms to 1)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attention in (m for m in module.modules() if isinstance(m, DeepseekV4Attention)):
            for name, param in attention.named_parameters():
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
                param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


def assert_tie_free(scores: torch.Tensor, topk: int = TOPK, ratio: int = CSA_RATIO) -> None:
    """`scores [B, S, T]` (transformers' indexer, before masking): where top-k truncates, the k-th and
    (k+1)-th visible scores differ by far more than float32 rounding."""
    for t in range(scores.shape[1]):
        visible = (t + 1) // ratio
        if visible > topk:
            ranked = scores[:, t, :visible].sort(dim=-1, descending=True).values
            gap = (ranked[:, topk - 1] - ranked[:, topk]).abs().min().item()
            assert gap > 1e-4 * ranked.abs().max().item(), f"query {t}: near-tie at the top-{topk} boundary"


def record_indexer_scores(model: torch.nn.Module) -> list[torch.Tensor]:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    scores: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, DeepseekV4IndexerScorer):
            module.register_forward_hook(lambda _m, _args, out: scores.append(out.detach()))
    return scores


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * expected.abs().max().item(), f"{what}: max abs error {error:.3e}"
    return error


def save_safetensors(state: dict[str, torch.Tensor], directory: Path, config_values: dict) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config_values))
    return directory


def convert(checkpoint: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    from megatron_dsa.convert import main as convert_main

    assert convert_main(["hf-to-ours", str(checkpoint), str(out), "--dtype", "fp32", *extra]) == 0
    return torch.load(out)


def our_layers(state: dict[str, torch.Tensor], config: HybridAttentionConfig) -> list[HybridAttention]:
    layers = []
    for index in range(config.num_layers):
        prefix = f"layers.{index}.self_attention."
        layer = HybridAttention(config, layer_number=index + 1).double()
        layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})  # strict
        layers.append(layer)
    return layers


@pytest.mark.parametrize("kind", ["W", "C", "H"])
def test_each_kind_matches_transformers(kind: str, tmp_path: Path) -> None:
    """One `DeepseekV4Attention` per kind, saved in transformers' naming, converted, run on the same input."""
    pytest.importorskip("safetensors")
    require_transformers()
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    config = small_hf_config(kind)
    theirs = DeepseekV4Attention(config, layer_idx=0).double()
    randomize_attention_(theirs, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, SEQLEN, config.hidden_size, generator=gen, dtype=torch.float64)
    positions = torch.arange(SEQLEN).expand(BATCH, -1)
    rotary = DeepseekV4RotaryEmbedding(config).double()
    cos_sin = {name: rotary(x, positions, layer_type=name) for name in ("main", "compress")}
    i = torch.arange(SEQLEN)
    window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)  # key j visible to query t
    mask = torch.zeros(SEQLEN, SEQLEN, dtype=torch.float64).masked_fill(~window, float("-inf"))
    scores = record_indexer_scores(theirs)
    with torch.no_grad():
        expected = theirs(x, cos_sin, positions, mask.expand(BATCH, 1, -1, -1))[0]
    if kind == "C":
        assert_tie_free(scores[0])
    state = {f"model.layers.0.self_attn.{k}": v for k, v in theirs.state_dict().items()}
    checkpoint = save_safetensors(state, tmp_path / "hf", config.to_dict())
    ours = convert(checkpoint, tmp_path / "ours.pt")
    [layer] = our_layers(ours, from_hf_config(config.to_dict()))
    with torch.no_grad():
        actual = layer(x.transpose(0, 1))[0].transpose(0, 1)
    error = assert_close_to(actual, expected, kind)
    print(f"{kind}: max abs error {error:.2e} (output max {expected.abs().max():.2f})")


def run_and_record(model: torch.nn.Module, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every layer's attention in one forward pass of a transformers model."""
    records: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [layer.self_attn.register_forward_hook(
        lambda _m, args, out: records.append((args[0].detach(), out[0].detach())))
        for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    return records


def assert_stack_matches(records, layers: list[HybridAttention], config: HybridAttentionConfig) -> None:
    assert len(records) == len(layers) == config.num_layers
    for index, ((x, expected), layer) in enumerate(zip(records, layers)):
        with torch.no_grad():
            actual = layer(x.transpose(0, 1))[0].transpose(0, 1)
        what = f"layer {index} ({config.layer_pattern[index]})"
        print(f"{what}: max abs error {assert_close_to(actual, expected, what):.2e} "
              f"(output max {expected.abs().max():.2f})")


def small_model(pattern: str, seed: int):
    transformers = require_transformers()
    config = small_hf_config(pattern)
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).double().eval()
    randomize_attention_(model, seed)
    return model, config


def test_model_stack_matches_transformers_through_hooks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A whole `DeepseekV4ForCausalLM` saved by transformers (release naming under `model.`, MoE and
    hyper-connections left out); its attention inputs and outputs are recorded with hooks."""
    pytest.importorskip("safetensors")
    model, hf_config = small_model("WCHCW", seed=3)
    model.save_pretrained(tmp_path / "hf")
    input_ids = torch.randint(0, hf_config.vocab_size, (BATCH, SEQLEN), generator=torch.Generator().manual_seed(4))
    scores = record_indexer_scores(model)
    records = run_and_record(model, input_ids)
    for layer_scores in scores:
        assert_tie_free(layer_scores)
    from megatron_dsa.convert import main as convert_main

    assert convert_main(["hf-to-ours", str(tmp_path / "hf"), str(tmp_path / "ours.pt"), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "in the official naming: 5 attention layers (WCHCW)" in out and "left out" in out
    config = HybridAttentionConfig.from_yaml(tmp_path / "ours.yaml")
    assert config == from_hf_config(tmp_path / "hf" / "config.json")
    merged = tmp_path / "merged.pt"
    shards = [str(tmp_path / f"ours_tp{rank}.pt") for rank in range(2)]
    assert convert_main(["tp-merge", *shards, str(merged), "--config", str(tmp_path / "ours.yaml")]) == 0
    assert_stack_matches(records, our_layers(torch.load(merged), config), config)


def quantize_fp8_(tensors: dict[str, torch.Tensor], keys: list[str], block: int, scale_name: str,
                  e8m0: bool) -> None:
    """Replace `keys` by FP8 weights and per-block power-of-two scales (the release's format)."""
    for key in keys:
        weight = tensors[key].float()
        rows, cols = weight.shape
        blocks = weight.reshape(rows // block, block, cols // block, block)
        scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)) / 448.0)))
        tensors[key] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        tensors[key.removesuffix("weight") + scale_name] = scale.to(torch.float8_e8m0fnu) if e8m0 else scale


def test_released_format_fp8_checkpoint_matches_transformers(tmp_path: Path) -> None:
    """transformers' saver writes the release naming; the main projections are then stored as FP8 with
    e8m0 block scales (`.scale`), as released. transformers loads that checkpoint with its own FP8
    dequantizer; ours converts it; both run the same input. The same weights in transformers' FP8
    naming (`weight_scale_inv`, float32 scales) convert to the same tensors."""
    pytest.importorskip("safetensors")
    require_transformers()
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    model, hf_config = small_model("WCH", seed=5)
    model.float().save_pretrained(tmp_path / "saved")
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    projections = [k for k in tensors if k.split(".attn.")[-1] in
                   ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight", "indexer.wq_b.weight")]
    assert len(projections) == 5 * 3 + 1
    quantize_fp8_(tensors, projections, block=16, scale_name="scale", e8m0=True)
    values = json.loads((tmp_path / "saved" / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [16, 16], "activation_scheme": "dynamic"}
    release = save_safetensors(tensors, tmp_path / "release", values)
    theirs = DeepseekV4ForCausalLM.from_pretrained(
        release, dtype=torch.float32, experts_implementation="eager",
        quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(16, 16)))
    theirs = theirs.double().eval()
    input_ids = torch.randint(0, hf_config.vocab_size, (BATCH, SEQLEN), generator=torch.Generator().manual_seed(6))
    scores = record_indexer_scores(theirs)
    records = run_and_record(theirs, input_ids)
    assert_tie_free(scores[0])
    ours = convert(release, tmp_path / "ours.pt")
    config = from_hf_config(values)
    assert_stack_matches(records, our_layers(ours, config), config)

    to_hf = {official: hf for hf, official in NAMES.values()} | {"norm.weight": "kv_norm.weight"}
    hf_named = {}
    for key, value in tensors.items():
        prefix, attention, name = key.partition(".attn.")
        if not attention:
            continue
        if name.endswith(".scale"):
            weight = to_hf[name.removesuffix("scale") + "weight"]
            hf_named[f"{prefix}.self_attn.{weight}_scale_inv"] = value.float()
        else:
            hf_named[f"{prefix}.self_attn.{to_hf[name]}"] = value
    hf_values = {**values, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    hf_checkpoint = save_safetensors(hf_named, tmp_path / "hf_fp8", hf_values)
    assert torch.load(tmp_path / "ours.pt").keys() == convert(hf_checkpoint, tmp_path / "from_hf.pt").keys()
    from_hf = torch.load(tmp_path / "from_hf.pt")
    assert all(torch.equal(from_hf[k], ours[k]) for k in ours)


def test_ours_to_hf_round_trips_in_both_namings(tmp_path: Path) -> None:
    """ours → hf / official safetensors → ours is the identity; the hf names are transformers' own."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    from megatron_dsa.convert import main as convert_main

    model, hf_config = small_model("WCH", seed=7)
    values = hf_config.to_dict()
    config = from_hf_config(values)
    ours = {f"layers.{i}.self_attention.{k}": v.float() for i in range(3)
            for k, v in HybridAttention(config, layer_number=i + 1).state_dict().items()}
    torch.save(ours, tmp_path / "ours.pt")
    config.to_yaml(tmp_path / "attention.yaml")
    for naming in NAMINGS:
        out = tmp_path / naming / "model.safetensors"
        assert convert_main(["ours-to-hf", str(tmp_path / "ours.pt"), str(out), "--config",
                             str(tmp_path / "attention.yaml"), "--naming", naming]) == 0
        if naming == "hf":
            transformers_keys = {k for k in model.state_dict() if ".self_attn." in k}
            assert set(load_file(str(out))) == transformers_keys
        (out.parent / "config.json").write_text(json.dumps(values))
        back = convert(out.parent, tmp_path / f"back_{naming}.pt")
        assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_converter_keeps_its_safety_rules(tmp_path: Path) -> None:
    """in == out refused, --force to replace, a damaged file named, a missing block scale named."""
    pytest.importorskip("safetensors")
    from megatron_dsa.convert import main as convert_main

    values = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
                  q_lora_rank=48, o_groups=2, o_lora_rank=16, sliding_window=6, layer_types=["sliding_attention"])
    config = from_hf_config(values)
    state = {f"layers.0.attn.{OFFICIAL_NAMES[k]}": v for k, v in HybridAttention(config, kind="W").state_dict().items()}
    checkpoint = save_safetensors(state, tmp_path / "ckpt", values)
    weights = checkpoint / "model.safetensors"
    before = weights.read_bytes()
    with pytest.raises(SystemExit, match="is also an input"):
        convert_main(["hf-to-ours", str(checkpoint), str(weights)])
    assert weights.read_bytes() == before
    (tmp_path / "ours.pt").write_bytes(b"keep me")
    with pytest.raises(SystemExit, match="ours.pt exists; pass --force"):
        convert_main(["hf-to-ours", str(checkpoint), str(tmp_path / "ours.pt")])
    assert convert_main(["hf-to-ours", str(checkpoint), str(tmp_path / "ours.pt"), "--force"]) == 0
    assert not list(tmp_path.glob("*.partial"))
    weights.write_bytes(before[: len(before) // 2])
    with pytest.raises(SystemExit, match="model.safetensors.*truncated or corrupt"):
        convert_main(["hf-to-ours", str(checkpoint), str(tmp_path / "x.pt")])
    state["layers.0.attn.wq_a.weight"] = state["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    save_safetensors(state, checkpoint, values)
    with pytest.raises(SystemExit, match="'layers.0.attn.wq_a.weight' is FP8 .* no block scale 'layers.0.attn.wq_a.scale'"):
        convert_main(["hf-to-ours", str(checkpoint), str(tmp_path / "y.pt")])
    del state["layers.0.attn.wq_a.weight"]
    state["layers.0.attn.wqkv.weight"] = torch.zeros(1)
    save_safetensors(state, checkpoint, values)
    with pytest.raises(SystemExit, match=r"layer 0 \(W\): missing key 'linear_q_down_proj.weight'; "
                                         r"unexpected key 'wqkv.weight'"):
        convert_main(["hf-to-ours", str(checkpoint), str(tmp_path / "z.pt")])

