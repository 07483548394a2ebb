"""CUDA graphs for the nvidia backend: a decode step that core/graphs.py recorded twice the same
way is captured once as a torch.cuda.CUDAGraph on static input buffers and replayed for every later
step of its bucket (the engine pads decode batches up to the captured sizes,
DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL).

The recording's instruction list is not what runs here: the nvidia kernels are Triton launches,
which never reach the dispatcher, so the capture runs the step's own Python graph (`step_fn`, the
model's forward on the given tensors) under stream capture, with the static buffers as its inputs.
Capture happens at the bucket's third step, after two eager runs of the same shapes compiled every
Triton kernel and initialised cuBLAS: the buffers are filled with that step's inputs first, the
capture itself executes nothing, and the replay that follows runs the step. A replay copies the
inputs into the buffers, replays the graph and returns copies of its outputs: the graph writes the
same output buffers on every replay, and with overlapped scheduling the engine still reads a step's
logits while the next step runs.

A capture or replay that raises raises ReplayError with state_written False, and the engine runs the
bucket eagerly from then on (core/graphs.py): a capture executes nothing, and a graph launch that
fails fails before any of its kernels runs (a kernel's own fault is asynchronous and surfaces at a
later synchronisation, not here; the CUDA context is lost then in any case).
"""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.backends.base import ReplayError


def _flatten(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in _flatten(v)]


class CapturedStep:
    """`step(inputs) -> outputs` for one bucket. `capture(fn) -> replay` makes the graph: on a GPU
    `cuda_capture` (fn runs under stream capture, nothing executes, replay() runs it), elsewhere any
    stand-in with that contract (tests: one that calls fn on every replay)."""

    def __init__(self, recording, step_fn: Callable, device: torch.device, capture: Callable):
        self.static = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                       for shape, stride, dtype in recording.input_specs]
        self.step_fn, self.capture = step_fn, capture
        self.replay, self.outputs = None, None

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        for buffer, x in zip(self.static, inputs):
            buffer.copy_(x, non_blocking=True)
        if self.replay is None:  # the first call captures, with this step's inputs in the buffers
            self.outputs = [None]

            def run():
                self.outputs[0] = _flatten(self.step_fn(self.static))

            try:
                self.replay = self.capture(run)
            except Exception as exc:  # noqa: BLE001 - any capture error: the step runs eagerly instead
                raise ReplayError(f"capture failed: {type(exc).__name__}: {exc}", state_written=False) from exc
        try:
            self.replay()
        except Exception as exc:  # noqa: BLE001
            raise ReplayError(f"replay failed: {type(exc).__name__}: {exc}", state_written=False) from exc
        return [o.clone() for o in self.outputs[0]]


def cuda_capture(pool) -> Callable:
    """capture(fn) for CapturedStep: fn under torch.cuda.graph, in the shared memory pool `pool`
    (one per backend: the buckets' graphs never run at the same time)."""

    def capture(fn: Callable) -> Callable:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    return capture
