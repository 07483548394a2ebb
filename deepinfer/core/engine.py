"""The step loop: schedule -> model forward -> sample -> post-process."""

from __future__ import annotations

import collections
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

import torch

from deepinfer import envs
from deepinfer.backends.base import Accelerator
from deepinfer.core import memory
from deepinfer.core.config import EngineConfig
from deepinfer.core.disaggregated import DisaggregatedRequests, check_disaggregated
from deepinfer.core.kv_events import KVEventsConfig
from deepinfer.core.loader import load_checkpoint
from deepinfer.core.model_runner import ModelRunner
from deepinfer.core.postprocess import PostProcessor
from deepinfer.core.prefix_replay import OFF, BoundedReplay
from deepinfer.core.request import Request, validate_request
from deepinfer.core.sampler import Sampler
from deepinfer.core.scheduler import ScheduledChunk, Scheduler
from deepinfer.core.speculative.decoder import SpecDecoder
from deepinfer.core.step_plan import Done, StepPlan, StepStats
from deepinfer.core.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.kv.tiered import open_kv_store
from deepinfer.models.base import ParallelContext
from deepinfer.models.registry import load_config

logger = logging.getLogger("deepinfer")

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
        # the model, its cache (sized by core/memory.py's plan) and its step graphs
        self.runner = ModelRunner(self.model, accel, config, self.max_model_len, dtype, sum(weight_kinds.values()),
                                  parallel, margin=self.spec.margin if self.spec is not None else 0,
                                  max_draft=self.spec.max_draft if self.spec is not None else 0)
        self.cache = self.runner.cache
        self.memory = memory.MemoryReport(accel.name, weight_kinds, memory.checkpoint_bytes(model_dir),
                                          self.runner.cache_bytes(), self.runner.cache_plan, accel.memory_info()[0])
        logger.info("%s", self.memory)
        if self.spec is not None:
            self.spec.start(self.runner, config.max_num_batched_tokens)
        replay = BoundedReplay.from_env(self.model.replay_window, self.cache)
        # the tiers below the cache pool (kv/tiered.py): host memory, a page store
        self.kv_store = open_kv_store(self.cache, config, model_dir, tokenizer, dtype, restores=replay.mode != OFF)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens, replay,
                                   self.kv_store)
        self.sampler = Sampler(accel, cfg.vocab_size, cfg.eos_token_ids)
        self.post = PostProcessor(cfg.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.last_step = StepStats()
        self.structured = None  # structured outputs (core/structured.py), built on the first so_args request
        self.zero_overhead = envs.zero_overhead_scheduling(default=accel.overlap_scheduling)
        self.multi_step = max(1, envs.get("DEEPINFER_MULTI_STEP_DECODE"))
        # streams (stream_tokens): called after every `stream_interval` steps of a multi-step call
        self.on_tokens: Callable[[], None] | None = None
        self.stream_interval = config.stream_interval
        # one worker runs the model so the CPU can plan the next step meanwhile
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-step") \
            if self.zero_overhead else None
        self.in_flight: StepPlan | None = None
        self.num_forwards = 0  # model calls (parallel ranks keep their collectives in lockstep by it)
        self.num_encoded_items = 0  # multimodal items (images) run through the model's encoder
        self.timeline: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds per phase
        self.kv_events = None  # core/kv_event_publisher.py's KVEventPublisher while KV events are published
        # prefill/decode disaggregation (core/disaggregated.py), None when this worker runs prompts and decodes
        self.disagg: DisaggregatedRequests | None = None
        if config.kv_events is not None:
            self.start_kv_events(config.kv_events)

    def stream_tokens(self, listener: Callable[[], None] | None) -> None:
        """Have multi-step calls hand their tokens out every `stream_interval` steps (EngineConfig)
        while the next ones run: post-processed into the requests (text included), then
        `listener()` (a server publishes its streams' deltas), so a stream's tokens come as they are
        decoded rather than once per call. Requests that stopped within the call are retired when
        it ends. None: once per call."""
        self.on_tokens = listener

    def start_kv_events(self, config: KVEventsConfig) -> None:
        """Publish the prefix cache's KV events as `config` says, one batch per step (core/kv_events.py)."""
        from deepinfer.core.kv_event_publisher import KVEventPublisher

        if self.kv_events is not None:
            raise RuntimeError("KV events are already published by this engine")
        self.kv_events = KVEventPublisher.of_cache(config, self.cache)

    def attach_disaggregation(self, role) -> None:
        """Serve as a prefill or decode worker (kv/disagg.py make_role builds `role` for this engine)."""
        if self.disagg is not None:
            raise RuntimeError("this engine already has a disaggregation role")
        self.disagg = DisaggregatedRequests(role, self.cache, self.scheduler, self.post, self._retire,
                                            self._publish_kv_events)

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            events = self.cache.prefix.take_events()
            if self.kv_store is not None:  # pages entering host memory and the page store
                events += self.kv_store.take_events()
            self.kv_events.publish(events)

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

    def cached_multimodal(self, prompt_token_ids: list[int], items) -> list[bool]:
        """Per item: whether this prompt, admitted now, would compute none of the item's span (the
        prefix cache holds it, past what a hit replays), so its encoder need not run. A read-only
        probe, safe from any thread; should the pages go before the request is admitted, the engine
        encodes the item itself."""
        start = self.scheduler.replay.probe(list(prompt_token_ids), [(i.offset, i.end, i.digest) for i in items])
        return [item.end <= start for item in items]

    @property
    def multimodal_placeholders(self) -> dict[str, int]:
        """Placeholder text -> token id of the model's multimodal inputs (empty: text only)."""
        return self.model.multimodal_placeholders

    def validate_request(self, prompt_token_ids: list[int], params, what: str = "prompt", mm_items=()) -> None:
        """Raise a clear ValueError for a request the engine could never serve."""
        validate_request(prompt_token_ids, params, vocab_size=self.model_config.vocab_size,
                         max_model_len=self.max_model_len, cache=self.cache,
                         placeholders=self.multimodal_placeholders, has_tokenizer=self.tokenizer is not None,
                         what=what, mm_items=mm_items)
        if params.so_args is not None:  # structured outputs: starts the compile, rejects what fails fast
            self._structured().check(params.so_args)

    def _structured(self):
        if self.structured is None:
            from deepinfer.core.structured import StructuredOutputs
            self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                                self.model_config.eos_token_ids, self.accel)
        return self.structured

    def add_request(self, prompt_token_ids: list[int], params, prompt: str | None = None,
                    request_id: str | None = None, mm_items=None, disagg=None) -> Request:
        """mm_items: from process_multimodal (prompt_token_ids is then the expanded prompt). `disagg`
        (kv/disagg.py Bootstrap): on a prefill worker, the room whose decode worker takes the request
        after its first token; on a decode worker, the prefill worker that runs its prompt."""
        self.validate_request(prompt_token_ids, params, mm_items=mm_items or ())
        if disagg is not None:
            check_disaggregated(self.disagg, params, mm_items)
        req = Request(prompt_token_ids, params, prompt, request_id, mm_items)
        req.disagg = disagg
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens)
        if params.bad_words:
            req.bad_words_ids = self.tokenizer.bad_words_ids(params.bad_words)
        self.requests[req.request_id] = req
        if disagg is not None and self.disagg.add(req):  # decode: its prompt runs on the prefill worker
            return req
        if params.so_args is not None:  # structured outputs: reaches the scheduler once its grammar is ready
            self._structured().submit(req)
        else:
            self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        if req.disagg is not None and self.disagg.abort(req):
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
        if self.kv_store is not None:  # writes what is queued first
            self.kv_store.close()
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.close()
            self.kv_events = None
        if self.disagg is not None:
            self.disagg.close()

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
        if self.kv_store is not None:
            out.update({f"kv_store_{k}": v for k, v in self.kv_store.snapshot().items()})
        if self.spec is not None:
            out.update({f"spec_{k}": v for k, v in self.spec.stats.items()})
        return out

    # ------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one step (_step); returns the requests that finished in it. The step's KV events
        go out as one batch."""
        finished = self._step()
        if self.disagg is not None:  # decode: pages freed by this step may admit requests whose prompt ran elsewhere
            self.disagg.admit_arriving()
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
        if not chunks and self.in_flight is None and self.kv_store is not None and self.kv_store.fetching():
            self.kv_store.wait(0.01)  # only requests waiting for pages from the KV store: nothing to run
        steps = self._multi_step_length(chunks) if chunks and not overlap else 1
        if steps > 1:
            finished, steps = self._multi_step(chunks, steps)
            self.last_step = StepStats(0, steps * len(chunks), time.perf_counter() - t0)
            return grammar_failed + finished
        with self._timed("prepare"):
            plan = self._plan(chunks, draft=not overlap) if chunks else None
        finished = list(grammar_failed)
        if plan is not None and not overlap:
            plan.future = Done(self._execute(plan, None))
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

    def _multi_step(self, chunks: list[ScheduledChunk], steps: int) -> tuple[list[Request], int]:
        """Run `steps` greedy decode steps of the scheduled requests in one call, post-processing
        their tokens in order as they come (every step for a stream listener, else once), as `steps`
        plain steps would have. A request that stops within the call keeps the tokens up to its
        stop; the state computed past it is released with it when the call ends, early when every
        request has stopped. -> (the requests that finished, the steps that ran)."""
        reqs = [c.request for c in chunks]
        with self._timed("prepare"):
            for req in reqs:
                self.cache.grow(req.slot, req.num_computed + steps)
            starts = [req.num_computed for req in reqs]
            ids = [req.token(start) for req, start in zip(reqs, starts)]
        listener = self.on_tokens
        decoded = self.runner.decode_steps(ids, [req.slot for req in reqs], starts, steps,
                                           self.stream_interval if listener is not None else None)
        self.num_forwards += 1
        done = 0
        while True:
            with self._timed("forward"):
                tokens = next(decoded, None)
            if tokens is None:
                break
            with self._timed("postprocess"):
                for req, start, new_tokens in zip(reqs, starts, tokens.t().tolist()):
                    if not req.is_finished:
                        self.post.multi_step(req, start + done, new_tokens)
            done += tokens.shape[0]
            if all(req.is_finished for req in reqs):
                decoded.close()
                break
            if listener is not None and done < steps:
                listener()
        finished = [req for req in reqs if req.is_finished]
        for req in finished:
            self._retire(req)
        return finished, done

    def _retire(self, req: Request) -> None:
        """A request that just finished: flush its text, free its slot and pages."""
        if req.detok is not None and not isinstance(req.stop_reason, str):
            req.text += req.detok.flush()
        if self.spec is not None:
            self.spec.forget(req.request_id)
        self.sampler.release(req)
        if req.disagg is not None and self.disagg is not None and self.disagg.hold(req):
            return  # prefill: its slot and pages stay until decode has them
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
        plan.inp, plan.meta = self.runner.prepare(ids, slots, starts, lens, floors, restored, plan.logit_rows)
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
            # with drafting on, every step also feeds the drafter's context features
            tap = None if self.spec is None else self.spec.tap(plan.inp, rows.device)
            logits = self.runner.forward(plan.inp, plan.meta, rows, tap)
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
        """Post-process a step on the CPU (core/postprocess.py), then retire the requests it finished."""
        with self._timed("postprocess"):
            logits, tokens = plan.future.result()
            if self.kv_store is not None:  # the prompt pages this step completed go to the page store
                self.kv_store.on_step(plan)
            finished = self.post.step(plan, logits, tokens, self.structured)
            for req in finished:
                self._retire(req)
            return finished
