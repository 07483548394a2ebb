"""The step loop: schedule -> model forward -> sample -> post-process."""

from __future__ import annotations

import collections
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.backends.base import Accelerator
from deepinfer.core import memory
from deepinfer.core.cache import StateCache
from deepinfer.core.graphs import StepGraphs, step_inputs, with_step_tensors
from deepinfer.core.kv_events import KVEventsConfig, medium_of
from deepinfer.core.loader import load_checkpoint
from deepinfer.core.replay import BoundedReplay
from deepinfer.core.request import Request
from deepinfer.core.sampler import Sampler, top_logprobs
from deepinfer import envs
from deepinfer.core.scheduler import ScheduledChunk, Scheduler
from deepinfer.core.spec.decoder import SpecDecoder
from deepinfer.core.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.models.base import ParallelContext, StepInput
from deepinfer.models.registry import load_config

logger = logging.getLogger("deepinfer")
PAGE_TOKENS = 128  # positions per page: a multiple of every pool's stride (DeepSeek-V4's compress rates)


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(max_position_embeddings, 8192)
    cache_bytes: int | None = None  # budget for the decode state (slots + pages); overrides the next
    gpu_memory_utilization: float = 0.9  # share of (free after weights + weights) the engine fills (core/memory.py)
    num_cache_pages: int | None = None  # or an explicit page count
    # compute dtype: the inputs of weight ops and the decode state; weights keep their stored format.
    # auto = the accelerator's preferred_dtype (float32 on cpu, bfloat16 on nvidia and ascend)
    dtype: str = "auto"
    seed: int = 0
    # DSpark drafting when the checkpoint has a drafter and DEEPINFER_USE_NEXTN_DECODE > 0; parallel
    # ranks turn it off (their verify lengths come from per-rank timings and would diverge)
    speculative: bool = True
    # bytes free before the weights were loaded, to plan the cache from; None: what the accelerator
    # reports free once they are (parallel ranks that must plan identical caches pass the smallest
    # value any of them sees)
    available_memory: int | None = None
    # engine processes sharing this machine's cores (parallel ranks): each uses its share
    processes_per_host: int = 1
    # publish the prefix cache's KV events for routers (core/kv_events.py); None: off
    kv_events: KVEventsConfig | None = None

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("max_model_len", "cache_bytes", "num_cache_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_events is not None and not isinstance(self.kv_events, KVEventsConfig):
            raise ValueError(f"kv_events must be a KVEventsConfig (KVEventsConfig.parse), got {self.kv_events!r}")

    def compute_dtype(self, accel: Accelerator) -> torch.dtype:
        return accel.preferred_dtype if self.dtype == "auto" else getattr(torch, self.dtype)


class _Done:
    """A finished future (synchronous steps)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


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


class LLMEngine:
    def __init__(self, model_dir: str | os.PathLike, accel: Accelerator, config: EngineConfig,
                 tokenizer: str | os.PathLike | None = None, parallel: ParallelContext | None = None):
        config.validate()
        self.accel = accel
        self.engine_config = config
        self.model_config, model_cls = load_config(model_dir)  # the family's config and model class
        cfg = self.model_config
        dtype = config.compute_dtype(accel)
        accel.set_compute_dtype(dtype)
        if config.available_memory is None and (parallel is None or parallel.expert_parallel is None):
            memory.check_weights_fit(model_dir, accel.memory_info()[0], config.gpu_memory_utilization, accel.name)
        weights, self.extra_weights = load_checkpoint(model_dir, model_cls.checkpoint_tensors(cfg), model_cls,
                                                      keep_prefixes=model_cls.extra_prefixes,
                                                      skip_prefixes=model_cls.ignored_prefixes(cfg))
        accel.tune_for_model(cfg.hidden_size, config.processes_per_host)
        self.model = model_cls(cfg, weights, accel, parallel)
        weight_kinds = memory.weights_by_kind(weights, self.extra_weights)
        del weights
        self.max_model_len = min(config.max_model_len or min(cfg.max_position_embeddings, 8192),
                                 cfg.max_position_embeddings)
        # DSpark speculative decoding, when the checkpoint has a drafter and DEEPINFER_USE_NEXTN_DECODE > 0
        # (unset: the accelerator's `speculative_decoding` choice)
        self.spec = (SpecDecoder.create(self.model, self.extra_weights, accel, config.max_num_seqs)
                     if config.speculative else None)
        self.tokenizer = Tokenizer(tokenizer or model_dir, bos_token_id=cfg.bos_token_id) \
            if tokenizer is not None or os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
        self.cache, plan = self._make_cache(dtype, sum(weight_kinds.values()))
        self.memory = memory.MemoryReport(accel.name, weight_kinds, memory.checkpoint_bytes(model_dir),
                                          self._cache_bytes(), plan, accel.memory_info()[0])
        logger.info("%s", self.memory)
        # decode steps (and DSpark's drafting and verify steps) recorded once per shape bucket and
        # replayed (core/graphs.py); not with expert or context parallelism, whose collectives run
        # from Python inside the forward
        ctx = parallel or ParallelContext()
        self.graphs = StepGraphs(accel, max_tokens=config.max_num_seqs) \
            if StepGraphs.enabled(accel) and ctx.expert_parallel is None and ctx.context_parallel is None else None
        if self.spec is not None:
            self.spec.start(self.cache, config.max_num_batched_tokens, graphs=self.graphs)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   BoundedReplay.from_env(self.model.replay_window, self.cache))
        self.sampler = Sampler(accel, cfg.vocab_size, cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.last_step = StepStats()
        self.structured = None  # structured outputs (core/structured.py), built on the first so_args request
        self.zero_overhead = envs.zero_overhead_scheduling(default=accel.overlap_scheduling)
        self.multi_step = max(1, envs.get("DEEPINFER_MULTI_STEP_DECODE"))
        # one worker runs the model so the CPU can plan the next step meanwhile
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-step") \
            if self.zero_overhead else None
        self.in_flight: StepPlan | None = None
        self.num_forwards = 0  # model calls (parallel ranks keep their collectives in lockstep by it)
        self.num_encoded_items = 0  # multimodal items (images) run through the model's encoder
        self.timeline: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds per phase
        self.kv_events = None  # core/kv_event_publisher.py's KVEventPublisher while KV events are published
        if config.kv_events is not None:
            self.start_kv_events(config.kv_events)

    def start_kv_events(self, config: KVEventsConfig) -> None:
        """Publish the prefix cache's KV events as `config` says, one batch per step (core/kv_events.py)."""
        from deepinfer.core.kv_event_publisher import KVEventPublisher

        if self.cache.prefix is None:
            raise ValueError("kv_events_config: this model keeps no paged decode state, so it has no prefix cache "
                             "whose pages could be reported; leave kv_events_config out")
        if self.kv_events is not None:
            raise RuntimeError("KV events are already published by this engine")
        self.kv_events = KVEventPublisher(config)
        self.cache.prefix.record_events(medium_of(self.cache.device))

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.cache.prefix.take_events())

    def _make_cache(self, dtype: torch.dtype, weight_bytes: int) -> tuple[StateCache, memory.CachePlan]:
        """The cache, as many pages as core/memory.py's plan allows (at most every slot at max length)."""
        ec = self.engine_config
        spec = self.model.cache_spec(margin=self.spec.margin if self.spec is not None else 0)

        def build(pages: int) -> StateCache:
            return StateCache(spec, max_seqs=ec.max_num_seqs, num_pages=pages,
                              max_step_tokens=ec.max_num_batched_tokens, max_model_len=self.max_model_len,
                              page_tokens=PAGE_TOKENS, dtype=dtype, device=self.accel.device)
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
        cfg = self.model_config
        # parallel ranks agree on the memory free before loading (EngineConfig.available_memory)
        free = ec.available_memory - weight_bytes if ec.available_memory is not None else self.accel.memory_info()[0]
        plan = memory.plan_pages(
            utilization=ec.gpu_memory_utilization, free_after_weights=free, weight_bytes=weight_bytes,
            headroom=memory.activation_headroom(cfg.hidden_size, cfg.vocab_size, ec.max_num_batched_tokens,
                                                ec.max_num_seqs),
            fixed=fixed, per_page=per_page, max_pages=ec.max_num_seqs * -(-self.max_model_len // PAGE_TOKENS),
            cache_bytes=ec.cache_bytes, device=self.accel.name,
            what=f"{ec.max_num_seqs} sequence slots (+1 for padding) of {per_slot} bytes, the step scratch of "
                 f"{scratch} bytes, the padding page")
        return build(plan.pages), plan

    def _cache_bytes(self) -> dict[str, int]:
        c = self.cache
        element = c.element_size
        return {"total": sum(p.data.numel() for p in c.pools.values()) * element, "pages": c.num_pages,
                "per_page": c.bytes_per_page(), "slots": c.max_seqs, "slot_bytes": c.bytes_per_slot() * c.max_seqs,
                "scratch_bytes": c.spec.bytes_scratch(c.max_step_tokens, element)}

    # ------------------------------------------------------------ requests
    def process_multimodal(self, prompt_token_ids: list[int], data: dict, what: str = "prompt"):
        """(prompt ids with each placeholder expanded into its item's span, the MultimodalItems) of a
        request with multimodal data, laid out by the model's family; a ValueError names `what` and
        the problem (images for a text-only model, an undecodable image, placeholders and images
        that do not pair up). Pure host work: safe to call from any thread."""
        try:
            mm = self.model.process_multimodal(list(prompt_token_ids), data)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        return mm.prompt_token_ids, mm.items

    @property
    def multimodal_placeholders(self) -> dict[str, int]:
        """Placeholder text -> token id of the model's multimodal inputs (empty: text only)."""
        return self.model.multimodal_placeholders

    def validate_request(self, prompt_token_ids: list[int], params, what: str = "prompt", mm_items=()) -> None:
        """Raise a clear ValueError for a request the engine could never serve."""
        if not prompt_token_ids:
            raise ValueError(f"{what} is empty: give at least one token (or non-empty text)")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} has token ids outside [0, vocab_size={vocab}): {bad[:5]}")
        marks = set(self.multimodal_placeholders.values())
        if marks and not mm_items and not marks.isdisjoint(prompt_token_ids):  # a span with nothing to fill it
            raise ValueError(f"{what} holds the model's multimodal placeholder token(s) "
                             f"{sorted(marks.intersection(prompt_token_ids))} but no multi_modal_data: give one image "
                             "per placeholder in multi_modal_data, or remove the placeholders")
        if len(prompt_token_ids) >= self.max_model_len:
            of_which, fewer = "", ""
            if mm_items:  # an image's span is fixed by the model's token budget: fewer images, or a longer context
                of_which = f" ({sum(i.length for i in mm_items)} of them for its {len(mm_items)} multimodal item(s))"
                fewer = ", send fewer images"
            raise ValueError(f"{what} has {len(prompt_token_ids)} tokens{of_which}; max_model_len={self.max_model_len} "
                             f"leaves no room to generate: shorten the prompt{fewer} or raise max_model_len")
        longest = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if self.cache.pages_for(longest) > self.cache.num_pages:
            raise ValueError(f"a request of {longest} tokens needs {self.cache.pages_for(longest)} cache pages, "
                             f"the cache has {self.cache.num_pages}: raise cache_bytes or lower max_tokens")
        for name, ids in params.token_ids_to_check().items():
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside [0, vocab_size={vocab}): {bad[:5]}")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer (this model directory has none): pass "
                             "tokenizer=..., or ban token ids with logit_bias {id: -100}")
        if params.so_args is not None:  # structured outputs: starts the compile, rejects what fails fast
            self._structured().check(params.so_args)

    def _structured(self):
        if self.structured is None:
            from deepinfer.core.structured import StructuredOutputs
            self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                                self.model_config.eos_token_ids, self.accel)
        return self.structured

    def add_request(self, prompt_token_ids: list[int], params, prompt: str | None = None,
                    request_id: str | None = None, mm_items=None) -> Request:
        """mm_items: from process_multimodal (prompt_token_ids is then the expanded prompt)."""
        self.validate_request(prompt_token_ids, params, mm_items=mm_items or ())
        req = Request(prompt_token_ids, params, prompt, request_id, mm_items)
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens)
        if params.bad_words:
            req.bad_words_ids = self.tokenizer.bad_words_ids(params.bad_words)
        self.requests[req.request_id] = req
        if params.so_args is not None:  # structured outputs: reaches the scheduler once its grammar is ready
            self._structured().submit(req)
        else:
            self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        if self.structured is not None:  # structured outputs
            self.structured.discard(req)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        self.sampler.release(req)
        self.scheduler.finish(req)
        req.finish("abort")
        self._publish_kv_events()  # its pages entered the cache: the engine may be idle until the next step

    def close(self) -> None:
        """Finish the step in flight and stop the worker thread and the KV event publisher."""
        if self.in_flight is not None:
            self._drain()
        if self.worker is not None:
            self.worker.shutdown(wait=True)
            self.worker = None
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.close()
            self.kv_events = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None or (self.structured is not None and self.structured.has_pending())

    def pop_finished(self) -> list[Request]:
        done = [r for r in self.requests.values() if r.is_finished]
        for r in done:
            del self.requests[r.request_id]
        return done

    def stats(self) -> dict[str, float]:
        """Counters since start-up: prefix cache lookups, hits, replay and evictions; preemptions;
        with DSpark drafting, its steps and verified / accepted draft tokens."""
        out = {"num_preemptions": self.scheduler.num_preemptions, "num_encoded_items": self.num_encoded_items}
        if self.cache.prefix is not None:
            out.update({f"prefix_cache_{k}": v for k, v in self.cache.prefix.stats.as_dict().items()})
        if self.spec is not None:
            out.update({f"spec_{k}": v for k, v in self.spec.stats.items()})
        return out

    # ------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one step (_step); returns the requests that finished in it. The step's KV events
        go out as one batch."""
        finished = self._step()
        self._publish_kv_events()
        return finished

    def _step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it.

        With zero-overhead scheduling the model runs on a worker thread: this call plans step
        N+1 and hands it to the worker while step N may still be running, then post-processes
        step N while N+1 runs. Tokens sampled in step N reach step N+1 as placeholders that the
        worker resolves from N's output (the future map), so planning never waits for them."""
        t0 = time.perf_counter()
        grammar_failed = [] if self.structured is None else \
            self.structured.poll(self.scheduler, block=not self.scheduler.has_work() and self.in_flight is None)
        overlap = self.zero_overhead and not self._needs_sync()
        if not overlap and self.in_flight is not None:
            return grammar_failed + self._drain()  # finish step N before planning a synchronous one
        with self._timed("schedule"):
            chunks = self.scheduler.schedule()
        steps = self._multi_step_length(chunks) if chunks and not overlap else 1
        if steps > 1:
            finished = self._multi_step(chunks, steps)
            self.last_step = StepStats(0, steps * len(chunks), time.perf_counter() - t0)
            return grammar_failed + finished
        with self._timed("prepare"):
            plan = self._plan(chunks, draft=not overlap) if chunks else None
        finished = list(grammar_failed)
        if plan is not None and not overlap:
            plan.future = _Done(self._execute(plan, None))
            finished += self._finish(plan)
        else:
            if plan is not None:
                previous = self.in_flight
                plan.future = self.worker.submit(self._execute, plan, previous)
            finished += self._drain()
            self.in_flight = plan
        self.last_step = StepStats(plan.prefill_tokens if plan else 0, plan.decode_tokens if plan else 0,
                                   time.perf_counter() - t0)
        if self.spec is not None and plan is not None and not overlap:  # a whole step, planned to finished
            self.spec.observe_step(plan, self.last_step.seconds)
        return finished

    def _multi_step_length(self, chunks: list[ScheduledChunk]) -> int:
        """How many decode steps this step may run in one call of the model (multi-step
        scheduling: the per-step planning and post-processing happen once per call), 1 for a plain
        step. Only when every scheduled request decodes one greedy token with nothing that needs
        the host between tokens (drafting, a grammar, logprobs), none waits to be admitted (it
        would wait for the whole call), and no request reaches max_tokens or max_model_len within
        the call: stop tokens and strings are checked afterwards, dropping what followed them."""
        steps = self.multi_step
        if steps <= 1 or self.spec is not None or self.scheduler.waiting or not self.model.multi_step_decode:
            return 1
        window = self.model.replay_window
        for c in chunks:
            req = c.request
            if (c.num_tokens != 1 or not c.completes or req.num_computed < req.num_prompt_tokens or req.pending
                    or req.params.temperature >= 1e-5 or req.params.top_logprobs or req.grammar is not None
                    or req.params.adjusts_logits):  # SamplingParams' adjustments run in single steps
                return 1
            if req.window_floor and req.num_computed - req.window_floor < window:  # a replay's floor still masks keys
                return 1
            steps = min(steps, req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
            if steps <= 1 or not self.cache.can_grow(req.slot, req.num_computed + steps):
                return 1
        return steps

    def _multi_step(self, chunks: list[ScheduledChunk], steps: int) -> list[Request]:
        """Run `steps` greedy decode steps of the scheduled requests in one call, then post-process
        their tokens in order, as `steps` plain steps would have. A request that stops within the
        call keeps the tokens up to its stop; the state computed past it is released with it."""
        reqs = [c.request for c in chunks]
        with self._timed("prepare"):
            for req in reqs:
                self.cache.grow(req.slot, req.num_computed + steps)
            starts = [req.num_computed for req in reqs]
            ids = [req.token(start) for req, start in zip(reqs, starts)]
        with self._timed("forward"):
            tokens = self._decode_steps(ids, [req.slot for req in reqs], starts, steps)
        self.num_forwards += 1
        finished = []
        with self._timed("postprocess"):
            for req, start, new_tokens in zip(reqs, starts, tokens.t().tolist()):
                req.num_computed = start + steps
                if req.detok is None and not req.params.stop_strings:  # stops decided by token ids alone
                    j = self._first_stop(req, new_tokens)
                    req.output_token_ids.extend(new_tokens if j is None else new_tokens[:j + 1])
                    if j is not None:
                        self._check_stop(req, new_tokens[j])  # the same reason a token-by-token check gives
                else:
                    for j, token in enumerate(new_tokens):
                        req.output_token_ids.append(token)
                        self._check_stop(req, token)
                        if req.is_finished:
                            break
                if req.is_finished:  # positions fed with tokens it keeps: start .. start + j
                    req.num_computed = start + j + 1
                    self._retire(req)
                    finished.append(req)
        return finished

    def _first_stop(self, req: Request, new_tokens: list[int]) -> int | None:
        """Index of the first of `new_tokens` (to follow req's outputs, none pending) at which
        _check_stop would finish a request that has no stop strings and no detokenizer: a stop token,
        or max_tokens / max_model_len reached; None if none does."""
        params = req.params
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops.update(self.model_config.eos_token_ids)
        # after j + 1 more tokens: len(outputs) + j + 1 >= max_tokens, or prompt + that >= max_model_len
        produced = len(req.output_token_ids)
        last = min(params.max_tokens - produced, self.max_model_len - req.num_prompt_tokens - produced) - 1
        for j, token in enumerate(new_tokens):
            if token in stops or j >= last:
                return j
        return None

    def _decode_steps(self, ids: list[int], slots: list[int], starts: list[int], steps: int) -> torch.Tensor:
        """`steps` greedy decode steps of a batch: sequence b feeds ids[b] at position starts[b],
        then its own argmax each step. The model plans all steps at once; each step, with its
        argmax, is replayed from its bucket's recording (the cpu tape runs them all in one call)
        with the step before's tokens fed in. -> tokens [steps, B]."""
        as_tensor = lambda xs: torch.from_numpy(np.asarray(xs, dtype=np.int64))  # noqa: E731
        batch = len(ids)
        inp = StepInput(as_tensor(ids), as_tensor(slots), as_tensor(starts), torch.ones(batch, dtype=torch.int64))
        meta = self.model.prepare(inp, self.cache, steps=steps)
        tensors, sizes = step_inputs(meta)
        ids_input = next(i for i, t in enumerate(tensors) if t is meta.ids)
        model, cache, accel = self.model, self.cache, self.accel

        def step(inputs):  # one step on row s of the plan (inputs[:-1]) and the logit rows
            return accel.argmax(model.forward(inp, cache, inputs[-1], with_step_tensors(meta, inputs[:-1])))

        rows = torch.arange(batch, device=meta.ids.device)
        if self.graphs is not None and batch <= self.graphs.max_tokens:
            return self.graphs.run_steps(("greedy decode", sizes), tensors, [rows], steps, [(0, ids_input)], step)[0].cpu()
        out = []
        for s in range(steps):
            inputs = [t[s] for t in tensors] + [rows]
            if out:
                inputs[ids_input] = out[-1]
            out.append(step(inputs))
        return torch.stack(out).cpu()

    def _model_step(self, inp: StepInput, meta, logit_rows: torch.Tensor) -> torch.Tensor:
        """The model's forward of a step: replayed from the bucket's recording for decode steps (one
        token per sequence) where steps are captured."""
        model, cache = self.model, self.cache
        num_tokens = inp.ids.shape[0]
        if self.graphs is None or num_tokens != inp.lens.shape[0] or num_tokens > self.graphs.max_tokens:
            return model.forward(inp, cache, logit_rows, meta)
        tensors, sizes = step_inputs(meta)
        return self.graphs.run(("decode", sizes), lambda: model.forward(inp, cache, logit_rows, meta),
                               tensors + [logit_rows],
                               lambda inputs: model.forward(inp, cache, inputs[-1], with_step_tensors(meta, inputs[:-1])))

    def _retire(self, req: Request) -> None:
        """A request that just finished: flush its text, free its slot and pages."""
        if req.detok is not None and not isinstance(req.stop_reason, str):
            req.text += req.detok.flush()
        if self.spec is not None:
            self.spec.forget(req.request_id)
        self.sampler.release(req)
        self.scheduler.finish(req)

    def _needs_sync(self) -> bool:
        """Overlap would be wrong when a grammar must see step N's token before it masks step
        N+1's logits: any request under a grammar makes the step synchronous. So does drafting:
        the drafter's anchor and the next step's positions depend on how many drafts were accepted."""
        if self.spec is not None and self.spec.wants_to_draft(self.scheduler.running):
            return True
        # a multi-token bad word bans its last token after the others: the host must see each token
        if any(len(w) > 1 for r in self.scheduler.running for w in r.bad_words_ids):
            return True
        if self.structured is None:
            return False
        return any(r.grammar is not None for r in self.scheduler.running) or \
            any(r.grammar is not None for r in self.scheduler.waiting)

    def _drain(self) -> list[Request]:
        """Wait for the in-flight step (if any) and post-process it."""
        plan, self.in_flight = self.in_flight, None
        if plan is None:
            return []
        with self._timed("wait"):
            plan.future.result()
        return self._finish(plan)

    @contextmanager
    def _timed(self, phase: str):
        """Accumulate wall time per step phase (benchmarks/overlap.py prints the timeline)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timeline[phase] += time.perf_counter() - t0

    def _plan(self, chunks: list[ScheduledChunk], draft: bool = True) -> "StepPlan":
        """Build the step's inputs on the CPU and advance the requests as if it had run: fed
        positions count as computed, and each sampling request gets a placeholder token
        (-(row+1): row `row` of this step's samples) that _finish replaces."""
        ids, slots, starts, lens, floors, restored = [], [], [], [], [], []
        plan = StepPlan(chunks=chunks)
        offset = 0
        now = time.perf_counter()
        drafts = {} if self.spec is None else self.spec.propose(
            chunks, self.engine_config.max_num_batched_tokens - sum(c.num_tokens for c in chunks), self.cache,
            self.max_model_len, allowed=draft)
        for c in chunks:
            req = c.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            start = req.num_computed
            draft = drafts.get(req.request_id)
            fed = req.tokens(start, start + c.num_tokens) + (draft.tokens if draft else [])
            ids.extend(fed)
            slots.append(req.slot)
            starts.append(start)
            lens.append(len(fed))
            floors.append(req.window_floor)
            restored.append(req.num_restored)
            if start < req.num_prompt_tokens:
                plan.prefill_tokens += c.num_tokens
            else:
                plan.decode_tokens += len(fed)
            n_prompt_rows = 0
            first = max(start, req.num_restored)  # logits of a prefix restored from the cache are not computed
            if req.wants_prompt_logprobs and first < min(start + c.num_tokens, req.num_prompt_tokens - 1):
                n_prompt_rows = min(start + c.num_tokens, req.num_prompt_tokens - 1) - first
                plan.logit_rows.extend(range(offset + first - start, offset + first - start + n_prompt_rows))
            for item in req.mm_items:  # multimodal spans this chunk feeds (their rows get the encoder's output)
                lo, hi = max(item.offset, start), min(item.end, start + c.num_tokens)
                if lo < hi:
                    plan.mm.append((offset + lo - start, item, lo - item.offset, hi - item.offset))
            completes = c.completes
            plan.prompt_rows.append((first, n_prompt_rows, completes))
            if completes:  # with drafts: one row per draft position plus the bonus row
                plan.sample_rows.append(len(plan.logit_rows))
                plan.logit_rows.extend(range(offset + c.num_tokens - 1, offset + len(fed)))
                plan.sampling.append(req)
                plan.drafts.append(draft)
            offset += len(fed)
            req.num_computed += c.num_tokens  # accepted drafts are added when the step is post-processed
        positions = [r.num_tokens for r in plan.sampling]  # the position each sampled token will take
        for row, req in enumerate(plan.sampling):
            req.output_token_ids.append(-(row + 1))
            req.pending += 1
        # a decode step padded to a captured batch size (core/graphs.py): extra sequences at the
        # cache's trash slot, position 0, whose logits nobody reads
        pad = self.graphs.padded_batch(len(ids)) - len(ids) if self.graphs is not None and len(ids) == len(slots) \
            and self.spec is None else 0
        if pad:
            ids, slots, starts, lens = ids + [0] * pad, slots + [self.cache.trash_slot] * pad, starts + [0] * pad, \
                lens + [1] * pad
            floors, restored = floors + [0] * pad, restored + [0] * pad
            plan.logit_rows.extend(range(len(ids) - pad, len(ids)))
        # host metadata (StepMeta moves it); via numpy, which takes a list in a third of torch.tensor's time
        t = lambda xs: torch.from_numpy(np.array(xs, dtype=np.int64))  # noqa: E731
        plan.inp = StepInput(t(ids), t(slots), t(starts), t(lens))
        if any(restored):  # a prefix-cache hit is being replayed in this step
            plan.inp.window_floor, plan.inp.num_restored = t(floors), t(restored)
        plan.meta = self.model.prepare(plan.inp, self.cache)
        plan.sampling_inputs = self.sampler.inputs(plan.sampling, positions)
        plan.adjust = self.sampler.adjustments(plan.sampling, positions)
        plan.grammar = any(r.grammar is not None for r in plan.sampling)
        return plan

    def _execute(self, plan: "StepPlan", previous: "StepPlan | None"):
        """Device work of a step (on the worker thread with overlap): resolve placeholders from
        the previous step's samples, run the model, mask, sample."""
        if previous is not None and bool((plan.inp.ids < 0).any()):  # host tensor: no device sync
            _, prev_tokens = previous.future.result()
            ids = plan.meta.ids
            plan.meta.ids = torch.where(ids < 0, prev_tokens[(-ids - 1).clamp(min=0)], ids)
        if plan.mm:
            with self._timed("encode"):
                plan.inp.embeds = self._multimodal_rows(plan.mm)
        with self._timed("forward"):
            rows = torch.tensor(plan.logit_rows, dtype=torch.int64)
            if self.spec is None:
                logits = self._model_step(plan.inp, plan.meta, rows)
            else:  # + the drafter's context features
                logits = self.spec.forward(plan.inp, self.cache, rows, plan.meta)
        self.num_forwards += 1
        tokens = None
        if any(d is not None for d in plan.drafts):
            with self._timed("verify"):
                tokens = self.spec.verify(logits, plan, self.sampler, self.structured)
        elif plan.sampling:
            with self._timed("sample"):
                # every logit row samples unless prompt logprobs asked for more rows (rows are increasing);
                # the grammar mask writes in place, so it gets a copy (the forward's are inference tensors)
                whole = len(plan.sample_rows) == logits.shape[0] and not plan.grammar
                sample_logits = logits if whole else logits[plan.sample_rows]
                if plan.grammar:  # structured outputs: grammar bitmask before sampling (such steps are synchronous)
                    self.structured.apply_bitmask(sample_logits, plan.sampling)
                tokens = self.sampler.sample(sample_logits, plan.sampling_inputs, plan.adjust)
        return logits, tokens

    def _multimodal_rows(self, fed: list) -> list[tuple[int, torch.Tensor]]:
        """The step's multimodal rows: items not yet encoded run through the model's encoder together,
        once per item (each keeps its output for the request's life: later chunks, preemption and
        replay reuse it); then each fed slice of a span goes to its rows."""
        todo = list({id(item): item for _, item, _, _ in fed if item.embeds is None}.values())
        if todo:
            for item, rows in zip(todo, self.model.encode_multimodal(todo), strict=True):
                item.embeds = rows
            self.num_encoded_items += len(todo)
        return [(row, item.embeds[lo:hi]) for row, item, lo, hi in fed]

    def _finish(self, plan: "StepPlan") -> list[Request]:
        """Post-process a step on the CPU: prompt logprobs, the sampled tokens, stop checks."""
        with self._timed("postprocess"):
            return self._postprocess(plan)

    def _postprocess(self, plan: "StepPlan") -> list[Request]:
        logits, tokens = plan.future.result()
        cursor = 0
        for c, (start, n_rows, completes) in zip(plan.chunks, plan.prompt_rows):
            if n_rows:
                self._record_prompt_logprobs(c.request, start, logits[cursor:cursor + n_rows])
            cursor += n_rows + (1 if completes else 0)
        if not plan.sampling:
            return []
        # per sampling row: the tokens it produced (several when drafts were accepted)
        produced = tokens if isinstance(tokens, list) else [[t] for t in tokens.tolist()]
        logprobs = None
        if any(r.params.top_logprobs for r in plan.sampling):
            k = max(r.params.top_logprobs for r in plan.sampling)
            rows = [plan.sample_rows[i] + j for i, toks in enumerate(produced) for j in range(len(toks))]
            flat = torch.tensor([t for toks in produced for t in toks], dtype=torch.int64)
            logprobs = iter(top_logprobs(logits[rows], flat, k))
        finished = []
        for req, new_tokens in zip(plan.sampling, produced):
            if req.is_finished:  # aborted, or stopped by the previous step: these tokens are discarded
                continue
            # the oldest placeholder belongs to this step: steps are post-processed in order
            req.output_token_ids[len(req.output_token_ids) - req.pending] = new_tokens[0]
            req.pending -= 1
            req.num_computed += len(new_tokens) - 1  # accepted drafts were fed in this step
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.perf_counter()
            for i, token in enumerate(new_tokens):
                row_logprobs = next(logprobs) if logprobs is not None else None
                if req.is_finished:  # stopped by an earlier token of this step: the rest is discarded
                    continue
                if i:
                    req.output_token_ids.append(token)
                if req.output_logprobs is not None:
                    req.output_logprobs.append({t: v for j, (t, v) in enumerate(row_logprobs.items())
                                                if j <= req.params.top_logprobs})
                self._check_stop(req, token)
                if req.grammar is not None:  # structured outputs: advance the matcher, stop when it terminates
                    self.structured.accept(req, token)
            if req.is_finished:
                self._retire(req)
                finished.append(req)
        return finished

    def _record_prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        recorded = len(req.prompt_logprobs) - (start + 1)  # rows recorded before a preemption
        if recorded >= logits.shape[0]:
            return
        if recorded > 0:
            start, logits = start + recorded, logits[recorded:]
        # positions a prefix-cache hit restored have no logits: their logprobs are None
        req.prompt_logprobs.extend([None] * (start + 1 - len(req.prompt_logprobs)))
        targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + logits.shape[0]], dtype=torch.int64)
        req.prompt_logprobs.extend(top_logprobs(logits, targets, req.params.prompt_logprobs))

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.params
        is_eos = token in self.model_config.eos_token_ids
        if req.detok is not None and not is_eos:
            req.text += req.detok.step(token)
        if is_eos and not params.ignore_eos:
            return req.finish("stop", token)
        if params.stop_token_ids and token in params.stop_token_ids:
            return req.finish("stop", token)
        resolved = len(req.output_token_ids) - req.pending
        for stop in params.stop_strings if resolved >= params.min_tokens else ():  # none before min_tokens
            # only the tail can hold a new match: the last token added at most len(token text) chars
            at = req.text.find(stop, max(0, len(req.text) - len(stop) - 64))
            if at >= 0:
                req.text = req.text[:at + len(stop)] if params.include_stop_str_in_output else req.text[:at]
                return req.finish("stop", stop)
        if resolved >= params.max_tokens or req.num_prompt_tokens + resolved >= self.max_model_len:
            return req.finish("length")
