"""Running the Triton kernels on CPU in tests (the interpreter, and sm_90 compiles without a GPU).

The Triton interpreter cannot be switched on inside a running process: `triton.jit` fixes the mode
when it decorates, and Triton decorates its own library functions when `triton.language` is first
imported. So the interpreter tests live in `interp_*.py` files (not collected by the normal run) and
a normal test runs each file in a child pytest with `TRITON_INTERPRET=1`. The rest of the suite never
sees the variable. Run one such file directly with
`TRITON_INTERPRET=1 python -m pytest -o python_files='interp_*.py' tests/interp_triton_indexer.py`.
"""

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 600


def run_interpreted(test_file: str) -> None:
    """Run `tests/<test_file>` in a child pytest under the Triton CPU interpreter; fail with its output."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))  # this checkout
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=interp_*.py",
               str(REPO / "tests" / test_file)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    report = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"interpreted tests in {test_file} failed:\n{report}"
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert " passed" in summary and "skipped" not in summary, f"not every interpreted test ran in {test_file}:\n{report}"


def ptxas_report(ptx: str, tmp_path: Path) -> str:
    """`ptxas -v` for sm_90a on a kernel's PTX (triton bundles ptxas, so no GPU or CUDA toolkit is needed):
    its registers and spills per thread."""
    from triton.backends.nvidia.compiler import get_ptxas

    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    return subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / "kernel.o")],
                          capture_output=True, text=True, check=True).stderr


def compile_for_sm90(kernels: ModuleType, kernel_name: str, signature: dict, constexprs: dict, num_warps: int,
                     num_stages: int = 3):
    """`kernels.<kernel_name>` compiled for sm_90a as a launch specialises it (16-byte aligned pointers, integer
    sizes divisible by 16), on a machine without a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_dsa.backends.triton_kernels.lazy_jit import jitted

    names = list(signature)
    specialised = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values())
                   if kind.startswith("*") or kind == "i32"}
    source = ASTSource(fn=jitted(getattr(kernels, kernel_name)), signature=signature, attrs=specialised,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """For `interp_*.py` files: fail unless the interpreter is on, and let it read runtime loop bounds.

    triton 3.6's interpreter turns a runtime loop bound (a 1-element array) into an int with
    `int(array)`, which NumPy ≥ 2.4 rejects; `.item()` reads the same single value."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("run this file with TRITON_INTERPRET=1 (run_interpreted does)")
    from triton.runtime import interpreter as triton_interpreter

    original = triton_interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(triton_interpreter, "_patch_lang_tensor", patch_lang_tensor)

    # triton 3.9's interpreter can carry a 1-bit mask as int32 data (a vector mask `&` a scalar comparison),
    # which its own load and store then reject ("mask has unsupported dtype"). Hand them booleans.
    builder = triton_interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype == bool:
            return mask
        return triton_interpreter.TensorHandle(mask.data.astype(bool), mask.dtype)

    monkeypatch.setattr(builder, "create_masked_load", lambda self, ptrs, mask, *rest: masked_load(
        self, ptrs, as_bool(mask), *rest))
    monkeypatch.setattr(builder, "create_masked_store", lambda self, ptrs, value, mask, *rest: masked_store(
        self, ptrs, value, as_bool(mask), *rest))


@pytest.fixture
def without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton importable and the CPU interpreter off: a Triton entry point called on CPU tensors must
    refuse with the reason (a ValueError naming the op), not fail inside Triton."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
