"""Configs, examples and the user guide stay in sync with the code.

Every YAML in configs/ loads and validates; every example imports and runs two steps at tiny size;
the guide's config reference is the generated one and its troubleshooting messages are the ones
the package raises; the README's test command is the one CI runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.integrations import megatron as integration
from megatron_dsa.integrations.checkpoint import convert_attention, join_layers
from megatron_dsa.integrations.megatron_config import hybrid_config_from_megatron, to_megatron_kwargs
from megatron_dsa.checkpointing import CheckpointWriter, load_checkpoint
from megatron_dsa.packed_seq import PackedSeqParams, validate_packed_seq_params
from megatron_dsa.parallel import consistency
from megatron_dsa.parallel.context import ContextParallelPlan
from megatron_dsa.parallel.linear import divide
from megatron_dsa.train import JobConfig, check_launch

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.py"))
GUIDE = (REPO_ROOT / "docs" / "user_guide.md").read_text()
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"_doc_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_expected_configs_and_examples_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "tiny_tp2_sp.yaml", "tiny_cp2.yaml", "dsv4_flash.yaml",
                                         "dsv4_pro.yaml"}
    assert {p.name for p in EXAMPLES} >= {"train_tiny.py", "megatron_pretrain.py", "long_context_cp.py"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_validates_and_is_documented(path: Path) -> None:
    job = JobConfig.from_yaml(path)
    assert HybridAttentionConfig.from_yaml(path) == job.attention
    assert f"`{path.name}`" in GUIDE, f"{path.name} is missing from docs/user_guide.md section 2"


@pytest.mark.parametrize("name, preset", [("tiny", "tiny"), ("dsv4_flash", "dsv4-flash"), ("dsv4_pro", "dsv4-pro"),
                                          ("dsv4_flash_release", "dsv4-flash-release"),
                                          ("dsv4_pro_release", "dsv4-pro-release")])
def test_preset_configs_equal_their_presets(name: str, preset: str) -> None:
    assert JobConfig.from_yaml(REPO_ROOT / "configs" / f"{name}.yaml").attention == HybridAttentionConfig.from_preset(preset)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_imports_and_has_a_main(path: Path) -> None:
    module = load_module(path)
    assert callable(module.main) and module.__doc__


def run_example(*command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step\s+2:?\s+\|?\s*loss (\d+\.\d+)", result.stdout)]
    assert losses and all(0 < loss < 10 for loss in losses), result.stdout[-2000:]
    return result


def test_train_tiny_example_runs() -> None:
    run_example("examples/train_tiny.py", "--steps", "2")


def test_long_context_cp_example_runs_on_two_gloo_ranks() -> None:
    out = run_example("-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/long_context_cp.py",
                      "--config", "configs/tiny_cp2.yaml", "--steps", "2").stdout
    assert "CP 2: 4 rows of 1024 tokens, 512 per rank" in out


@pytest.mark.skipif(not HAVE_MEGATRON, reason='megatron-core is not installed (pip install -e ".[megatron]")')
def test_megatron_pretrain_example_runs() -> None:
    result = run_example("examples/megatron_pretrain.py", "--config", "configs/tiny.yaml", "--steps", "2")
    assert "indexer KL (C layers)" in result.stdout
    assert "Warning" not in result.stderr, result.stderr  # megatron-core's notes are filtered, ours fixed


def test_config_reference_in_the_guide_is_current() -> None:
    tool = load_module(REPO_ROOT / "tools" / "config_reference.py")
    assert tool.current_section(GUIDE) == tool.render(), "run: python tools/config_reference.py --write"


TINY = HybridAttentionConfig.from_preset("tiny")


def megatron_namespace(**changes) -> tuple[SimpleNamespace, dict]:
    kwargs, overrides = to_megatron_kwargs(TINY)
    return SimpleNamespace(**{**kwargs, **changes}), overrides


def broken_checkpoint() -> None:
    state = join_layers({i: HybridAttention(TINY, layer_number=i + 1).state_dict() for i in range(4)}, "megatron")
    del state["decoder.layers.1.self_attention.core_attention.indexer.linear_wq_b.weight"]
    convert_attention([state], TINY, "megatron", "ours")


def rotary_into_adapter() -> None:
    namespace, _ = megatron_namespace()
    layer = integration.MegatronHybridAttention(namespace, 1, hybrid_config=TINY, pg_collection=SimpleNamespace())
    layer(torch.randn(8, 1, TINY.hidden_size), rotary_pos_emb=torch.zeros(1))

def damaged_checkpoint() -> None:
    """A saved checkpoint with 16 bytes of its shard file flipped, loaded from a relative path."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    with tempfile.TemporaryDirectory() as root:
        previous = os.getcwd()
        os.chdir(root)
        try:
            writer = CheckpointWriter(Path("run"), None)
            writer.save(1, model, optimizer, {"step": 1})
            shard = writer.wait() / "__0_0.distcp"
            data = bytearray(shard.read_bytes())
            data[:16] = bytes(255 - b for b in data[:16])
            shard.write_bytes(bytes(data))
            load_checkpoint(Path("run/checkpoints/step-000001"), model, optimizer, None)
        finally:
            os.chdir(previous)


def different_configs_on_two_ranks() -> None:
    """What `check_same_on_all_ranks` raises when rank 1 of 2 has another window (gathered values given)."""
    gathered = [{"attention.csa_window_size": 16}, {"attention.csa_window_size": 8}]
    raise consistency.mismatch_error("the job's configuration", gathered, [0, 1])



TRIGGERS = [
    lambda: HybridAttentionConfig.from_dict({"o_group": 2}),
    lambda: HybridAttentionConfig(num_layers=4, layer_pattern="WCH"),
    lambda: HybridAttention(TINY, kind="C")(torch.randn(8, 1, TINY.hidden_size, dtype=torch.bfloat16)),
    lambda: HybridAttention(TINY, kind="C")(torch.randn(8, 1, TINY.hidden_size),
                                            packed_seq_params=PackedSeqParams(cu_seqlens_q=torch.tensor([0, 8]))),
    lambda: divide(4, 8, "num_attention_heads"),
    lambda: ContextParallelPlan.build([1001], 2),
    lambda: hybrid_config_from_megatron(megatron_namespace(add_bias_linear=True)[0], **megatron_namespace()[1]),
    lambda: hybrid_config_from_megatron(megatron_namespace()[0], **{**megatron_namespace()[1], "hidden_size": 256}),
    rotary_into_adapter,
    lambda: HybridAttention(TINY, kind="W")(torch.randn(8, 1, TINY.hidden_size),
                                            attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool)),
    lambda: megatron_position_check(torch.arange(8).expand(1, 8) + 5),
    broken_checkpoint,
    lambda: validate_packed_seq_params(PackedSeqParams(cu_seqlens_q=torch.tensor([0, 6, 6, 15], dtype=torch.int32),
                                                       cu_seqlens_kv=torch.tensor([0, 6, 7, 15], dtype=torch.int32)), 15),
    lambda: check_launch(2, 1),
    damaged_checkpoint,
    different_configs_on_two_ranks,
]


def megatron_position_check(position_ids: torch.Tensor) -> None:
    integration.check_position_ids(position_ids, None, (1, 8))


def troubleshooting_messages() -> list[str]:
    section = GUIDE.split("## 8. Troubleshooting", 1)[1]
    return re.findall(r"^\| `(.+?)` \|", section, re.M)


def test_troubleshooting_quotes_the_raised_messages() -> None:
    documented = troubleshooting_messages()
    raised = []
    for trigger in TRIGGERS:
        with pytest.raises((ValueError, TypeError)) as error:
            trigger()
        raised.append(str(error.value))
    raised.append(integration.INSTALL_HINT)  # raised by require_megatron() when megatron-core is missing
    assert documented == raised


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    command = re.search(r"^    (python -m pip install .* && python -m pytest -q)$", readme, re.M).group(1)
    assert command in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
