"""Direct launches of compiled Triton kernels (`backends.triton_kernels.lazy_jit.KernelLauncher`).

CPU: the launcher's bookkeeping against a stand-in kernel (Triton's binder, kernel cache and compiled
kernel replaced by recording fakes): which launches go through Triton, which go straight to the compiled
kernel, and with which arguments. GPU: real kernels, direct against Triton's launches, bit for bit,
including a misaligned input (another specialization, so another compiled kernel) and a whole C layer.
"""

from collections import Counter
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from megatron_dsa.backends.triton_kernels import lazy_jit  # noqa: E402
from distributed import cosine, relative_error  # noqa: E402


class _Compiled:
    """A compiled kernel that records its launches."""

    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self, log: list):
        self.log = log

    def run(self, *launch_args):
        self.log.append(("direct", launch_args))


class _Kernel(JITFunction):
    """A jitted kernel `(x, n, BLOCK: constexpr)` whose binder specializes `n` on divisibility by 16, as
    Triton's does, and whose own launch path (`kernel[grid](...)`) records the call."""

    def __init__(self):  # no source to parse: only what the launcher reads
        self.pre_run_hooks, self.used_global_vals, self.debug = [], {}, False
        self.log: list = []
        self.compiled: dict = {}
        self.device_caches = {}

    def _binder(self, x, n, BLOCK, **options):
        specialization = [("*fp32", "D"), ("i32", "D" if n % 16 == 0 else ""), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, specialization, options

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("triton", grid, args, options))
            self.device_caches.setdefault(0, (None, None, None, None, self._binder))
            bound, specialization, _ = self._binder(*args, **options)
            key = (tuple(specialization), tuple(sorted(options.items())))
            return self.compiled.setdefault(key, _Compiled(self.log))

        return launch


def _fake_triton(hooks: list = ()) -> SimpleNamespace:
    """Stand-ins for `triton.knobs` (launch hooks with `hooks` installed) and the active driver."""
    chain = SimpleNamespace(calls=list(hooks))
    knobs = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=SimpleNamespace(calls=[]),
                                                    debug=False),
                            compilation=SimpleNamespace(instrumentation_mode=""))
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 77)
    return SimpleNamespace(knobs=knobs, driver=SimpleNamespace(active=active))


@pytest.fixture
def kernel(monkeypatch):
    """A `(stand-in kernel, its launcher)` pair on a mirrored Triton version with no hooks."""
    monkeypatch.setattr(lazy_jit, "_version_mirrored", lambda: True)
    monkeypatch.setattr(lazy_jit, "DIRECT_LAUNCH", True)
    stand_in = _Kernel()
    launcher = lazy_jit.KernelLauncher(stand_in)
    fake = _fake_triton()
    launcher._knobs, launcher._driver = fake.knobs, fake.driver
    return stand_in, launcher


def _paths(log: list) -> list:
    return [entry[0] for entry in log]


def test_second_launch_of_a_specialization_goes_straight_to_the_compiled_kernel(kernel):
    stand_in, launcher = kernel
    launcher[(4, 2)]("x0", 32, BLOCK=8, num_warps=4)
    launcher[(4, 2)]("x1", 48, BLOCK=8, num_warps=4)  # 48 % 16 == 0: same specialization
    assert _paths(stand_in.log) == ["triton", "direct"]
    # grid (padded to 3-D), the current stream, the compiled function and metadata, no launch metadata or
    # hooks, then every bound argument in parameter order (constexprs included, as Triton passes them).
    assert stand_in.log[1][1] == (4, 2, 1, 77, "function-handle", "packed-metadata", None, None, None,
                                  "x1", 48, 8)


def test_another_specialization_or_options_go_through_triton_first(kernel):
    stand_in, launcher = kernel
    launcher[(1,)]("x", 32, BLOCK=8)
    launcher[(1,)]("x", 33, BLOCK=8)  # n not divisible by 16: another compiled kernel
    launcher[(1,)]("x", 32, BLOCK=16)  # another constexpr
    launcher[(1,)]("x", 32, BLOCK=8, num_warps=8)  # another option
    launcher[(1,)]("x", 17, BLOCK=8)  # the second one again
    assert _paths(stand_in.log) == ["triton", "triton", "triton", "triton", "direct"]
    assert lazy_jit.LAUNCHES["direct"] >= 1


def test_unchanged_global_values_keep_the_direct_path(kernel):
    stand_in, launcher = kernel
    stand_in.used_global_vals = {("G", 0): (1, {"G": 1})}
    launcher[(1,)]("x", 32, BLOCK=8)
    launcher[(1,)]("x", 32, BLOCK=8)
    assert _paths(stand_in.log) == ["triton", "direct"]


def test_a_callable_grid_gets_the_bound_arguments(kernel):
    stand_in, launcher = kernel
    grid = lambda bound: (bound["n"] // bound["BLOCK"],)  # noqa: E731
    launcher[grid]("x", 32, BLOCK=8)
    launcher[grid]("x", 64, BLOCK=8)
    assert stand_in.log[1][0] == "direct" and stand_in.log[1][1][:3] == (8, 1, 1)


@pytest.mark.parametrize("case", ["switched off", "launch hook", "pre-run hook", "changed global value",
                                  "version not mirrored"])
def test_triton_path_kept(kernel, monkeypatch, case):
    """Each condition keeps every launch on Triton's path (module docstring)."""
    stand_in, launcher = kernel
    if case == "switched off":
        monkeypatch.setattr(lazy_jit, "DIRECT_LAUNCH", False)
    elif case == "launch hook":
        launcher._knobs = _fake_triton(hooks=[print]).knobs
    elif case == "pre-run hook":
        stand_in.pre_run_hooks.append(print)
    elif case == "changed global value":
        stand_in.used_global_vals = {("G", 0): (1, {"G": 2})}  # compiled with G = 1, now G = 2
    else:
        monkeypatch.setattr(lazy_jit, "_version_mirrored", lambda: False)
        launcher = lazy_jit.KernelLauncher(stand_in)
    for _ in range(3):
        launcher[(1,)]("x", 32, BLOCK=8)
    assert _paths(stand_in.log) == ["triton"] * 3


def test_launcher_is_made_once_per_kernel_and_jits_plain_functions():
    def plain_kernel(x):  # never launched
        pass

    made = lazy_jit.launcher(plain_kernel)
    assert made is lazy_jit.launcher(plain_kernel)
    assert made.kernel is lazy_jit.jitted(plain_kernel)


# ---------------------------------------------------------------- GPU
def _rms_norm_pair(x: torch.Tensor, weight: torch.Tensor, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton's launches, direct launches) of the Triton RMSNorm forward on `x`."""
    from megatron_dsa.backends.triton_kernels import rms_norm

    monkeypatch.setattr(lazy_jit, "DIRECT_LAUNCH", False)
    through_triton = rms_norm.rms_norm(x, weight, 1e-6)
    monkeypatch.setattr(lazy_jit, "DIRECT_LAUNCH", True)
    rms_norm.rms_norm(x, weight, 1e-6)  # first launch of this specialization: through Triton
    before = lazy_jit.LAUNCHES.copy()
    direct = rms_norm.rms_norm(x, weight, 1e-6)
    _assert_expected_path_ran(before, launches=1)
    return through_triton, direct


def _assert_expected_path_ran(before: Counter, launches: Optional[int] = None) -> None:
    """The launches since `before` went direct on a mirrored Triton version and through Triton on any other
    (where direct launches are off by design); `launches`: how many, if known."""
    path, other = ("direct", "triton") if lazy_jit._version_mirrored() else ("triton", "direct")
    ran = lazy_jit.LAUNCHES[path] - before[path]
    assert ran == launches if launches is not None else ran > 0, f"no {path} launch ran (triton {triton.__version__})"
    assert lazy_jit.LAUNCHES[other] == before[other], f"{other} launches ran (triton {triton.__version__})"


@pytest.mark.gpu
def test_direct_launch_equals_triton_launch_on_gpu(monkeypatch):
    """The same compiled kernel, so bit-identical output; a misaligned x (offset by one bf16 element, so
    not 16-byte aligned) is another specialization: its own compiled kernel, also bit-identical and
    equal to the reference within bf16 rounding. On a Triton version the launcher does not mirror, both
    launches must go through Triton."""
    from megatron_dsa.ops.norms import rms_norm as reference

    storage = torch.randn(4096 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    for x in (storage[:-1].view(4096, 1024), storage[1:].view(4096, 1024)):
        through_triton, direct = _rms_norm_pair(x, weight, monkeypatch)
        assert torch.equal(through_triton, direct)
        expected = reference(x.float(), weight.float(), 1e-6)
        assert (direct.float() - expected).abs().max() <= 2 ** -7 * expected.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["C", "H"])
def test_layer_with_direct_launches_equals_triton_launches_on_gpu(kind, monkeypatch):
    """A whole training step (dsv4-flash dims, S = 1024, bf16, `auto`): every Triton kernel the layer
    launches is the same compiled kernel either way.

    The forward's kernels are deterministic, so the output must be bit-identical. The backward is not:
    cuDNN's sparse backward adds kv gradients with atomics, so two steps through Triton's launches differ
    by up to 8e-5 relative in some parameter gradients (measured on an H200). Gradients must therefore agree
    to a relative error ≤ 1e-3 and cosine ≥ 0.99999: a launch with wrong arguments, a wrong specialization
    or a skipped kernel gives errors of order 1. On a Triton version the launcher does not mirror, every
    launch must go through Triton."""
    from megatron_dsa import HybridAttention, HybridAttentionConfig

    torch.manual_seed(0)
    layer = HybridAttention(HybridAttentionConfig.from_preset("dsv4-flash"), kind=kind).cuda().bfloat16().train()
    x = torch.randn(1024, 1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step(direct: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(lazy_jit, "DIRECT_LAUNCH", direct)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = layer(x)
        out.backward(grad)
        return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]

    step(True)  # every specialization's first launch goes through Triton
    expected = step(False)
    before = lazy_jit.LAUNCHES.copy()
    got = step(True)
    _assert_expected_path_ran(before)
    assert torch.equal(got[0], expected[0]), "forward output differs"
    names = ["x.grad"] + [name for name, _ in layer.named_parameters()]
    failures = []
    for name, a, b in zip(names, expected[1:], got[1:]):
        if (a is None) != (b is None):
            failures.append(f"{name}: None on one path only")
        elif a is not None and not torch.equal(a, b) and (relative_error(b, a) > 1e-3 or cosine(b, a) < 0.99999):
            failures.append(f"{name}: relative error {relative_error(b, a):.2e}, cosine {cosine(b, a):.6f}")
    assert not failures, failures
