"""The command line (`megatron-dsa` = `python -m megatron_dsa`: train, convert, generate, info), packaged configs
found from any directory, and the layer benchmark script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dsa import __main__ as cli
from megatron_dsa.__main__ import main
from megatron_dsa.packaged_configs import CONFIG_DIR, packaged_configs, preset_config, resolve_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def exit_of(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """`main(argv)`'s exit status (returned or raised), stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_lists_every_command(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = exit_of(["--help"], capsys)
    assert code == 0
    for command in ("train", "convert", "generate", "info"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), out


@pytest.mark.parametrize("command, option", [("train", "--preset"), ("convert", "--trust-pickle"),
                                             ("generate", "--top-p"), ("info", "--verbose")])
def test_each_command_has_its_own_help(command: str, option: str, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = exit_of([command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: megatron-dsa {command}") and option in out


def test_train_convert_and_generate_share_their_modules_parsers(capsys: pytest.CaptureFixture) -> None:
    from megatron_dsa import convert, generate, train

    for module, command in ((train, "train"), (convert, "convert"), (generate, "generate")):
        with pytest.raises(SystemExit):
            module.main(["--help"])
        module_help = capsys.readouterr().out
        code, cli_help, _ = exit_of([command, "--help"], capsys)
        assert code == 0
        # Past the usage lines (wrapped by the program name's length) the help is the module's.
        assert cli_help.split("\n\n", 1)[1] == module_help.split("\n\n", 1)[1]


def test_the_console_script_is_this_main() -> None:
    scripts = (REPO_ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    assert re.match(r"\s*megatron-dsa = \"megatron_dsa\.__main__:main\"\n", scripts), scripts[:200]


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    code, _, err = exit_of(["generate-everything"], capsys)
    assert code == 2 and "invalid choice: 'generate-everything'" in err


def test_python_m_runs_the_commands_from_another_directory(tmp_path: Path) -> None:
    result = run_python("-m", "megatron_dsa", "train", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: megatron-dsa train") and "--preset" in result.stdout
    result = run_python("-m", "megatron_dsa.train", "--help", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m megatron_dsa.train")


def test_train_preset_trains_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here: the preset is the packaged tiny.yaml
    code, out, err = exit_of(["train", "--preset", "tiny", "--steps", "2", "--out", "run"], capsys)
    assert code == 0
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [step["step"] for step in history["steps"]] == [0, 1]
    assert "done: 2 steps" in out and (tmp_path / "run" / "checkpoints").is_dir()
    # stderr is not a terminal here: plain log lines on stdout, no progress bar anywhere
    assert re.search(r"^step +1 \| loss", out, re.M) and "it/s" not in out + err and "\r" not in out + err


def test_unknown_preset_lists_the_packaged_ones(capsys: pytest.CaptureFixture) -> None:
    code, _, err = exit_of(["train", "--preset", "tiny-moe", "--steps", "1"], capsys)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("megatron-dsa train: error: unknown preset 'tiny-moe'")
    for name in ("tiny", "tiny-cp2", "tiny-tp2-sp", "dsv4-flash", "dsv4-pro"):
        assert name in line


def test_missing_config_lists_the_packaged_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = exit_of(["train", "--config", "configs/tyni.yaml"], capsys)
    assert code == 2
    assert "config file configs/tyni.yaml not found" in err and "tiny.yaml, tiny_cp2.yaml" in err


def test_config_and_preset_exclude_each_other(capsys: pytest.CaptureFixture) -> None:
    code, _, err = exit_of(["train", "--preset", "tiny", "--config", "configs/tiny.yaml"], capsys)
    assert code == 2 and "not allowed with argument" in err


def test_packaged_configs_are_the_repository_configs() -> None:
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(p.name for p in (REPO_ROOT / "configs").glob("*.yaml"))
    assert set(packaged_configs()) >= {"tiny", "tiny-cp2", "tiny-tp2-sp", "dsv4-flash", "dsv4-pro"}
    assert preset_config("tiny_cp2") == preset_config("tiny-cp2") == CONFIG_DIR / "tiny_cp2.yaml"


def test_config_names_resolve_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_config("configs/tiny.yaml") == resolve_config("tiny.yaml") == CONFIG_DIR / "tiny.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text("train: {steps: 3}\n")
    assert resolve_config("configs/tiny.yaml") == Path("configs/tiny.yaml")  # a file that exists wins
    with pytest.raises(FileNotFoundError, match="elsewhere/tiny.yaml not found"):
        resolve_config("elsewhere/tiny.yaml")  # a directory the user named is never swapped for ours


def test_convert_finds_a_packaged_config_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    from megatron_dsa import HybridAttention, HybridAttentionConfig
    from megatron_dsa.integrations.checkpoint import join_layers

    config = HybridAttentionConfig.from_preset("tiny")
    layers = {i: HybridAttention(config, layer_number=i + 1).state_dict() for i in range(config.num_layers)}
    torch.save(join_layers(layers, "ours"), tmp_path / "ours.pt")
    monkeypatch.chdir(tmp_path)
    code, out, err = exit_of(["convert", "ours-to-megatron", "ours.pt", "megatron.pt", "--config",
                              "configs/tiny.yaml"], capsys)
    assert code == 0, err
    assert "wrote megatron.pt" in out and (tmp_path / "megatron.pt").is_file()


# ---------------------------------------------------------------- info
@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_info_fits_a_100_column_terminal(verbose: bool, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = exit_of(["info", "--verbose"] if verbose else ["info"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert lines[0].startswith("megatron_dsa ") and lines[1].startswith(f"torch {torch.__version__}")
    assert re.search(r"^  unfused +yes: all op families$", out, re.M) or verbose
    backends = {"unfused", "torch_sdpa", "triton", "cudnn", "flashmla", "flash_attn"}
    assert all(re.search(rf"^ *{name}\b", out, re.M) for name in backends), out
    detail = "triton sparse attention forward and backward (bf16, 64 heads, D = 512):"
    assert (detail in out) == verbose
    # auto's order table, one row per op family, with its pick for a call on this machine's device
    assert re.search(r"^  sparse_attention_fwd +flashmla > cudnn > triton > unfused +\w+$", out, re.M), out
    assert re.search(r"^  dense_attention +flash_attn > cudnn > triton > torch_sdpa > unfused +\w+$", out, re.M), out
    assert torch.cuda.is_available() or re.search(r"^  rope +triton > unfused +unfused$", out, re.M), out


def test_info_on_a_cuda_build_without_a_device_does_not_contradict_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = cli.describe_info().splitlines()
    assert lines[1] == f"torch {torch.__version__}, built with CUDA 13.0"
    assert lines[2] == "device: cpu (no CUDA device visible)"


def test_info_headline_drops_details_and_marks_the_cut() -> None:
    assert cli.headline("package cudnn not importable (ModuleNotFoundError: No module named 'cudnn'); "
                        "install the [cudnn] extra") == "package cudnn not importable; …"
    assert cli.headline("tensors on cpu, Triton needs CUDA (or TRITON_INTERPRET=1 (tests))") == \
        "tensors on cpu, Triton needs CUDA"


def test_layer_benchmark_prints_every_kind_against_the_baseline() -> None:
    result = run_python("benchmarks/layer.py", "--seq-len", "64", "--repeats", "1", "--warmup", "0")
    assert result.returncode == 0, result.stderr
    assert "| baseline ms |" in result.stdout
    for kind in "WCHM":
        assert f"| {kind} |" in result.stdout


def test_layer_benchmark_runs_fp8_projections_and_the_fp8_error_table() -> None:
    result = run_python("benchmarks/layer.py", "--seq-len", "32", "--repeats", "1", "--warmup", "0", "--kinds", "W",
                        "--projection-precision", "fp8")
    assert result.returncode == 0, result.stderr
    assert "projections fp8" in result.stdout and "fp8_gemm=unfused" in result.stdout
    result = run_python("benchmarks/fp8_error.py", "--seq-len", "32", "--kinds", "W")
    assert result.returncode == 0, result.stderr
    assert "| W | output |" in result.stdout and "| W | grad linear_proj.weight |" in result.stdout
    assert "W: fp8_gemm=unfused" in result.stdout


def test_layer_parts_benchmark_sets_the_m_layer_against_its_attention_and_projections() -> None:
    result = run_python("benchmarks/layer_parts.py", "--preset", "tiny", "--dims", "preset", "--seq-len", "48",
                        "--dtype", "float32", "--repeats", "1", "--warmup", "0")
    assert result.returncode == 0, result.stderr
    assert "| dense attention (unfused) |" in result.stdout  # the backend the layer's own step counted
    for weight in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"):
        assert f"| {weight}.weight [" in result.stdout
    assert "| **parts** |" in result.stdout and "| eager |" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine is told")
def test_benchmarks_refuse_gpu_sizes_and_devices_on_a_cpu_only_machine() -> None:
    """A clear usage error, not a CUDA assertion from deep inside the run or an hour at GPU sizes."""
    requests = [(f"benchmarks/{script}", ["--device", "cuda"], "CUDA is not available")
                for script in ("layer.py", "decode.py", "fp8_error.py", "layer_parts.py")]
    for script, args, message in requests + [("benchmarks/decode.py", [], "pass --smoke for a small CPU run")]:
        result = run_python(script, *args)
        assert result.returncode == 2 and message in result.stderr, (script, args, result.stderr)
    result = run_python("benchmarks/host_cost.py", "--help")
    assert result.returncode == 0 and "usage: host_cost.py" in result.stdout, result.stderr


def test_decode_benchmark_smoke_mode_prints_its_table() -> None:
    result = run_python("benchmarks/decode.py", "--smoke", "--kinds", "CW", "--projection-precision", "native", "fp8")
    assert result.returncode == 0, result.stderr
    assert "| kind | projections | B | context | eager µs | graph µs |" in result.stdout
    for kind, batch, context in (("C", 1, 64), ("C", 2, 200), ("W", 2, 64)):
        for precision in ("native", "fp8"):
            assert f"| {kind} | {precision} | {batch} | {context} |" in result.stdout
    assert "decode_attention=unfused" in result.stdout  # the decode step ran (auto on the CPU)
    assert "C (fp8): " in result.stdout and "fp8_gemm=unfused" in result.stdout


def test_layer_benchmark_times_a_stack_of_chained_layers() -> None:
    result = run_python("benchmarks/layer.py", "--seq-len", "64", "--repeats", "1", "--warmup", "0",
                        "--kinds", "C", "--stack", "2")
    assert result.returncode == 0, result.stderr
    assert "row of 2 chained layer(s)" in result.stdout and "| C |" in result.stdout
