"""Work on a side CUDA stream, forked from the current one and joined back (`beside`): the queries of a C layer's
decode step beside its top-k, and the warm-up calls before a CUDA-graph capture."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch import Tensor

Result = TypeVar("Result")

_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def beside(work: Callable[[], Result], device: torch.device) -> Callable[[], Result]:
    """Starts `work` (kernels on `device`, nothing read back) on a side stream forked from the current one, so that it
    runs beside the kernels the current stream queues next, and returns the join: the current stream waits for the
    side's work, then takes its result. A captured graph records the fork and the join as edges. Off CUDA, and while
    `torch.compile` traces (it would put the streams in the graph it builds), `work` runs at once."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        result = work()
        return lambda: result
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        result = work()

    def join() -> Result:
        main.wait_stream(side)
        if not torch.cuda.is_current_stream_capturing():
            for tensor in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(tensor, Tensor):
                    tensor.record_stream(main)  # freed later on main's timeline, not the side's
        return result
    return join
