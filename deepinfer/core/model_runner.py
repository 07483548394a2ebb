"""The model runner: the model, its decode-state cache and its step graphs, and the one place a step
runs. `prepare` turns a planned step into the model's inputs (padding a decode batch to a captured
size), `forward` runs it (eagerly, or recorded and replayed from its shape bucket: core/graphs.py),
`decode_steps` runs several greedy decode steps in one call. The engine loop and the speculative
decoder call these; neither sees a step graph.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from deepinfer.backends.base import Accelerator
from deepinfer.core import memory
from deepinfer.core.cache import StateCache
from deepinfer.core.graphs import StepGraphs
from deepinfer.models.base import step_inputs, with_step_tensors
from deepinfer.models.base import FeaturesRequest, ParallelContext, StepInput

PAGE_TOKENS = 128  # positions per page: a multiple of every pool's stride (DeepSeek-V4's compress rates)


def _host(xs) -> torch.Tensor:
    """Host step metadata as an int64 tensor: via numpy, which takes a list in a third of torch.tensor's time."""
    return torch.from_numpy(np.asarray(xs, dtype=np.int64))


@dataclass(slots=True)
class FeatureTap:
    """Hidden features a step hands on as it runs (the speculative drafter's context): the outputs of
    model layers `layers` at flat token rows `rows`, given to `sink(features, slots, positions)` inside
    the step, so a recorded step replays the hand-over too."""

    layers: tuple[int, ...]
    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    sink: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class ModelRunner:
    """Owns the model, its cache and the step graphs.

    `max_draft`: draft tokens a speculative step may verify per sequence (0: no drafting). Steps in
    which every sequence feeds the same number of tokens, at most max_draft + 1, are captured: plain
    decode steps and verify steps of full-length drafts. Mixed lengths would each be a new bucket,
    recorded twice and rarely replayed; prefill steps rarely repeat a shape."""

    def __init__(self, model, accel: Accelerator, config, max_model_len: int, dtype: torch.dtype, weight_bytes: int,
                 parallel: ParallelContext | None = None, margin: int = 0, max_draft: int = 0):
        self.model, self.accel, self.max_draft = model, accel, max_draft
        self.cache, self.cache_plan = self._make_cache(model, accel, config, max_model_len, dtype, weight_bytes,
                                                       margin)
        # decode steps (and speculative drafting and verify steps) recorded once per shape bucket and
        # replayed (core/graphs.py); not with expert or context parallelism, whose collectives run
        # from Python inside the forward
        ctx = parallel or ParallelContext()
        self.graphs = StepGraphs(accel, max_tokens=config.max_num_seqs) \
            if StepGraphs.enabled(accel) and ctx.expert_parallel is None and ctx.context_parallel is None else None
        self._eager = False  # within `eager()`

    @contextmanager
    def eager(self):
        """Every step run inside runs eagerly and records nothing (start-up profiling)."""
        self._eager = True
        try:
            yield
        finally:
            self._eager = False

    # ------------------------------------------------------------ the cache
    @staticmethod
    def _make_cache(model, accel, ec, max_model_len: int, dtype: torch.dtype, weight_bytes: int,
                    margin: int) -> tuple[StateCache, memory.CachePlan]:
        """The cache, as many pages as core/memory.py's plan allows (at most every slot at max length)."""
        spec = model.cache_spec(margin=margin)

        def build(pages: int) -> StateCache:
            return StateCache(spec, max_seqs=ec.max_num_seqs, num_pages=pages,
                              max_step_tokens=ec.max_num_batched_tokens, max_model_len=max_model_len,
                              page_tokens=PAGE_TOKENS, dtype=dtype, device=accel.device)
        element = torch.tensor([], dtype=dtype).element_size()
        per_slot = spec.bytes_per_slot(element)
        per_page = spec.bytes_per_page(PAGE_TOKENS, element)
        scratch = spec.bytes_scratch(ec.max_num_batched_tokens, element)
        # + the trash slot and page that padded steps write to (core/cache.py)
        fixed = per_slot * (ec.max_num_seqs + 1) + per_page + scratch
        if ec.num_cache_pages is not None:
            plan = memory.CachePlan(ec.gpu_memory_utilization, 0, weight_bytes, 0, 0, fixed, per_page,
                                    ec.num_cache_pages, "num_cache_pages")
            return build(ec.num_cache_pages), plan
        cfg = model.config
        # parallel ranks agree on the memory free before loading (EngineConfig.available_memory)
        free = ec.available_memory - weight_bytes if ec.available_memory is not None else accel.memory_info()[0]
        plan = memory.plan_pages(
            utilization=ec.gpu_memory_utilization, free_after_weights=free, weight_bytes=weight_bytes,
            headroom=memory.activation_headroom(cfg.hidden_size, cfg.vocab_size, ec.max_num_batched_tokens,
                                                ec.max_num_seqs),
            fixed=fixed, per_page=per_page, max_pages=ec.max_num_seqs * -(-max_model_len // PAGE_TOKENS),
            cache_bytes=ec.cache_bytes, device=accel.name,
            what=f"{ec.max_num_seqs} sequence slots (+1 for padding) of {per_slot} bytes, the step scratch of "
                 f"{scratch} bytes, the padding page")
        return build(plan.pages), plan

    def cache_bytes(self) -> dict[str, int]:
        c = self.cache
        element = c.element_size
        return {"total": sum(p.data.numel() for p in c.pools.values()) * element, "pages": c.num_pages,
                "per_page": c.bytes_per_page(), "slots": c.max_seqs, "slot_bytes": c.bytes_per_slot() * c.max_seqs,
                "scratch_bytes": c.spec.bytes_scratch(c.max_step_tokens, element)}

    # ------------------------------------------------------------ steps
    def prepare(self, ids: list[int], slots: list[int], starts: list[int], lens: list[int],
                floors: list[int], restored: list[int], logit_rows: list[int]):
        """A step planned on the host (sequences back to back) as the model's input and metadata.
        A decode step (one token per sequence) is padded to a captured batch size: extra sequences at
        the cache's trash slot, position 0, whose logits (appended to `logit_rows`) nobody reads.
        -> (StepInput, the model's step metadata)."""
        pad = self.graphs.padded_batch(len(ids)) - len(ids) if self.graphs is not None and len(ids) == len(slots) \
            and not self.max_draft else 0
        if pad:
            ids, slots, starts, lens = ids + [0] * pad, slots + [self.cache.trash_slot] * pad, starts + [0] * pad, \
                lens + [1] * pad
            floors, restored = floors + [0] * pad, restored + [0] * pad
            logit_rows.extend(range(len(ids) - pad, len(ids)))
        inp = StepInput(_host(ids), _host(slots), _host(starts), _host(lens))
        if any(restored):  # a prefix-cache hit is being replayed in this step
            inp.window_floor, inp.num_restored = _host(floors), _host(restored)
        return inp, self.model.prepare(inp, self.cache)

    def _captures(self, inp: StepInput) -> bool:
        """Whether a step of `inp` is recorded and replayed (see the class doc)."""
        graphs = self.graphs
        batch, num_tokens = inp.lens.shape[0], inp.ids.shape[0]
        if graphs is None or self._eager or not 0 < batch <= graphs.max_tokens:
            return False
        if num_tokens == batch:  # one token per sequence
            return True
        lens = inp.lens.cpu().numpy()
        return lens.max() == lens.min() and lens[0] <= self.max_draft + 1

    def forward(self, inp: StepInput, meta, logit_rows: torch.Tensor, tap: FeatureTap | None = None) -> torch.Tensor:
        """The model's forward of a step (`meta` None: planned here): logits of `logit_rows`, with
        `tap`'s features handed on. Replayed from its bucket's recording where `_captures` says so."""
        model, cache = self.model, self.cache
        if meta is None:
            meta = model.prepare(inp, cache)
        extra = [] if tap is None else [tap.rows, tap.slots, tap.positions]

        def run(meta, logit_rows, *tapped):
            if tap is None:
                return model.forward(inp, cache, logit_rows, meta)
            rows, slots, positions = tapped
            logits, features = model.forward(inp, cache, logit_rows, meta, FeaturesRequest(tap.layers, rows))
            tap.sink(features, slots, positions)
            return logits

        if not self._captures(inp):
            return run(meta, logit_rows, *extra)
        tensors, sizes = step_inputs(meta)
        n = len(tensors)
        return self.graphs.run(("decode" if tap is None else "verify", sizes), lambda: run(meta, logit_rows, *extra),
                               tensors + [logit_rows] + extra,
                               lambda inputs: run(with_step_tensors(meta, inputs[:n]), *inputs[n:]))

    def decode_steps(self, ids: list[int], slots: list[int], starts: list[int], steps: int,
                     per_yield: int | None = None) -> Iterator[torch.Tensor]:
        """`steps` greedy decode steps of a batch: sequence b feeds ids[b] at position starts[b],
        then its own argmax each step. The model plans all steps at once; each step, with its
        argmax, is replayed from its bucket's recording with the step before's tokens fed in.
        Yields the tokens as they are decoded, [n, B] for each `per_yield` steps (all `steps` in one
        yield when None; the cpu tape runs each yield's steps in one call), so a stream can carry
        every step's token while the next ones run. Closing the generator skips the steps not yet
        run (every sequence stopped)."""
        batch = len(ids)
        inp = StepInput(_host(ids), _host(slots), _host(starts), torch.ones(batch, dtype=torch.int64))
        meta = self.model.prepare(inp, self.cache, steps=steps)
        tensors, sizes = step_inputs(meta)
        ids_input = next(i for i, t in enumerate(tensors) if t is meta.ids)
        model, cache, accel = self.model, self.cache, self.accel

        def step(inputs):  # one step on row s of the plan (inputs[:-1]) and the logit rows
            return accel.argmax(model.forward(inp, cache, inputs[-1], with_step_tensors(meta, inputs[:-1])))

        rows = torch.arange(batch, device=meta.ids.device)
        replayed = self.graphs is not None and not self._eager and batch <= self.graphs.max_tokens
        per_yield = per_yield or steps
        for first in range(0, steps, per_yield):
            n = min(per_yield, steps - first)
            if replayed:
                out = self.graphs.run_steps(("greedy decode", sizes), tensors, [rows], n, [(0, ids_input)], step,
                                            first)[0]
            else:
                column = []
                for s in range(first, first + n):
                    inputs = [t[s] for t in tensors] + [rows]
                    if column:
                        inputs[ids_input] = column[-1]
                    column.append(step(inputs))
                out = torch.stack(column)
            if first + n < steps:  # the next yield's first step feeds this one's last tokens
                tensors[ids_input][first + n].copy_(out[-1])
            yield out.cpu()

    def run_captured(self, key: tuple, batch: int, fn: Callable[[list[torch.Tensor]], object],
                     inputs: list[torch.Tensor]):
        """A step of the model's other parts (the speculative drafter's block) over `inputs`, recorded
        and replayed like a decode step where its batch fits, `key` naming its kind."""
        if self.graphs is None or self._eager or batch > self.graphs.max_tokens:
            return fn(inputs)
        return self.graphs.run(key, lambda: fn(inputs), inputs, fn)
