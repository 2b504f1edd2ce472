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


# ---------------------------------------------------------------- chained launches
def test_chained_launch_is_asked_only_of_gpus_that_have_it_inside_chained_launches(monkeypatch):
    """Programmatic dependent launch: inside `chained_launches()` (an inference cache's calls), on CUDA devices of
    compute capability 9.0 or later; outside it, on the CPU (the interpreter), older GPUs and with
    `MEGATRON_DSA_TRITON_CHAINED_LAUNCH=0` the kernel gets `CHAINED=False` (no in-kernel wait)."""
    from megatron_dsa.backends import probes

    off, on = {"CHAINED": False}, {"CHAINED": True, "launch_pdl": True}
    cuda = torch.device("cuda", 0)
    with lazy_jit.chained_launches():
        assert lazy_jit.chained_launch(torch.device("cpu")) == off
        for capability, expected in (((8, 9), off), ((9, 0), on), ((10, 0), on), (None, off)):
            lazy_jit._chains_on.cache_clear()
            monkeypatch.setattr(probes, "cuda_capability", lambda device, c=capability: c)
            assert lazy_jit.chained_launch(cuda) == expected, capability
            monkeypatch.setattr(lazy_jit, "CHAINED_LAUNCH", False)
            assert lazy_jit.chained_launch(cuda) == off
            monkeypatch.setattr(lazy_jit, "CHAINED_LAUNCH", True)
    assert lazy_jit.chained_launch(cuda) == off  # a training step's launches: plain
    lazy_jit._chains_on.cache_clear()


def test_calls_through_an_inference_cache_are_inside_chained_launches(monkeypatch):
    """The layer enters `chained_launches()` for its cached calls only (one stream, no CP / SP), so training and
    evaluation steps keep plain launches."""
    from megatron_dsa import HybridAttention, HybridAttentionConfig
    from megatron_dsa.layers.decoding import LayerCache

    seen = []  # inside chained_launches() when the layer's output projection runs, per call
    config = HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern="W")
    layer = HybridAttention(config, kind="W").eval()
    monkeypatch.setattr(layer.linear_proj, "forward",
                        lambda x: (seen.append(lazy_jit._CHAINING.get()), x @ layer.linear_proj.weight.t())[1])
    x = torch.randn(3, 2, config.hidden_size)
    with torch.no_grad():
        layer(x)
        layer(x, inference_cache=LayerCache.for_layer(layer, 2, 8))
    assert seen == [False, True]


def test_launcher_counts_chained_launches_on_either_path(kernel):
    stand_in, launcher = kernel
    before = lazy_jit.LAUNCHES.copy()
    launcher[(1,)]("x", 16, BLOCK=8, launch_pdl=True)
    launcher[(1,)]("x", 16, BLOCK=8, launch_pdl=True)
    launcher[(1,)]("x", 16, BLOCK=8)
    assert _paths(stand_in.log) == ["triton", "direct", "triton"]
    assert lazy_jit.LAUNCHES["chained"] - before["chained"] == 2


@pytest.mark.parametrize("chained", [True, False])
def test_a_chained_kernel_waits_before_its_first_load(chained):
    """Compiled for sm_90a with `CHAINED`: `griddepcontrol.wait` comes before the kernel's first global load
    (reading the previous kernel's output before it has finished would race), then
    `griddepcontrol.launch_dependents`; without it, neither instruction."""
    from triton_support import compile_for_sm90

    from megatron_dsa.backends.triton_kernels import _decode_attention_kernels as kernels

    signature = dict(part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", sink_ptr="*fp32",
                     out_ptr="*bf16", seqlens_ptr="*i64", freq_ptr="*fp32", H="constexpr", D="constexpr",
                     SPLITS="constexpr", BLOCK_S="constexpr", BLOCK_D="constexpr", HALF="constexpr",
                     BLOCK_HALF="constexpr", CHAINED="constexpr")
    constexprs = dict(H=64, D=512, SPLITS=4, BLOCK_S=4, BLOCK_D=128, HALF=32, BLOCK_HALF=32, CHAINED=chained)
    ptx = compile_for_sm90(kernels, "decode_combine_kernel", signature, constexprs, 4).asm["ptx"]
    if not chained:
        assert "griddepcontrol" not in ptx
        return
    wait, first_load = ptx.index("griddepcontrol.wait"), ptx.index("ld.global")
    assert wait < ptx.index("griddepcontrol.launch_dependents") and wait < first_load


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["C", "H"])
@torch.no_grad()
def test_chained_decode_steps_equal_unchained_ones_on_gpu(kind, monkeypatch):
    """A decode step's Triton kernels (FP8 row rounding and GEMMs, norms, RoPE, compressor writes, the indexer,
    the decode attention) launched chained on a Hopper GPU run the same code after their in-kernel wait, and a
    decode step's kernels are deterministic: outputs and caches bit-identical to unchained launches, eager and
    replayed in a CUDA graph (where the chaining becomes the graph's programmatic edges). dsv4-flash dims, bf16,
    FP8 projections and FP8 indexer keys, B = 4, 8 steps after a 1000-token prefill."""
    import copy

    from megatron_dsa import HybridAttention, HybridAttentionConfig
    from megatron_dsa.layers.decode_graph import DecodeGraph
    from megatron_dsa.layers.decoding import LayerCache

    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind,
                                               projection_precision="fp8")
    layer = HybridAttention(config, kind=kind).cuda().bfloat16().eval()
    batch, steps = 4, 8
    prefilled = LayerCache.for_layer(layer, batch, 2048, fp8_indexer_keys=kind == "C")
    layer(torch.randn(1000, batch, config.hidden_size, device="cuda", dtype=torch.bfloat16),
          inference_cache=prefilled)
    tokens = torch.randn(steps, 1, batch, config.hidden_size, device="cuda", dtype=torch.bfloat16)

    def decode(chained: bool, graphed: bool) -> tuple[list[torch.Tensor], LayerCache]:
        monkeypatch.setattr(lazy_jit, "CHAINED_LAUNCH", chained)
        cache = copy.deepcopy(prefilled)
        if graphed:
            graph = DecodeGraph(lambda x: layer(x, inference_cache=cache)[0], tokens[0], [cache])
            return [graph(x).clone() for x in tokens], cache
        return [layer(x, inference_cache=cache)[0] for x in tokens], cache

    expected, expected_cache = decode(False, False)
    hopper = torch.cuda.get_device_capability() >= lazy_jit.CHAINED_LAUNCH_MIN_CAPABILITY
    for graphed in (False, True):
        before = lazy_jit.LAUNCHES.copy()
        got, cache = decode(True, graphed)
        chained = lazy_jit.LAUNCHES["chained"] - before["chained"]
        assert (chained > 0) == hopper, (chained, torch.cuda.get_device_capability())
        for step, (a, b) in enumerate(zip(expected, got)):
            assert torch.equal(a, b), f"graphed={graphed}: step {step} differs"
        for name in ("seqlens", "window", "entries", "indexer_keys"):
            a, b = getattr(expected_cache, name), getattr(cache, name)
            assert (a is None and b is None) or torch.equal(a, b), f"graphed={graphed}: cache {name} differs"
