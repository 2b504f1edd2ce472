"""Decode steps replayed from a CUDA graph: `DecodeGraph`.

A decode step (`layers.decoding.decode_step`) has fixed shapes, reads nothing back to the host and writes
its cache in place, so one step can be captured and replayed for every further token: the host then issues
one graph launch per step instead of a few dozen kernels per layer.

    cache = LayerCache.for_layer(layer, batch, capacity)            # or model.new_inference_cache(...)
    layer(prompt, inference_cache=cache)                            # prefill (eager, any lengths)
    graph = DecodeGraph(lambda x: layer(x, inference_cache=cache)[0], next_rows, [cache])
    out = graph(next_rows)                                          # one token per sequence, replayed

Capturing needs the step to run first (Triton compiles, backends are chosen): those warm-up runs write the
cache, so what one step writes (lengths, window ring, compressor slots, the entry row of the new token's
group, an M layer's latent row; with FP8 attention rows the ring's pages, the entry's scratch row and its page
bytes) is saved before and restored after each. A replay advances the caches by one
token, as the eager step does; `DecodeGraph` keeps their host-side length bound and refuses a step past
their capacity.

What a replay assumes: the input has the captured shape, dtype and device (checked); the caches are the
captured objects with their captured buffers (the reference path, which prefill runs, updates them in place,
so prefill may continue between replays); the output is graph memory the next replay overwrites (clone what
you keep); the step's input projection reads the stack of their weights its cache kept
(`ops.stacked_projection.KeptStack`), so weights changed in place after the capture take effect in a new
capture, not in replays of this one. An M layer whose up-projection is not a plain weight decodes through the reference path
(`layers.decoding.takes_decode_step`), which reads lengths back: CUDA refuses to capture that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from megatron_dsa.layers.cuda_graphs import warm_up_on_side_stream
from megatron_dsa.layers.decoding import LayerCache
from megatron_dsa.ops.decode_compressor import byte_view
from megatron_dsa.ops.paged_rows import PagedRows

DEFAULT_WARMUP = 2


@dataclass
class _StepWrites:
    """What one decode step may write in a cache, saved so that a warm-up step can be undone."""

    cache: LayerCache
    longest: int
    seqlens: Tensor
    buffers: list[tuple[Tensor, Tensor]]  # (buffer, saved copy): the window ring, the compressors' slots
    entry_rows: list[tuple[Tensor, Tensor, Tensor]]  # (store, rows to restore [B], saved rows [B, D])

    @classmethod
    def save(cls, cache: LayerCache) -> "_StepWrites":
        # The window ring (or its FP8 pages) and the entry's scratch row whole.
        buffers = [t.pages if isinstance(t, PagedRows) else t for t in (cache.window, cache.entry_scratch)
                   if t is not None]
        buffers += [state.rows for state in cache.compressors.values()]
        entry_rows = []
        # Row p // r of the compressed stores (of FP8 pages: its row and scale bytes), row p of an M layer's latents.
        stores = []
        for store, ratio in ((cache.entries, cache.ratio), (cache.indexer_keys, cache.ratio),
                             (cache.indexer_key_scales, cache.ratio), (cache.latent, 1)):
            if isinstance(store, PagedRows):
                stores += [(store.rows_region(), ratio), (store.scales_region(), ratio)]
            elif store is not None:
                stores.append((store, ratio))
        for store, ratio in stores:
            if store.shape[1] > 0:
                store = byte_view(store)  # FP8 indexer keys: torch indexes no float8
                rows = torch.div(cache.seqlens, ratio, rounding_mode="floor").clamp(max=store.shape[1] - 1)
                entry_rows.append((store, rows, store[torch.arange(cache.batch, device=rows.device), rows]))
        return cls(cache, cache.longest, cache.seqlens.clone(), [(t, t.clone()) for t in buffers], entry_rows)

    def restore(self) -> None:
        cache = self.cache
        cache.longest = self.longest
        cache.seqlens.copy_(self.seqlens)
        for buffer, saved in self.buffers:
            buffer.copy_(saved)
        for store, rows, saved in self.entry_rows:
            store[torch.arange(cache.batch, device=rows.device), rows] = saved


class DecodeGraph:
    """`step(x)`, one decode step over `caches` (a layer's, or a model's `InferenceCache.layers`), captured
    once as a CUDA graph; calling the graph replays it (module docstring).

    step: `x → output` (e.g. `lambda x: layer(x, inference_cache=cache)[0]` with `x [1, B, d]`, or
    `lambda tokens: model(tokens, inference_cache=cache)` with `tokens [B, 1]`). example: an input of the shape,
    dtype and CUDA device every call will have (its values are not used). warmup: eager runs before the capture.
    pool: a memory pool to share with other graphs (`torch.cuda.graph_pool_handle()`)."""

    def __init__(self, step: Callable[[Tensor], Tensor], example: Tensor, caches: Sequence[LayerCache],
                 warmup: int = DEFAULT_WARMUP, pool: Optional[tuple] = None):
        if not isinstance(example, Tensor) or example.device.type != "cuda":
            raise ValueError("DecodeGraph needs an example input on a CUDA device (CUDA graphs)")
        caches = list(caches)
        if not caches or not all(isinstance(cache, LayerCache) for cache in caches):
            raise TypeError("DecodeGraph needs the step's caches: a non-empty sequence of LayerCache")
        if warmup < 1:
            raise ValueError(f"DecodeGraph needs warmup >= 1 (the first run compiles and picks backends), got {warmup}")
        self.caches = caches
        self.input = example.clone()
        self._capture(step, warmup, pool)

    def _capture(self, step: Callable[[Tensor], Tensor], warmup: int, pool: Optional[tuple]) -> None:
        saved = [_StepWrites.save(cache) for cache in self.caches]

        def undone_step() -> None:
            step(self.input)
            for writes in saved:
                writes.restore()

        with torch.no_grad():
            warm_up_on_side_stream(undone_step, warmup)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph, pool=pool):
            self.output = step(self.input)
        for writes in saved:  # the capture ran the step's host side (its length bound) but no kernel
            writes.cache.longest = writes.longest

    def __call__(self, x: Tensor) -> Tensor:
        """Copy `x` into the captured input, replay the step → its output (graph memory: clone to keep)."""
        if not isinstance(x, Tensor) or (x.shape, x.dtype, x.device) != (self.input.shape, self.input.dtype,
                                                                         self.input.device):
            got = (tuple(x.shape), x.dtype, x.device) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"a DecodeGraph replays the input it was captured for: got {got}, captured "
                             f"{(tuple(self.input.shape), self.input.dtype, self.input.device)}")
        for cache in self.caches:
            if cache.longest + 1 > cache.capacity:
                raise ValueError(f"a sequence would reach {cache.longest + 1} tokens, more than the inference "
                                 f"cache's capacity {cache.capacity}")
        self.input.copy_(x)
        self.graph.replay()
        for cache in self.caches:
            cache.longest += 1
        return self.output
