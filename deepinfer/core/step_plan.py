"""One engine step as the loop hands it around: planned on the host (core/engine.py), executed on the
device (core/model_runner.py, core/speculative/), post-processed on the host (core/postprocess.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.core.request import Request
from deepinfer.core.scheduler import ScheduledChunk
from deepinfer.models.base import StepInput


@dataclass(slots=True)
class StepPlan:
    """One step as planned on the CPU, executed on the device, post-processed on the CPU."""

    chunks: list[ScheduledChunk]
    inp: StepInput | None = None
    meta: object = None  # StepMeta: index tensors, read from the cache's block table at planning time
    logit_rows: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    adjust: object = None  # SamplingParams' logit adjustments of the sampled rows (core/logits.py), None: none
    # per chunk: (start position, prompt-logprob rows, whether it samples), fixed at planning time
    prompt_rows: list[tuple[int, int, bool]] = field(default_factory=list)
    sampling: list[Request] = field(default_factory=list)
    sampling_inputs: tuple = ()
    drafts: list = field(default_factory=list)  # per sampling row: its spec Draft, or None
    grammar: bool = False
    # multimodal rows of the step: (first flat row, item, first and end span position fed), embedded by _execute
    mm: list = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    future: object = None


@dataclass(slots=True)
class StepStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


class Done:
    """A finished future (synchronous steps)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value
