"""`make_graphed_layers` on the CPU: argument checks, the replay guard of `CapturedInput`, and the
step a graph captures, the eval path, and `_GraphReplay`'s input copies and gradient hand-over with
eager stand-ins for the graphs. The captured graphs themselves are tested on a GPU in
`test_graphed_layers_gpu.py`."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_dsa import GraphedLayer, HybridAttention, make_graphed_layers
from megatron_dsa.layers.cuda_graphs import CapturedInput, _GraphReplay, _LayerStep
from distributed import run_distributed
from test_packed_support import make_config, make_layer, pack, random_segments

F64 = torch.float64


def packed_batch(width: int, lengths=(5, 9, 3), pads=(1, 0, 2), max_seqlen: object = 12):
    return pack(random_segments(list(lengths), width), list(pads), tail=3, max_seqlen=max_seqlen,
                padded_metadata=True)


def test_make_graphed_layers_rejects_bad_arguments() -> None:
    layer = make_layer("C")
    x = torch.randn(16, 1, layer.config.hidden_size, dtype=F64)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        make_graphed_layers([layer], [x])
    with pytest.raises(ValueError, match="one sample input per layer, got 1 layers and 2"):
        make_graphed_layers([layer], [x, x])
    with pytest.raises(ValueError, match="one sample input per layer, got 0 layers"):
        make_graphed_layers([], [])
    with pytest.raises(ValueError, match="same layer twice"):
        make_graphed_layers([layer, layer], [x, x])
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= 1"):
        make_graphed_layers([layer], [x], num_warmup_iters=0)
    with pytest.raises(TypeError, match=r"layers\[0\] must be a HybridAttention, got Linear"):
        make_graphed_layers([torch.nn.Linear(2, 2)], [x])


def parallel_rules_body(rank: int, world: int) -> None:
    from megatron_dsa.parallel import initialize_parallel_state

    x = torch.randn(16, 1, make_layer("C").config.hidden_size, dtype=F64)
    for tp, cp in ((1, world), (world, 1)):
        layer = HybridAttention(make_config("C"), kind="C", parallel_state=initialize_parallel_state(tp_size=tp,
                                                                                                  cp_size=cp))
        name = "tensor" if tp > 1 else "context"
        with pytest.raises(ValueError, match=rf"layers\[0\] runs {name} parallel over a gloo group: .* NCCL"):
            make_graphed_layers([layer], [x])
        if cp > 1:  # the packed rule comes first: it holds on every backend
            batch = packed_batch(layer.config.hidden_size)
            with pytest.raises(ValueError, match=r"context parallel on packed input: .* SBHD"):
                make_graphed_layers([layer], [batch.hidden], batch.params)


def disagreeing_ranks_body(rank: int, world: int) -> None:
    from megatron_dsa.parallel import initialize_parallel_state
    from megatron_dsa.parallel.consistency import RankMismatchError

    layer = HybridAttention(make_config("C"), kind="C", parallel_state=initialize_parallel_state(cp_size=world))
    x = torch.randn(16 + 8 * rank, 1, layer.config.hidden_size, dtype=F64)  # rank 1's shard is longer
    with pytest.raises(RankMismatchError, match=r"make_graphed_layers' call differs between ranks: sample inputs: "
                                                 r".*\(16, 1, .* on rank 0, .*\(24, 1, .* on rank 1"):
        make_graphed_layers([layer], [x])
    warmup = 0 if rank == 0 else 3  # a local error on rank 0 only: both ranks still raise, neither waits
    with pytest.raises(RankMismatchError, match="num_warmup_iters: 0 on rank 0, 3 on rank 1"):
        make_graphed_layers([layer], [torch.randn(16, 1, layer.config.hidden_size, dtype=F64)],
                            num_warmup_iters=warmup)


def test_make_graphed_layers_raises_on_every_rank_when_the_ranks_calls_differ() -> None:
    """The graphs of TP/CP layers hold collectives: ranks that would capture different calls (another shard
    length, another argument) all raise, naming the field and the ranks, instead of one rank raising and the
    others waiting inside a collective (real 2-process gloo groups; the agreement is checked first)."""
    run_distributed(disagreeing_ranks_body, 2)


def test_make_graphed_layers_takes_parallel_layers_on_nccl_and_sbhd_cp_input_only() -> None:
    """TP/CP layers are captured with their collectives (run on NCCL in test_graphed_layers_gpu.py); a gloo
    group cannot be captured, and packed CP input needs a host plan a replay cannot change: both raise,
    on real 2-process groups."""
    run_distributed(parallel_rules_body, 2)


def test_captured_input_replays_only_the_captured_call() -> None:
    """Every property a replay depends on is checked, and each mismatch names what differs."""
    x = torch.randn(16, 1, 8, dtype=F64, requires_grad=True)
    captured = CapturedInput.of(x, None)
    assert captured.graph_inputs(x.detach().clone().requires_grad_(), None)[0].shape == x.shape
    for bad, what in [(torch.randn(17, 1, 8, dtype=F64, requires_grad=True), r"\(17, 1, 8\)"),
                      (torch.randn(16, 1, 8, requires_grad=True), "torch.float32"),
                      (torch.randn(16, 1, 8, dtype=F64), "requires_grad=False")]:
        with pytest.raises(ValueError, match=f"captured for: hidden_states .*{what}"):
            captured.graph_inputs(bad, None)
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
        captured.graph_inputs(x.numpy(force=True), None)


def test_captured_input_keeps_the_packed_structure() -> None:
    batch = packed_batch(8)
    hidden, params = batch.hidden, batch.params
    captured = CapturedInput.of(hidden, params)
    inputs = captured.graph_inputs(hidden, params)
    assert inputs[1] is params.cu_seqlens_q and inputs[2] is params.cu_seqlens_q_padded
    with pytest.raises(ValueError, match="captured with packed_seq_params"):
        captured.graph_inputs(hidden, None)
    with pytest.raises(ValueError, match="captured without packed_seq_params"):
        CapturedInput.of(hidden, None).graph_inputs(hidden, params)
    with pytest.raises(ValueError, match="at most the captured bound 12, got 13"):
        captured.graph_inputs(hidden, dataclasses.replace(params, max_seqlen_q=13))
    with pytest.raises(ValueError, match="at most the captured bound 12, got None"):
        captured.graph_inputs(hidden, dataclasses.replace(params, max_seqlen_q=None))
    # The segment bound is a smaller value here: the graph built for 12 serves it.
    smaller = dataclasses.replace(params, max_seqlen_q=11)
    assert len(captured.graph_inputs(hidden, smaller)) == 3
    other = packed_batch(8, lengths=(8, 9), pads=(1, 2))  # same rows, one segment fewer
    assert other.num_rows == batch.num_rows
    with pytest.raises(ValueError, match="cu_seqlens_q of 4 entries and cu_seqlens_q_padded; got 3 entries"):
        captured.graph_inputs(other.hidden, other.params)
    unpadded = dataclasses.replace(params, cu_seqlens_q_padded=None)
    with pytest.raises(ValueError, match="without padded boundaries"):
        captured.graph_inputs(hidden, unpadded)
    with pytest.raises(ValueError, match="pass packed_seq_params.cu_seqlens_kv as None"):
        captured.graph_inputs(hidden, dataclasses.replace(params, cu_seqlens_kv=params.cu_seqlens_q))
    with pytest.raises(ValueError, match="needs packed_seq_params.max_seqlen_q"):
        CapturedInput.of(hidden, dataclasses.replace(params, max_seqlen_q=None))


@pytest.mark.parametrize("packed", [False, True])
def test_layer_step_rebuilds_the_call_from_tensors(packed) -> None:
    """A graph captures the layer as a function of tensors only: the step rebuilds the packed
    boundaries from them and gives exactly the layer's output."""
    layer = make_layer("C")
    width = layer.config.hidden_size
    if packed:
        batch = packed_batch(width)
        hidden, params = batch.hidden.nan_to_num(), batch.params
    else:
        hidden, params = torch.randn(20, 2, width, dtype=F64), None
    captured = CapturedInput.of(hidden, params)
    step = _LayerStep(layer, captured.max_seqlen_q)
    expected, _ = layer(hidden, packed_seq_params=params)
    torch.testing.assert_close(step(*captured.graph_inputs(hidden, params)), expected, rtol=0, atol=0)


def test_graphed_layer_in_eval_mode_runs_the_layer_on_any_input() -> None:
    layer = make_layer("C")
    hidden = torch.randn(20, 2, layer.config.hidden_size, dtype=F64)
    graphed = GraphedLayer(layer, graphs=SimpleNamespace(), captured=CapturedInput.of(hidden, None)).eval()
    other = torch.randn(21, 3, layer.config.hidden_size, dtype=F64)
    out, bias = graphed(other)
    assert bias is None
    torch.testing.assert_close(out, layer(other)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="captured for"):
        graphed.train()(other)


class EagerGraphs:
    """Stands in for `LayerGraphs` on the CPU: `y = x @ w`, its "graphs" compute into static buffers
    as replays do, so `_GraphReplay`'s copying and gradient hand-over run exactly as on a GPU."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor):
        self.inputs, self.params = (x.detach().clone().requires_grad_(x.requires_grad),), (w,)
        self.output = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype)
        self.grad_output = torch.empty_like(self.output)
        grad_x = torch.empty_like(x) if x.requires_grad else None
        self.grads = (grad_x, torch.empty_like(w)) if x.requires_grad else (torch.empty_like(w),)
        self.forward_graph = SimpleNamespace(replay=self._forward)
        self.backward_graph = SimpleNamespace(replay=self._backward)

    def _forward(self) -> None:
        self.output.copy_(self.inputs[0] @ self.params[0].detach())

    def _backward(self) -> None:
        if self.inputs[0].requires_grad:
            self.grads[0].copy_(self.grad_output @ self.params[0].detach().t())
        self.grads[-1].copy_(self.inputs[0].detach().t() @ self.grad_output)


def test_graph_gradients_accumulate_over_micro_batches() -> None:
    """Replays overwrite the graph's gradient buffers. A parameter (or leaf input) without a `.grad`
    gets a copy, so a second micro-batch adds to the first instead of to itself (handing autograd
    the buffer, as `torch.cuda.make_graphed_callables` does, gives 2 × the second micro-batch)."""
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=F64, requires_grad=True)
    graphs = EagerGraphs(torch.randn(5, 4, dtype=F64, requires_grad=True), w)
    batches = [(torch.randn(5, 4, dtype=F64, requires_grad=True), torch.randn(5, 3, dtype=F64)) for _ in range(2)]
    for x, grad in batches:
        _GraphReplay.apply(graphs, x, w).backward(grad)
    expected_w = sum(x.detach().t() @ grad for x, grad in batches)
    torch.testing.assert_close(w.grad, expected_w, rtol=1e-12, atol=1e-12)
    for x, grad in batches:
        torch.testing.assert_close(x.grad, grad @ w.detach().t(), rtol=1e-12, atol=1e-12)
        assert x.grad.data_ptr() != graphs.grads[0].data_ptr()
    # A non-leaf input's gradient is consumed by its producer: no copy needed, the result is the same.
    source = torch.randn(5, 4, dtype=F64, requires_grad=True)
    (_GraphReplay.apply(graphs, source * 2, w) * 3).sum().backward()
    torch.testing.assert_close(source.grad, 6 * torch.ones(5, 3, dtype=F64) @ w.detach().t(), rtol=1e-12, atol=1e-12)


def test_graph_replay_without_input_grad_returns_only_parameter_gradients() -> None:
    w = torch.randn(4, 3, dtype=F64, requires_grad=True)
    graphs = EagerGraphs(torch.randn(5, 4, dtype=F64), w)
    x = torch.randn(5, 4, dtype=F64)
    _GraphReplay.apply(graphs, x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.t() @ torch.ones(5, 3, dtype=F64), rtol=1e-12, atol=1e-12)
    assert x.grad is None
