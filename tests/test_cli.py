"""The command line (`python -m megatron_dsa`) and the layer benchmark script run and print their tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dsa.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def test_module_info_lists_the_unfused_backend() -> None:
    result = run_python("-m", "megatron_dsa", "info")
    assert result.returncode == 0, result.stderr
    assert "unfused" in result.stdout and "sparse_attention" in result.stdout
    assert "torch" in result.stdout and "device:" in result.stdout
    assert "triton sparse attention forward and backward (bf16, 64 heads, D = 512):" in result.stdout


def test_main_info_returns_zero(capsys: pytest.CaptureFixture) -> None:
    assert main(["info"]) == 0
    assert "megatron_dsa" in capsys.readouterr().out


def test_help_lists_the_commands(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "info" in capsys.readouterr().out


def test_layer_benchmark_prints_every_kind_against_the_baseline() -> None:
    result = run_python("benchmarks/layer.py", "--seq-len", "64", "--repeats", "1", "--warmup", "0")
    assert result.returncode == 0, result.stderr
    assert "| baseline ms |" in result.stdout
    for kind in "WCHM":
        assert f"| {kind} |" in result.stdout


def test_layer_benchmark_times_a_stack_of_chained_layers() -> None:
    result = run_python("benchmarks/layer.py", "--seq-len", "64", "--repeats", "1", "--warmup", "0",
                        "--kinds", "C", "--stack", "2")
    assert result.returncode == 0, result.stderr
    assert "row of 2 chained layer(s)" in result.stdout and "| C |" in result.stdout
