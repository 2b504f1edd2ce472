"""Layer API: parameter inventory (docs/math.md §3, §4, §10, §13), precision of kept-fp32 parameters, state-dict
round trips, config validation, YAML, presets and input checking of `forward`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_dsa import HybridAttention, HybridAttentionConfig
from reference_layer import randomize_parameters_

KINDS = ("W", "C", "H", "M")
KEPT_FP32 = ("attn_sink", "ape")


def tiny(**overrides) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", **overrides)


# ------------------------------------------------------------------------------ inventory
def expected_inventory(c: HybridAttentionConfig, kind: str) -> dict[str, tuple[int, ...]]:
    """Parameter names (relative to the attention module) and shapes from docs/math.md §3, §4, §10 (W/C/H) and
    Megatron's MLASelfAttention (M)."""
    d, heads, rq, p, dv = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.qk_pos_emb_head_dim, c.v_head_dim
    if kind == "M":
        qk = c.qk_head_dim if c.qk_head_dim is not None else dv - p
        rank = c.kv_lora_rank if c.kv_lora_rank is not None else dv - p
        groups = c.num_query_groups if c.num_query_groups is not None else heads
        return {
            "linear_q_down_proj.weight": (rq, d),
            "q_layernorm.weight": (rq,),
            "linear_q_up_proj.weight": (heads * (qk + p), rq),
            "linear_kv_down_proj.weight": (rank + p, d),
            "kv_layernorm.weight": (rank,),
            "linear_kv_up_proj.weight": (groups * (qk + dv), rank),
            "linear_proj.weight": (d, heads * dv),
        }
    g, ro = c.o_groups, c.o_lora_rank
    shapes = {
        "linear_q_down_proj.weight": (rq, d),
        "q_layernorm.weight": (rq,),
        "linear_q_up_proj.weight": (heads * dv, rq),
        "linear_kv_proj.weight": (dv, d),
        "kv_layernorm.weight": (dv,),
        "linear_o_group_proj": (g * ro, heads * dv // g),
        "linear_proj.weight": (d, g * ro),
        "core_attention.attn_sink": (heads,),
    }
    ratio = {"W": 0, "C": 4, "H": c.hca_compress_ratio}[kind]
    if ratio:
        coff = 2 if ratio == 4 else 1
        shapes.update({
            "core_attention.compressor.linear_wkv.weight": (coff * dv, d),
            "core_attention.compressor.linear_wgate.weight": (coff * dv, d),
            "core_attention.compressor.ape": (ratio, coff * dv),
            "core_attention.compressor.norm.weight": (dv,),
        })
    if kind == "C" and not c.csa_dense_mode:
        hi, di = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        shapes.update({
            "core_attention.indexer.linear_wq_b.weight": (hi * di, rq),
            "core_attention.indexer.linear_weights_proj.weight": (hi, d),
            "core_attention.indexer.compressor.linear_wkv.weight": (2 * di, d),
            "core_attention.indexer.compressor.linear_wgate.weight": (2 * di, d),
            "core_attention.indexer.compressor.ape": (4, 2 * di),
            "core_attention.indexer.compressor.norm.weight": (di,),
        })
    return shapes


def meta_layer(config: HybridAttentionConfig, kind: str) -> HybridAttention:
    with torch.device("meta"):
        return HybridAttention(config, kind=kind)


def inventory(layer: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in layer.named_parameters()}


@pytest.mark.parametrize("preset", ["dsv4-flash", "dsv4-pro"])
@pytest.mark.parametrize("kind", KINDS)
def test_parameter_inventory(preset, kind):
    config = HybridAttentionConfig.from_preset(preset)
    layer = meta_layer(config, kind)
    assert inventory(layer) == expected_inventory(config, kind)
    assert set(layer.state_dict()) == set(expected_inventory(config, kind))


def test_flash_and_pro_shapes_quoted_in_the_spec():
    """The dsv4-flash and dsv4-pro shapes of the recipes (guards the formula above as well as the layer)."""
    flash = HybridAttentionConfig.from_preset("dsv4-flash")
    flash_c = inventory(meta_layer(flash, "C"))
    assert flash_c["linear_q_down_proj.weight"] == (1024, 4096)
    assert flash_c["linear_q_up_proj.weight"] == (32768, 1024)
    assert flash_c["linear_kv_proj.weight"] == (512, 4096)
    assert flash_c["linear_o_group_proj"] == (8192, 4096)
    assert flash_c["linear_proj.weight"] == (4096, 8192)
    assert flash_c["core_attention.compressor.linear_wkv.weight"] == (1024, 4096)
    assert flash_c["core_attention.compressor.ape"] == (4, 1024)
    assert flash_c["core_attention.indexer.linear_wq_b.weight"] == (8192, 1024)
    assert flash_c["core_attention.indexer.linear_weights_proj.weight"] == (64, 4096)
    assert flash_c["core_attention.indexer.compressor.linear_wkv.weight"] == (256, 4096)
    assert flash_c["core_attention.indexer.compressor.ape"] == (4, 256)
    flash_h = inventory(meta_layer(flash, "H"))
    assert flash_h["core_attention.compressor.linear_wkv.weight"] == (512, 4096)
    assert flash_h["core_attention.compressor.ape"] == (128, 512)

    pro = inventory(meta_layer(HybridAttentionConfig.from_preset("dsv4-pro"), "C"))
    assert pro["linear_q_down_proj.weight"] == (1536, 7168)
    assert pro["linear_q_up_proj.weight"] == (65536, 1536)
    assert pro["linear_o_group_proj"] == (16384, 4096)
    assert pro["linear_proj.weight"] == (7168, 16384)
    assert pro["core_attention.attn_sink"] == (128,)


@pytest.mark.parametrize("kind", ["W", "H"])
def test_window_and_hca_layers_have_no_indexer(kind):
    layer = meta_layer(HybridAttentionConfig.from_preset("dsv4-flash"), kind)
    assert layer.core_attention.indexer is None
    assert (layer.core_attention.compressor is None) == (kind == "W")


def test_csa_dense_mode_builds_no_indexer():
    config = HybridAttentionConfig.from_preset("dsv4-flash", csa_dense_mode=True)
    assert inventory(meta_layer(config, "C")) == expected_inventory(config, "C")
    assert not any(".indexer." in name for name in inventory(meta_layer(config, "C")))


def test_mla_inventory_with_gqa_and_distinct_head_dims():
    config = tiny(num_query_groups=2, qk_head_dim=16, kv_lora_rank=24)
    assert inventory(HybridAttention(config, kind="M")) == expected_inventory(config, "M")


@pytest.mark.parametrize("preset", ["dsv4-flash", "dsv4-pro"])
@pytest.mark.parametrize("kind", ["C", "H"])
def test_bfloat16_cast_keeps_sink_and_ape_fp32_on_meta(preset, kind):
    layer = meta_layer(HybridAttentionConfig.from_preset(preset), kind).bfloat16()
    for name, param in layer.named_parameters():
        expected = torch.float32 if name.endswith(KEPT_FP32) else torch.bfloat16
        assert param.dtype == expected, name


# ------------------------------------------------------------------------------ precision
@pytest.mark.parametrize("cast", ["bfloat16", "half", "to_bfloat16"])
@pytest.mark.parametrize("kind", ["W", "C", "H"])
def test_low_precision_cast_keeps_sink_and_ape_values(kind, cast):
    layer = HybridAttention(tiny(), kind=kind)
    randomize_parameters_(layer, seed=3)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    if cast == "to_bfloat16":
        layer.to(torch.bfloat16)
    else:
        getattr(layer, cast)()
    kept = [n for n in before if n.endswith(KEPT_FP32)]
    assert "core_attention.attn_sink" in kept
    for name, param in layer.named_parameters():
        if name in kept:
            assert param.dtype == torch.float32, name
            assert torch.equal(param.detach(), before[name]), f"{name} values changed"
        else:
            assert param.dtype == (torch.float16 if cast == "half" else torch.bfloat16), name


@pytest.mark.parametrize("kind", ["C", "H"])
def test_kept_params_return_to_fp32_after_a_double_round_trip(kind):
    """`.double()` may upcast attn_sink / ape, but `.float()` must bring every parameter back to fp32
    (torch's `Module.float` contract), and a following `.bfloat16()` must leave them fp32 (the
    sink and `ape` are kept fp32, docs/math.md §4), not float64."""
    layer = HybridAttention(tiny(), kind=kind).double().float()
    assert {p.dtype for p in layer.parameters()} == {torch.float32}
    layer = HybridAttention(tiny(), kind=kind).double().bfloat16()
    for name, param in layer.named_parameters():
        if name.endswith(KEPT_FP32):
            assert param.dtype == torch.float32, f"{name} is {param.dtype} after double().bfloat16()"


# ------------------------------------------------------------------------------ state dict
@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_strict(kind):
    config = tiny(num_query_groups=2) if kind == "M" else tiny()
    source = HybridAttention(config, kind=kind).double()
    randomize_parameters_(source, seed=5)
    target = HybridAttention(config, kind=kind).double()
    state = source.state_dict()
    assert set(state) == set(expected_inventory(config, kind))
    assert "rotary_inv_freq" not in state  # derived table, not checkpointed
    target.load_state_dict(state, strict=True)
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    x = torch.randn(24, 2, config.hidden_size, dtype=torch.float64)
    assert torch.equal(source.eval()(x)[0], target.eval()(x)[0])


def test_state_dict_of_another_kind_is_rejected():
    state = HybridAttention(tiny(), kind="C").state_dict()
    with pytest.raises(RuntimeError):
        HybridAttention(tiny(), kind="H").load_state_dict(state, strict=True)


@pytest.mark.parametrize("kind", KINDS)
def test_no_qk_layernorm_gives_identity(kind):
    layer = HybridAttention(tiny(qk_layernorm=False), kind=kind)
    assert isinstance(layer.q_layernorm, nn.Identity)
    assert isinstance(layer.kv_layernorm, nn.Identity)
    names = set(layer.state_dict())
    assert "q_layernorm.weight" not in names and "kv_layernorm.weight" not in names
    expected = {n for n in expected_inventory(tiny(), kind) if not n.endswith("_layernorm.weight")}
    assert names == expected


# ------------------------------------------------------------------------------ config validation
INVALID_CONFIGS = {
    "o_groups-not-dividing-H*D": (dict(o_groups=3), "o_groups"),
    "o_groups-not-dividing-H": (dict(o_groups=8), "o_groups"),  # divides H·D = 128, not H = 4
    "odd-P": (dict(qk_pos_emb_head_dim=7), "qk_pos_emb_head_dim"),
    "P-equals-D": (dict(qk_pos_emb_head_dim=32), "qk_pos_emb_head_dim"),
    "P-above-D": (dict(qk_pos_emb_head_dim=40), "qk_pos_emb_head_dim"),
    "hca-ratio-4": (dict(hca_compress_ratio=4), "hca_compress_ratio"),
    "hca-ratio-0": (dict(hca_compress_ratio=0), "hca_compress_ratio"),
    "bad-symbol": (dict(layer_pattern="WCXC"), "layer_pattern"),
    "bad-symbol-short": (dict(layer_pattern="W?"), "layer_pattern"),
    "pattern-length": (dict(layer_pattern="WCH"), "layer_pattern"),  # 3 symbols, 4 layers
    "empty-pattern": (dict(layer_pattern=""), "layer_pattern"),
    "gqa-not-dividing": (dict(num_query_groups=3), "num_query_groups"),
    "rope-type": (dict(rope_type="linear"), "rope_type"),
}


@pytest.mark.parametrize("case", list(INVALID_CONFIGS))
def test_config_validation_names_the_field(case):
    overrides, field = INVALID_CONFIGS[case]
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


@pytest.mark.parametrize("layer_number", [0, 5, -1])
def test_layer_number_out_of_range(layer_number):
    with pytest.raises(ValueError, match="layer_number"):
        HybridAttention(tiny(), layer_number=layer_number)


def test_kind_conflicting_with_pattern():
    assert tiny().layer_pattern == "WCHC"
    with pytest.raises(ValueError, match="kind") as error:
        HybridAttention(tiny(), layer_number=1, kind="C")
    assert "layer_pattern" in str(error.value)
    assert HybridAttention(tiny(), layer_number=1, kind="W").kind.value == "W"  # agreeing is fine


def test_kind_or_layer_number_is_required():
    with pytest.raises(ValueError, match="layer_number"):
        HybridAttention(tiny())


def test_bad_kind_symbol():
    with pytest.raises(ValueError, match="X"):
        HybridAttention(tiny(), kind="X")


def test_layer_number_reads_the_pattern():
    kinds = [HybridAttention(tiny(), layer_number=n).kind.value for n in range(1, 5)]
    assert kinds == list("WCHC")


# ------------------------------------------------------------------------------ YAML / presets
def test_yaml_round_trip(tmp_path):
    config = tiny(layer_pattern="WCHM", csa_dense_mode=True, rope_type="rope", num_query_groups=2,
                  qk_head_dim=16, calculate_per_token_loss=True, indexer_loss_backward_scale=2.5)
    path = tmp_path / "attention.yaml"
    config.to_yaml(path)
    assert HybridAttentionConfig.from_yaml(path) == config


def test_yaml_job_config_attention_section(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("attention:\n  hidden_size: 64\n  num_attention_heads: 2\n  q_lora_rank: 32\n"
                    "  v_head_dim: 32\n  qk_pos_emb_head_dim: 8\n  o_groups: 2\n  dsa_indexer_head_dim: 16\n"
                    "  layer_pattern: HC\n  num_layers: 2\n")
    config = HybridAttentionConfig.from_yaml(path)
    assert config.hidden_size == 64 and config.layer_pattern == "HC"


def test_yaml_unknown_field_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("hidden_size: 64\nnot_a_field: 1\n")
    with pytest.raises(ValueError, match="not_a_field"):
        HybridAttentionConfig.from_yaml(path)


def test_presets_load_and_match_the_recipes():
    tiny_config = tiny()
    assert set(tiny_config.layer_pattern) == set("WCH")
    flash = HybridAttentionConfig.from_preset("dsv4-flash")
    assert (flash.hidden_size, flash.num_attention_heads, flash.v_head_dim, flash.qk_pos_emb_head_dim,
            flash.q_lora_rank, flash.o_groups, flash.o_lora_rank, flash.csa_window_size) == \
        (4096, 64, 512, 64, 1024, 8, 1024, 128)
    assert (flash.dsa_indexer_n_heads, flash.dsa_indexer_head_dim, flash.dsa_indexer_topk) == (64, 128, 512)
    assert flash.num_layers == 43 and flash.csa_compress_ratios == [0, 0, 4] + [128, 4] * 20
    pro = HybridAttentionConfig.from_preset("dsv4-pro")
    assert (pro.hidden_size, pro.num_attention_heads, pro.q_lora_rank, pro.o_groups, pro.dsa_indexer_topk) == \
        (7168, 128, 1536, 16, 1024)
    assert pro.num_layers == 61 and pro.csa_compress_ratios == [128, 128, 4] + [128, 4] * 29
    with pytest.raises(ValueError, match="preset"):
        HybridAttentionConfig.from_preset("dsv4-huge")


# ------------------------------------------------------------------------------ forward input
@pytest.fixture(params=["W", "C", "M"])
def small_layer(request):
    return HybridAttention(tiny(), kind=request.param)


@pytest.mark.parametrize("shape", [(8, 2, 127), (8, 2, 129), (8, 128), (8, 2, 1, 128), (128,)])
def test_forward_rejects_wrong_shapes(small_layer, shape):
    with pytest.raises(ValueError, match="hidden_states"):
        small_layer(torch.randn(shape))


@pytest.mark.parametrize("shape", [(0, 2, 128), (8, 0, 128)])
def test_forward_rejects_empty_input(small_layer, shape):
    with pytest.raises(ValueError, match="hidden_states"):
        small_layer(torch.randn(shape))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
def test_forward_rejects_wrong_dtype(small_layer, dtype):
    with pytest.raises(TypeError, match="hidden_states"):
        small_layer(torch.zeros(8, 2, 128, dtype=dtype))


@pytest.mark.parametrize("value", [[[0.0] * 128], None, 3.0])
def test_forward_rejects_non_tensors(small_layer, value):
    with pytest.raises(TypeError, match="hidden_states"):
        small_layer(value)


def test_forward_returns_output_and_no_bias(small_layer):
    out, bias = small_layer(torch.randn(8, 2, 128))
    assert out.shape == (8, 2, 128) and out.dtype == torch.float32 and bias is None


@pytest.mark.parametrize("hook", ["module", "global"])
def test_kv_layernorm_hooks_run(hook):
    """The K = V rows take kv_layernorm's weight into one fused norm + RoPE op; a forward hook on the
    norm (its own or a global one) must still see the call, and the result must not change."""
    torch.manual_seed(0)
    layer = HybridAttention(tiny(), kind="C").double()
    randomize_parameters_(layer, seed=0)
    x = torch.randn(16, 2, layer.config.hidden_size, dtype=torch.float64)
    expected = layer(x)[0]
    seen = []
    record = lambda module, args, out: seen.append(module) if module is layer.kv_layernorm else None  # noqa: E731
    handle = (layer.kv_layernorm.register_forward_hook(record) if hook == "module"
              else nn.modules.module.register_module_forward_hook(record))
    try:
        out = layer(x)[0]
    finally:
        handle.remove()
    assert seen == [layer.kv_layernorm]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
