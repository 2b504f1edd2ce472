"""Attention layers whose training steps replay CUDA graphs: `make_graphed_layers`; and `capture_graph`, one
call captured as one graph after a warm-up on a side stream (`warm_up_on_side_stream`).

An eager step of a C layer at S = 4096 issues about 200 kernels through some 900 torch calls; on an
H200 the host takes about as long to issue them as the GPU takes to run them, so eager steps are
host-bound. `make_graphed_layers` captures each layer's forward and backward once (one memory pool
for all of them); afterwards a training step replays two graphs per layer and the host issues a
handful of launches instead of hundreds. It follows `torch.cuda.make_graphed_callables` (warm-up on a
side stream, forwards captured in order, backwards in reverse) with two differences: the layer keeps
its `(output, bias)` call, and a parameter whose `.grad` is None receives a copy of its gradient, not
the graph's static buffer (`make_graphed_callables` hands that buffer to autograd, which adopts it as
`.grad`; the next replay then overwrites it, and accumulating over micro-batches doubles the last one).

What a replay assumes, and what `GraphedLayer` checks before it replays (a mismatch raises a
`ValueError`/`TypeError` naming the argument; it never replays on the wrong shape):
- the input has the captured shape, dtype, device and `requires_grad`;
- packed input keeps the captured structure: the same number of segments, the same boundary tensors
  given (`cu_seqlens_q`, optionally `cu_seqlens_q_padded`), and `max_seqlen_q` at most the captured
  bound (the graph was built for that bound; the boundaries' values may change freely).
What it cannot check:
- each graphed layer runs at most once per step, forwards in the order the layers were given and
  backwards in reverse, and the outputs, `last_indexer_loss` and `last_selection` are graph memory
  the next replay overwrites (clone what you keep);
- eval mode (or another `training` state than at capture) runs the layer eagerly, on any input.

Tensor- and context-parallel layers (NCCL groups) are captured with their collectives inside the graphs:
every rank of a layer's groups calls `make_graphed_layers` with the same layers in the same order, and
replays them in the same order, as it would run them eagerly. Under CP the input is SBHD only: a packed
CP input's partition plan is built on the host from its boundaries, which a replay cannot change.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_dsa.layers.hybrid_attention import HybridAttention
from megatron_dsa.layers.streams import beside
from megatron_dsa.packed_seq import PackedSeqParams, validate_packed_seq_params
from megatron_dsa.parallel.consistency import check_same_on_all_ranks
from megatron_dsa.parallel.state import group_size

Result = TypeVar("Result")


def warm_up_on_side_stream(run: Callable[[], object], calls: int, device: Optional[torch.device] = None) -> None:
    """Call `run` `calls` times on a side stream that the current stream then waits for: what precedes a
    CUDA-graph capture (lazy initialisation, kernel compilation and autotuning, the backends' one-time
    self-tests and vendor plans run there, outside the graph), as the PyTorch CUDA-graph docs do it."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    beside(lambda: [run() for _ in range(calls)], device)()


def capture_graph(step: Callable[[], Result], warmup: int = 3, before_capture: Callable[[], None] = lambda: None,
                  pool: Optional[tuple] = None) -> tuple[torch.cuda.CUDAGraph, Result]:
    """`step` warmed up `warmup` times on a side stream, then one call captured (in `pool` if given): returns
    the graph and the captured call's result (static tensors each replay overwrites). `before_capture` runs
    between the two (e.g. to reset call counters). `step` runs `warmup + 1` times here: it must not write
    what its next call reads, or undo that itself."""
    warm_up_on_side_stream(step, warmup)
    before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        result = step()
    return graph, result


@dataclass(frozen=True)
class CapturedInput:
    """The call a layer's graphs were captured for: input tensor properties and packed structure."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    segments: Optional[int] = None  # entries of cu_seqlens_q when packed, else None
    padded: bool = False  # whether cu_seqlens_q_padded was given
    max_seqlen_q: Optional[int] = None

    @classmethod
    def of(cls, hidden_states: Tensor, packed: Optional[PackedSeqParams]) -> "CapturedInput":
        if packed is None:
            return cls(hidden_states.shape, hidden_states.dtype, hidden_states.device, hidden_states.requires_grad)
        if packed.max_seqlen_q is None:
            raise ValueError("make_graphed_layers with packed input needs packed_seq_params.max_seqlen_q: "
                             "the graphs are built for that bound on the (padded) segment length")
        return cls(hidden_states.shape, hidden_states.dtype, hidden_states.device, hidden_states.requires_grad,
                   packed.cu_seqlens_q.numel(), packed.cu_seqlens_q_padded is not None, packed.max_seqlen_q)

    def graph_inputs(self, hidden_states: Tensor, packed: Optional[PackedSeqParams]) -> tuple[Tensor, ...]:
        """`(hidden_states, cu_seqlens_q[, cu_seqlens_q_padded])` after checking them against the capture."""
        if not isinstance(hidden_states, Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        got = (hidden_states.shape, hidden_states.dtype, hidden_states.device, hidden_states.requires_grad)
        if got != (self.shape, self.dtype, self.device, self.requires_grad):
            expected = _describe(self.shape, self.dtype, self.device, self.requires_grad)
            raise ValueError(f"a graphed layer replays only the input it was captured for: hidden_states "
                             f"{_describe(*got)}, captured {expected}")
        if (packed is None) != (self.segments is None):
            raise ValueError(f"this graphed layer was captured {'without' if self.segments is None else 'with'} "
                             f"packed_seq_params; call it the same way")
        if packed is None:
            return (hidden_states,)
        validate_packed_seq_params(packed, hidden_states.shape[0])
        for name in ("cu_seqlens_kv", "cu_seqlens_kv_padded"):
            if getattr(packed, name) is not None:
                raise ValueError(f"graphed layers read cu_seqlens_q and cu_seqlens_q_padded only (self-attention); "
                                 f"pass packed_seq_params.{name} as None")
        if packed.cu_seqlens_q.numel() != self.segments or (packed.cu_seqlens_q_padded is not None) != self.padded:
            raise ValueError(f"packed_seq_params must keep the captured structure: cu_seqlens_q of {self.segments} "
                             f"entries{' and' if self.padded else ' without'} cu_seqlens_q_padded; got "
                             f"{packed.cu_seqlens_q.numel()} entries"
                             f"{' and' if packed.cu_seqlens_q_padded is not None else ' without'} padded boundaries")
        boundaries = (packed.cu_seqlens_q,) + ((packed.cu_seqlens_q_padded,) if self.padded else ())
        if any(cu.device != self.device for cu in boundaries):
            raise ValueError(f"packed boundaries of a graphed layer must be on {self.device} (the graph copies "
                             f"them into its own buffers), got {[str(cu.device) for cu in boundaries]}")
        if packed.max_seqlen_q is None or packed.max_seqlen_q > self.max_seqlen_q:
            raise ValueError(f"packed_seq_params.max_seqlen_q must be given and at most the captured bound "
                             f"{self.max_seqlen_q}, got {packed.max_seqlen_q}")
        return (hidden_states, *boundaries)


def _describe(shape: torch.Size, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> str:
    return f"{tuple(shape)} {dtype} on {device} (requires_grad={requires_grad})"


class _LayerStep(nn.Module):
    """The layer as a graph captures it: tensors in (the input, then packed boundaries), the output out."""

    def __init__(self, layer: HybridAttention, max_seqlen_q: Optional[int]):
        super().__init__()
        self.layer, self.max_seqlen_q = layer, max_seqlen_q

    def forward(self, hidden_states: Tensor, *boundaries: Tensor) -> Tensor:
        packed = None
        if boundaries:
            padded = boundaries[1] if len(boundaries) == 2 else None
            packed = PackedSeqParams(boundaries[0], cu_seqlens_q_padded=padded, max_seqlen_q=self.max_seqlen_q)
        return self.layer(hidden_states, packed_seq_params=packed)[0]


class LayerGraphs:
    """One layer's training step as two CUDA graphs over static buffers.

    The forward graph reads `inputs` (copies of the sample call) and writes `output`; the backward graph
    reads `grad_output` and writes `grads`, one per entry of `differentiable` (the inputs that require
    grad, then the parameters; None where a parameter gets no gradient)."""

    def __init__(self, step: _LayerStep, sample: tuple[Tensor, ...]):
        self.step = step
        self.inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in sample)
        self.params = tuple(p for p in step.parameters() if p.requires_grad)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.output: Optional[Tensor] = None
        self.grad_output: Optional[Tensor] = None
        self.grads: tuple[Optional[Tensor], ...] = ()

    @property
    def differentiable(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.inputs if t.requires_grad) + self.params

    def run_eagerly(self) -> None:
        """A warm-up step (outside any capture): lazy initialisation, kernel compilation, self-tests."""
        output = self.step(*self.inputs)
        torch.autograd.grad(output, self.differentiable, torch.zeros_like(output), allow_unused=True)

    def capture_forward(self, pool) -> None:
        with torch.cuda.graph(self.forward_graph, pool=pool):
            self.output = self.step(*self.inputs)

    def capture_backward(self, pool) -> None:
        self.grad_output = torch.empty_like(self.output)
        with torch.cuda.graph(self.backward_graph, pool=pool):
            self.grads = torch.autograd.grad(self.output, self.differentiable, self.grad_output,
                                             allow_unused=True)
        # The captured autograd graph is spent: drop it, or it keeps the parameters' gradient
        # accumulators of the capture stream alive for the replays' backward on another stream.
        self.output = self.output.detach()


class _GraphReplay(torch.autograd.Function):
    """`(graphs, *inputs, *params) → output`: replays the forward graph, and the backward graph in backward.

    Gradients are handed over as views of the graph's static buffers, which the next replay overwrites.
    Where autograd would keep one as is (a leaf or a `retain_grad` tensor without a `.grad` yet:
    AccumulateGrad adopts the tensor it is given) it gets a copy instead; everywhere else it is read
    (added into an existing `.grad`, or consumed by the producer's backward) before the next replay."""

    @staticmethod
    def forward(ctx, graphs: LayerGraphs, *tensors: Tensor) -> Tensor:
        for static, given in zip(graphs.inputs, tensors):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        graphs.forward_graph.replay()
        ctx.graphs = graphs
        # Positions in `tensors` of graphs.differentiable (inputs captured with requires_grad, parameters).
        ctx.positions = [i for i, t in enumerate(graphs.inputs) if t.requires_grad] + list(
            range(len(graphs.inputs), len(tensors)))
        ctx.save_for_backward(*(tensors[i] for i in ctx.positions))
        return graphs.output.detach()

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        graphs = ctx.graphs
        if grad_output.data_ptr() != graphs.grad_output.data_ptr():
            graphs.grad_output.copy_(grad_output)
        graphs.backward_graph.replay()
        grads: list[Optional[Tensor]] = [None] * (len(ctx.needs_input_grad) - 1)
        for position, tensor, grad in zip(ctx.positions, ctx.saved_tensors, graphs.grads):
            if ctx.needs_input_grad[1 + position]:
                grads[position] = _hand_over(tensor, grad)
        return (None, *grads)


def _hand_over(tensor: Tensor, grad: Optional[Tensor]) -> Optional[Tensor]:
    if grad is None:
        return None
    kept_as_is = (tensor.is_leaf or tensor.retains_grad) and tensor.grad is None
    return grad.clone() if kept_as_is else grad.detach()


class GraphedLayer(nn.Module):
    """A `HybridAttention` whose training forward and backward replay CUDA graphs.

    Same call as the layer: `(hidden_states [S, B, d], attention_mask=None, packed_seq_params=None)` →
    `(output [S, B, d], None)`. `layer` is the wrapped module (its parameters receive the gradients).
    """

    def __init__(self, layer: HybridAttention, graphs: LayerGraphs, captured: CapturedInput):
        super().__init__()
        self.layer, self.captured, self._graphs = layer, captured, graphs
        self.captured_training = layer.training

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[Tensor, Optional[Tensor]]:
        if self.training != self.captured_training:  # e.g. evaluation: the layer runs eagerly, any shape
            return self.layer(hidden_states, attention_mask, packed_seq_params)
        # attention_mask: accepted for Megatron call compatibility and ignored, like the layer does.
        inputs = self.captured.graph_inputs(hidden_states, packed_seq_params)
        return _GraphReplay.apply(self._graphs, *inputs, *self._graphs.params), None

    @property
    def last_indexer_loss(self) -> Optional[Tensor]:
        """The layer's indexer loss of the last step (graph memory: clone it to keep it)."""
        return self.layer.last_indexer_loss


def make_graphed_layers(layers: Sequence[HybridAttention], sample_inputs: Sequence[Tensor],
                        packed_seq_params: Optional[PackedSeqParams] = None,
                        num_warmup_iters: int = 3) -> list[GraphedLayer]:
    """Capture each layer's training forward and backward as CUDA graphs (one memory pool for all).

    layers: CUDA `HybridAttention`s in the order a step runs them; under TP or CP (NCCL groups) every rank
    of their groups makes this call with its own layers, and the graphs hold the collectives.
    sample_inputs: one `[S, B, d]` tensor per layer (this rank's shard under CP/SP) with the shape, dtype and
    `requires_grad` of the real inputs (values do not matter). packed_seq_params: sample boundaries
    (on the layers' device, with `max_seqlen_q`) if the layers run on packed input; every layer then
    takes packed input of the same structure. Warm-up steps run first, on a side stream (lazy
    initialisation, kernel compilation, the backends' one-time self-tests); parameter gradients are
    left untouched. Forwards are captured in the given order and backwards in reverse, as a step
    runs them (the graphs share one memory pool). Returns one `GraphedLayer` per layer, same order.
    """
    layers, sample_inputs = list(layers), list(sample_inputs)
    _check_layers(layers, sample_inputs, num_warmup_iters, packed_seq_params)
    captured = [CapturedInput.of(x, packed_seq_params) for x in sample_inputs]
    bound = None if packed_seq_params is None else packed_seq_params.max_seqlen_q
    graphs = [LayerGraphs(_LayerStep(layer, bound).train(layer.training), capture.graph_inputs(x, packed_seq_params))
              for layer, capture, x in zip(layers, captured, sample_inputs)]
    for layer_graphs in graphs:
        warm_up_on_side_stream(layer_graphs.run_eagerly, num_warmup_iters, sample_inputs[0].device)
    pool = torch.cuda.graph_pool_handle()
    for layer_graphs in graphs:
        layer_graphs.capture_forward(pool)
    for layer_graphs in reversed(graphs):
        layer_graphs.capture_backward(pool)
    return [GraphedLayer(layer, layer_graphs, capture)
            for layer, layer_graphs, capture in zip(layers, graphs, captured)]


def _check_layers(layers: list, sample_inputs: list, num_warmup_iters: int,
                  packed_seq_params: Optional[PackedSeqParams]) -> None:
    _check_ranks_agree(layers, sample_inputs, num_warmup_iters, packed_seq_params)
    if not layers or len(layers) != len(sample_inputs):
        raise ValueError(f"make_graphed_layers needs one sample input per layer, got {len(layers)} layers "
                         f"and {len(sample_inputs)} sample inputs")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters must be an int >= 1 (lazy initialisation must not happen during "
                         f"capture), got {num_warmup_iters!r}")
    if len({id(layer) for layer in layers}) != len(layers):
        raise ValueError("make_graphed_layers got the same layer twice: a graphed layer runs once per step")
    for i, (layer, x) in enumerate(zip(layers, sample_inputs)):
        if not isinstance(layer, HybridAttention):
            raise TypeError(f"layers[{i}] must be a HybridAttention, got {type(layer).__name__}")
        _check_parallel_layer(i, layer, packed_seq_params)
        if not isinstance(x, Tensor) or x.device.type != "cuda":
            raise ValueError(f"sample_inputs[{i}] must be a CUDA tensor (CUDA graphs), got "
                             f"{x.device if isinstance(x, Tensor) else type(x).__name__}")
        layer._check_input(x)
        devices = {p.device for p in layer.parameters()}
        if devices != {x.device}:
            raise ValueError(f"layers[{i}] has parameters on {sorted(map(str, devices))} but its sample input is "
                             f"on {x.device}")


def _check_parallel_layer(i: int, layer: HybridAttention, packed_seq_params: Optional[PackedSeqParams]) -> None:
    """A TP/CP layer's collectives go into its graphs: NCCL groups only; under CP, SBHD input only."""
    state = layer.parallel_state
    if state.cp_size > 1 and packed_seq_params is not None:
        raise ValueError(f"layers[{i}] runs context parallel on packed input: its partition plan is host metadata "
                         f"built from the boundaries, which a graph replay cannot change; graph CP layers on SBHD "
                         f"input [S/cp, B, d], or run packed CP input eagerly")
    for name, group, size in (("tensor", state.tp_group, state.tp_size), ("context", state.cp_group, state.cp_size)):
        if size > 1 and dist.get_backend(group) != "nccl":
            raise ValueError(f"layers[{i}] runs {name} parallel over a {dist.get_backend(group)} group: a CUDA graph "
                             f"captures its collectives only on NCCL groups")


def _check_ranks_agree(layers: list, sample_inputs: list, num_warmup_iters: object,
                       packed_seq_params: Optional[PackedSeqParams]) -> None:
    """Under TP/CP the graphs hold collectives, so every rank of a layer's groups must capture the same call.
    Each rank's description of its call is all-gathered over those groups before any local check can stop a
    rank: a call that differs raises `RankMismatchError` on every rank (naming the field and the ranks)
    instead of one rank raising while the others wait in a collective of the warm-up or the capture."""
    groups = {}
    for layer in layers:
        state = getattr(layer, "parallel_state", None)
        for group in (state.tp_group, state.cp_group) if state is not None else ():
            if group is not None and group_size(group) > 1:
                groups[id(group)] = group
    if not groups:
        return
    warmup = num_warmup_iters if isinstance(num_warmup_iters, int) else repr(num_warmup_iters)  # picklable
    call = {"layers": [getattr(layer, "kind", type(layer).__name__) for layer in layers],
            "sample inputs": [_describe_input(x) for x in sample_inputs], "num_warmup_iters": warmup,
            "packed_seq_params": None if packed_seq_params is None else
            (packed_seq_params.cu_seqlens_q.numel(), packed_seq_params.cu_seqlens_q_padded is not None,
             packed_seq_params.max_seqlen_q)}
    device = next((x.device for x in sample_inputs if isinstance(x, Tensor) and x.is_cuda), None)
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():  # NCCL gathers there
        for group in groups.values():
            check_same_on_all_ranks("make_graphed_layers' call", call, group)


def _describe_input(x: object) -> str:
    """What a rank's sample input must share with its group's (the device's type: each rank has its own GPU)."""
    if not isinstance(x, Tensor):
        return type(x).__name__
    return f"{tuple(x.shape)} {x.dtype} on {x.device.type} (requires_grad={x.requires_grad})"
