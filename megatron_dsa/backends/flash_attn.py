"""The `flash_attn` backend: dense causal attention of the `M` kind on the best FlashAttention
generation installed for the call, tried in this order:

* FlashAttention-4 (`flash-attn-4`, `flash_attn.cute.flash_attn_varlen_func`): CuTe-DSL, JIT-compiled
  at the first call, forward and backward on SM90/SM100, different qk and v head dims (192/128), GQA.
  GPU-tested on an H200, where it is the fastest dense option.
* FlashAttention-3 (the flash-attention repository's `hopper/` build, module `flash_attn_interface`):
  SM90 only; qk/v dims may differ as 192/128 (forward since early 2025, backward since PR #1604).
* FlashAttention-2 (`flash-attn` >= 2.6, `flash_attn.flash_attn_interface`): SM80 and newer; one head
  dim for q, k and v, so it declines the MLA dims 192/128 (padding v to 192 would silently add a
  copy and half again the PV work).

All three take packed rows with int32 `cu_seqlens` and return a natural-log LSE `[H, T]` float32 that
carries no gradient (FA4 marks it non-differentiable; FA2/FA3 drop its gradient silently, so it is
detached here and calls whose `lse_grad` is set are declined).

FA2 and FA3 are not installed on any GPU we test on: their adapters were written from the vendors'
source and run only against CPU fakes of their modules. So before one of them serves a call class
(device, dtype, qk and v head dims, GQA or not) for the first time, it runs a self-test: a tiny packed
problem forward and backward through the adapter, compared with the float32 reference. A build that
disagrees (an LSE layout or API we did not foresee, a wrong kernel) declines with the measured
errors, logged once, and `auto` moves on; the verdict is kept per class.

FA2 runs Ampere's mma.sync kernels on every GPU, far from what Hopper and Blackwell can do, so on those
`auto` leaves whole-sequence batches to cuDNN SDPA (see `batches_left_to_cudnn`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from megatron_dsa.backends import probes
from megatron_dsa.backends.dense_layout import isolate_non_finite, rows_first_lse, varlen_boundaries
from megatron_dsa.backends.registry import (
    Backend,
    BackendUnavailableError,
    OpFamily,
    backend_named,
    count_variant,
    register_backend,
)
from megatron_dsa.ops.dense_attention import causal_attention
from megatron_dsa.ops.layout import TokenLayout

NAME = "flash_attn"
DTYPES = (torch.bfloat16, torch.float16)

# (q [T, H, Dqk], k [M, G, Dqk], v [M, G, Dv], VarlenBounds, scale) -> (out [T, H, Dv], lse [H, T] or [T, H])
VarlenKernel = Callable[[Tensor, Tensor, Tensor, "VarlenBounds", float], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class VarlenBounds:
    """The segments of a varlen call: int32 `cu_seqlens` of the queries and of the keys, their longest
    segments, and whether each segment is causal (query `i` sees keys `≤ i`) or sees all its keys."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal: bool

    @classmethod
    def of_layout(cls, layout: TokenLayout, cover_tail: bool) -> "VarlenBounds":
        cu, longest = varlen_boundaries(layout, cover_tail=cover_tail)
        return cls(cu, cu, longest, longest, True)

    @classmethod
    def of_block(cls, rows: int, keys: int, causal: bool, device: torch.device) -> "VarlenBounds":
        """One segment: `rows` queries against `keys` keys (a block of the context-parallel ring)."""
        return cls(torch.tensor([0, rows], dtype=torch.int32, device=device),
                   torch.tensor([0, keys], dtype=torch.int32, device=device), max(rows, 1), max(keys, 1), causal)


@dataclass(frozen=True)
class ShapeClass:
    """What a generation's answer depends on beyond the packages: the device, the dtype, the qk and v
    head dims and whether query heads share KV heads. None where a call description does not say."""

    device: Optional[torch.device]
    dtype: Optional[torch.dtype]
    head_dim: Optional[int]
    v_head_dim: Optional[int]
    gqa: bool

    @classmethod
    def of_call(cls, call: Mapping[str, Any]) -> "ShapeClass":
        heads, groups = call.get("heads"), call.get("groups")
        return cls(probes.canonical_device(call.get("device")), call.get("dtype"), call.get("head_dim"),
                   call.get("v_head_dim"), heads is not None and groups is not None and heads != groups)

    @classmethod
    def of_tensors(cls, q: Tensor, k: Tensor, v: Tensor) -> "ShapeClass":
        return cls(probes.canonical_device(q.device), q.dtype, q.shape[-1], v.shape[-1], q.shape[1] != k.shape[1])

    @property
    def testable(self) -> bool:
        """The class names everything a self-test needs (a call; not layer construction or `info`)."""
        return None not in (self.device, self.dtype, self.head_dim, self.v_head_dim)

    @property
    def description(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype}


@dataclass(frozen=True, eq=False)
class Generation:
    """One FlashAttention generation: how to find it, where it runs and how to call it."""

    name: str
    variant: str  # what `registry.variant_counts` calls it
    module: str
    install_hint: str
    distributions: tuple[str, ...]  # for the versions shown by `info` and in self-test reports
    gpu_majors: tuple[int, ...]
    kernel: VarlenKernel
    shape_problem: Callable[[ShapeClass], Optional[str]]
    version_problem: Callable[[], Optional[str]] = lambda: None
    self_tested: bool = True
    cover_tail: bool = True  # see `dense_layout`: FA4 was measured to need no tail-covering bound

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout, scale: float) -> tuple[Tensor, Tensor]:
        """The `dense_attention` contract on this generation: `out [T, H, Dv]`, natural-log `lse [T, H]` fp32."""
        out, lse = self.kernel(q, k, v, VarlenBounds.of_layout(layout, self.cover_tail), float(scale))
        return out, rows_first_lse(lse.detach(), q.shape[0], q.shape[1])

    def attend_block(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
        """The `dense_attention_block_fwd` contract on this generation: `out [n, H, Dv]`, natural-log
        `lse [n, H]`, both float32 (the compute dtype of the bf16/fp16 inputs it takes)."""
        bounds = VarlenBounds.of_block(q.shape[0], k.shape[0], causal, q.device)
        out, lse = self.kernel(q, k, v, bounds, float(scale))
        return out.float(), rows_first_lse(lse.detach(), q.shape[0], q.shape[1])

    def package_problem(self) -> Optional[str]:
        return probes.import_problem(self.module, self.install_hint) or self.version_problem()

    def problem(self, shape: ShapeClass) -> Optional[str]:
        """None when this generation runs `shape` here (self-tested where the class is testable)."""
        return probes.first_problem(
            self.package_problem(),
            probes.gpu_problem(shape.description, self.gpu_majors, self.name),
            probes.dtype_problem(shape.description, DTYPES),
            self.shape_problem(shape),
        ) or (self_test_problem(self, shape) if self.self_tested and shape.testable else None)

    def versions(self) -> str:
        return probes.versions_line(*self.distributions)


def _varlen_arguments(bounds: VarlenBounds, scale: float) -> dict[str, Any]:
    """The keyword arguments every generation's `flash_attn_varlen_func` takes alike."""
    return dict(cu_seqlens_q=bounds.cu_q, cu_seqlens_k=bounds.cu_k, max_seqlen_q=bounds.max_q,
                max_seqlen_k=bounds.max_k, softmax_scale=scale, causal=bounds.causal)


# ---------------------------------------------------------------- FlashAttention-4
def _fa4_kernel(q: Tensor, k: Tensor, v: Tensor, bounds: VarlenBounds, scale: float) -> tuple[Tensor, Tensor]:
    return probes.load(FLASH_ATTENTION_4.module).flash_attn_varlen_func(
        q, k, v, **_varlen_arguments(bounds, scale), return_lse=True)


def _fa4_shape_problem(shape: ShapeClass) -> Optional[str]:
    """FA4's SM90 backward asserts `head_dim == head_dim_v` when query heads share KV heads
    (measured on an H200 with flash-attn-4 4.0.0b36: MLA dims 192/128 with GQA)."""
    capability = probes.cuda_capability(shape.device)
    if capability is None or capability[0] != 9 or not shape.gqa or shape.head_dim == shape.v_head_dim:
        return None
    return (f"FA4's SM90 backward needs qk head dim == v head dim with GQA "
            f"(query heads share KV heads, {shape.head_dim} != {shape.v_head_dim})")


# ---------------------------------------------------------------- FlashAttention-3
def _fa3_kernel(q: Tensor, k: Tensor, v: Tensor, bounds: VarlenBounds, scale: float) -> tuple[Tensor, Tensor]:
    varlen = probes.load(FLASH_ATTENTION_3.module).flash_attn_varlen_func
    # Builds since PR #1851 (Aug 2025) return `(out, lse)` when asked by `return_attn_probs`; older ones
    # always returned it, and those between (after "[FA3] Don't return lse", Jul 2025) return `out` alone.
    asked = {"return_attn_probs": True} if _takes_keyword(varlen, "return_attn_probs") else {}
    result = varlen(q, k, v, **_varlen_arguments(bounds, scale), **asked)
    if isinstance(result, Tensor):
        raise RuntimeError("this FlashAttention-3 build returns no LSE (builds of Jul-Aug 2025 return `out` "
                           "alone); rebuild it from a newer commit of the hopper/ directory")
    out, lse = result[:2]
    return out, lse


@functools.lru_cache(maxsize=None)
def _takes_keyword(function: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(function).parameters


def _fa3_shape_problem(shape: ShapeClass) -> Optional[str]:
    """FA3's forward takes a v head dim other than the qk one only as qk (128, 192] with v (96, 128]
    (the MLA 192/128) or qk <= 64; any other pair raises in the kernel."""
    qk, v = shape.head_dim, shape.v_head_dim
    if qk is None or v is None or qk == v or (128 < qk <= 192 and 96 < v <= 128) or qk <= 64:
        return None
    return (f"FlashAttention-3 runs qk head dim {qk} with v head dim {v} only as qk in (128, 192] with "
            f"v in (96, 128], or qk <= 64")


# ---------------------------------------------------------------- FlashAttention-2
FA2_MIN_VERSION = (2, 6)  # varlen LSE `[H, total_q]` since 2.6.0 (PR #970); before, `[B, H, max_seqlen]`


def _fa2_kernel(q: Tensor, k: Tensor, v: Tensor, bounds: VarlenBounds, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, _ = probes.load(FLASH_ATTENTION_2.module).flash_attn_varlen_func(  # 3rd: probabilities (None)
        q, k, v, **_varlen_arguments(bounds, scale), dropout_p=0.0, return_attn_probs=True)
    return out, lse


def _fa2_version_problem() -> Optional[str]:
    version = getattr(probes.load("flash_attn"), "__version__", "0")
    if probes.version_tuple(version) < FA2_MIN_VERSION:
        return (f"flash-attn {version} is older than 2.6 (its varlen LSE is padded per sequence); "
                f"pip install -U flash-attn --no-build-isolation")
    return None


def _fa2_shape_problem(shape: ShapeClass) -> Optional[str]:
    if shape.head_dim is None or shape.v_head_dim is None or shape.head_dim == shape.v_head_dim:
        return None
    return (f"FlashAttention-2 needs one head dim for q, k and v, got qk {shape.head_dim} and v "
            f"{shape.v_head_dim} (not padded: FA3/FA4 or cuDNN SDPA run unequal dims)")


# ---------------------------------------------------------------- the generations, best first
FLASH_ATTENTION_4 = Generation(
    name="FlashAttention-4",
    variant="fa4",
    module="flash_attn.cute",
    install_hint="install the [flash-attn] extra (pip install 'megatron_dsa[flash-attn]')",
    distributions=("flash-attn-4", "nvidia-cutlass-dsl"),
    gpu_majors=(9, 10, 11),
    kernel=_fa4_kernel,
    shape_problem=_fa4_shape_problem,
    self_tested=False,  # GPU-tested on an H200
    cover_tail=False,
)
FLASH_ATTENTION_3 = Generation(
    name="FlashAttention-3",
    variant="fa3",
    # Every FA3 build installs the top-level module; newer ones add `flash_attn_3.flash_attn_interface`,
    # which only re-exports it.
    module="flash_attn_interface",
    install_hint="build FlashAttention-3 from the flash-attention repository's hopper/ directory "
                 "(see docs/kernels.md, 'FlashAttention')",
    distributions=("flash_attn_3",),
    gpu_majors=(9,),
    kernel=_fa3_kernel,
    shape_problem=_fa3_shape_problem,
)
FLASH_ATTENTION_2 = Generation(
    name="FlashAttention-2",
    variant="fa2",
    module="flash_attn.flash_attn_interface",  # absent where only FA4 (`flash_attn.cute`) is installed
    install_hint="pip install flash-attn --no-build-isolation (FlashAttention-2 >= 2.6)",
    distributions=("flash-attn",),
    gpu_majors=(8, 9, 10, 12),  # the architectures flash-attn builds for (SM100/SM120 since 2.7.3)
    kernel=_fa2_kernel,
    shape_problem=_fa2_shape_problem,
    version_problem=_fa2_version_problem,
)
GENERATIONS = (FLASH_ATTENTION_4, FLASH_ATTENTION_3, FLASH_ATTENTION_2)


def serving_generation(shape: ShapeClass) -> tuple[Optional[Generation], list[str]]:
    """The first generation that runs `shape` here, and why each one before it declined."""
    declined = []
    for generation in GENERATIONS:
        problem = generation.problem(shape)
        if problem is None:
            return generation, declined
        declined.append(f"{generation.name}: {problem}")
    return None, declined


# ---------------------------------------------------------------- the self-test of FA2 and FA3
SELF_TEST_SEGMENTS = (5, 11)  # two packed segments of different lengths
SELF_TEST_HEADS, SELF_TEST_GQA_GROUPS = 4, 2
# Errors are max |Δ| / max |reference| for out, dq, dk, dv. The kernels round P (and dS in backward) to
# the input dtype before their matmuls and the outputs once more: a model of exactly that, on 200 draws of
# this problem with dims 64..256, stayed below 7.8e-3 in bf16 and 1.2e-3 in fp16. The tolerances are
# about four times that; a wrong mask, scale, segment or head mapping moves these errors by 0.1 or more.
SELF_TEST_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
# The LSE is float32 from exact products of the same inputs (only the summation order and exp2/log
# approximations differ, ~1e-5); a base-2 LSE or a transposed one is off by far more.
SELF_TEST_LSE_TOLERANCE = 1e-3


def self_test_problem(generation: Generation, shape: ShapeClass) -> Optional[str]:
    """None when `generation` passed its self-test for `shape` (run once per class), else why not."""
    what = f"{generation.name} ({generation.versions()})"
    context = (f"{shape.device}, {shape.dtype}, head dims {shape.head_dim}/{shape.v_head_dim}"
               f"{', GQA' if shape.gqa else ''}")
    return probes.kept_self_test(what, (generation, shape), shape.device,
                                 lambda: _self_test_verdict(what, generation, shape), context)


def _self_test_verdict(what: str, generation: Generation, shape: ShapeClass) -> Optional[str]:
    tolerance = SELF_TEST_TOLERANCE[shape.dtype]
    failed = [f"{name} {error:.2g}" for name, error in _self_test_errors(generation, shape).items()
              if error > (SELF_TEST_LSE_TOLERANCE if name == "|Δlse|" else tolerance)]
    if not failed:
        return None
    return (f"{what} failed its self-test against the reference ({', '.join(failed)}; tolerances "
            f"{tolerance:g} relative, {SELF_TEST_LSE_TOLERANCE:g} for the lse); please report")


def _self_test_errors(generation: Generation, shape: ShapeClass) -> dict[str, float]:
    """Forward and backward of a tiny packed problem of `shape`'s class through `generation.attend`
    against the float32 reference: `{metric: error}` (see the tolerances above)."""
    q, k, v, grad_out, layout = _self_test_inputs(shape)
    scale = shape.head_dim ** -0.5
    with torch.enable_grad(), torch.autocast(shape.device.type, enabled=False):
        inputs = [t.requires_grad_() for t in (q, k, v)]
        out, lse = generation.attend(*inputs, layout, scale)
        if out.shape != grad_out.shape or lse.shape != grad_out.shape[:2]:
            raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} where "
                             f"{tuple(grad_out.shape)} / {tuple(grad_out.shape[:2])} were expected")
        grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
        references = [t.detach().float().requires_grad_() for t in (q, k, v)]
        out_ref, lse_ref = causal_attention(*references, layout, scale)
        grads_ref = torch.autograd.grad(out_ref, references, grad_out)
    errors = {"max |Δout|/max |out|": _relative_error(out, out_ref), "|Δlse|": probes.max_difference(lse, lse_ref)}
    for name, grad, grad_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        errors[f"max |Δ{name}|/max |{name}|"] = _relative_error(grad, grad_ref)
    return errors


def _self_test_inputs(shape: ShapeClass) -> tuple[Tensor, Tensor, Tensor, Tensor, TokenLayout]:
    """q, k, v in the class's dtype on its device, a float32 output gradient and the packed layout
    (4 query heads over 2 KV heads where the class has GQA); drawn from a private generator, so the
    caller's random state is untouched."""
    gen = torch.Generator().manual_seed(0)
    rows, heads = sum(SELF_TEST_SEGMENTS), SELF_TEST_HEADS
    groups = SELF_TEST_GQA_GROUPS if shape.gqa else heads

    def draw(width: int, dim: int) -> Tensor:
        return torch.randn(rows, width, dim, generator=gen).to(shape.device)

    q, k = draw(heads, shape.head_dim), draw(groups, shape.head_dim)
    v, grad_out = draw(groups, shape.v_head_dim), draw(heads, shape.v_head_dim)
    boundaries = torch.tensor([0, SELF_TEST_SEGMENTS[0], rows])
    layout = TokenLayout.packed(boundaries, rows, shape.device, max_seqlen=max(SELF_TEST_SEGMENTS))
    return q.to(shape.dtype), k.to(shape.dtype), v.to(shape.dtype), grad_out, layout


def _relative_error(got: Tensor, expected: Tensor) -> float:
    return probes.max_difference(got, expected) / max(float(expected.detach().abs().max()), 1e-30)


# ---------------------------------------------------------------- the backend
@isolate_non_finite
def dense_attention(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout, scale: float) -> tuple[Tensor, Tensor]:
    """The `dense_attention` contract on the best generation for these tensors (the one the probe
    accepted for their call): `out [T, H, Dv]`, natural-log `lse [T, H]` float32; NaN and infinity
    isolated per row as in the reference (`isolate_non_finite`)."""
    generation, declined = serving_generation(ShapeClass.of_tensors(q, k, v))
    if generation is None:
        raise BackendUnavailableError(f"backend 'flash_attn' cannot run dense_attention: {'; '.join(declined)}")
    count_variant(NAME, OpFamily.DENSE_ATTENTION, generation.variant)
    return generation.attend(q, k, v, layout, scale)


def batches_left_to_cudnn(generation: Generation, call: Mapping[str, Any]) -> Optional[str]:
    """Why `auto` should not take FA2 for this call: a whole-sequence (uniform) batch that cuDNN SDPA runs.

    FA2's Ampere-style kernels run at a fraction of Hopper's (and Blackwell's) tensor-core rate, where
    torch's cuDNN SDPA (the `cudnn` backend, after `flash_attn` in `AUTO_ORDER`) uses them fully; FA3 and
    FA4 do too and keep their place. The order is per backend and cannot tell the generations apart, so
    the probe declines, as torch_sdpa's CPU kernel does, only under `auto` (`explicit` runs FA2) and only
    when cuDNN SDPA itself accepts the call (asked through the registry, so its rules live in one place):
    packed layouts, which cuDNN and torch SDPA decline, and GPUs or builds without it keep FA2.
    """
    layout = call.get("layout")
    if generation is not FLASH_ATTENTION_2 or call.get("explicit") or layout is None or layout.uniform_shape is None:
        return None
    cudnn = backend_named("cudnn")
    if cudnn is None or cudnn.decline_reason(OpFamily.DENSE_ATTENTION, call) is not None:
        return None
    return ("FlashAttention-2 would serve, but cuDNN SDPA runs whole-sequence batches faster on this GPU "
            "('auto' leaves them to 'cudnn'; name 'flash_attn' to run FA2)")


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    if op is not OpFamily.DENSE_ATTENTION:
        return block_probe(op, call)
    problem = probes.dense_problem(call)  # first: no self-test for a call no generation could take
    if problem is not None:
        return problem
    generation, declined = serving_generation(ShapeClass.of_call(call))
    if generation is None:
        return "; ".join(declined)
    return batches_left_to_cudnn(generation, call)


# ---------------------------------------------------------------- blocks of the context-parallel ring
FA4_BACKWARD_MODULE = "flash_attn.cute.interface"


def block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """The `dense_attention_block_fwd` contract on the best generation for these tensors (one varlen segment
    of `n` queries against `m` keys, `causal` or not)."""
    generation, declined = serving_generation(ShapeClass.of_tensors(q, k, v))
    if generation is None:
        raise BackendUnavailableError(f"backend 'flash_attn' cannot run dense_attention_block_fwd: "
                                      f"{'; '.join(declined)}")
    count_variant(NAME, OpFamily.DENSE_ATTENTION_BLOCK_FWD, generation.variant)
    return generation.attend_block(q, k, v, scale, causal)


def block_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The `dense_attention_block_bwd` contract on FlashAttention-4's backward, which forms `delta = <dO, O>`
    and `P = exp(s − lse)` from the `out` and `lse` it is given: the merged ones of every block. Batched
    (one sequence), not varlen: FA4's SM90 backward takes no varlen bounds."""
    backward = probes.load(FA4_BACKWARD_MODULE)._flash_attn_bwd
    count_variant(NAME, OpFamily.DENSE_ATTENTION_BLOCK_BWD, FLASH_ATTENTION_4.variant)
    dq, dk, dv = backward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.to(q.dtype).unsqueeze(0),
                          grad_out.to(q.dtype).unsqueeze(0), lse.float().transpose(0, 1).unsqueeze(0).contiguous(),
                          softmax_scale=float(scale), causal=causal)[:3]
    return dq[0].float(), dk[0].float(), dv[0].float()


def block_probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    problem = probes.dense_problem(call)
    if problem is not None:
        return problem
    generation, declined = serving_generation(ShapeClass.of_call(call))
    if generation is None:
        return "; ".join(declined)
    if op is not OpFamily.DENSE_ATTENTION_BLOCK_BWD:
        return None
    if generation is not FLASH_ATTENTION_4:
        return (f"{generation.name} serves here; only FlashAttention-4's backward (`_flash_attn_bwd`) is wired to "
                f"take the merged out and LSE of the ring's blocks")
    problem = probes.import_problem(FA4_BACKWARD_MODULE, FLASH_ATTENTION_4.install_hint)
    if problem is not None:
        return problem
    backward = getattr(probes.load(FA4_BACKWARD_MODULE), "_flash_attn_bwd", None)
    if backward is None or not all(_takes_keyword(backward, name) for name in ("softmax_scale", "causal")):
        return ("this flash-attn-4 build has no _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=) "
                "(an API we did not foresee)")
    return None


def describe_generations() -> str:
    """Which FlashAttention generations import here and which one serves `flash_attn` on the current
    device (for `megatron-dsa info --verbose`)."""
    serving, _ = serving_generation(ShapeClass.of_call({}))
    lines = ["flash_attn dense attention, FlashAttention generations in the order tried "
             "(FA3/FA2 pass a one-time self-test per call class before serving):"]
    for generation in GENERATIONS:
        status = generation.package_problem()
        if status is None and generation is serving:
            status = "importable, serves here"
        elif status is None:
            status = "importable, " + (generation.problem(ShapeClass.of_call({})) or f"{serving.name} goes first")
        lines.append(f"  {generation.name} ({generation.versions()}): {status}")
    return "\n".join(lines)


FLASH_ATTN = Backend(
    name=NAME,
    ops={OpFamily.DENSE_ATTENTION: dense_attention, OpFamily.DENSE_ATTENTION_BLOCK_FWD: block_forward,
         OpFamily.DENSE_ATTENTION_BLOCK_BWD: block_backward},
    probe=probe,
    version=lambda: "; ".join(generation.versions() for generation in GENERATIONS),
)

register_backend(FLASH_ATTN)
