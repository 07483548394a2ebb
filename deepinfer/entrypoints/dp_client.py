"""DataParallelClient: the engine behind `deepinfer serve --data-parallel-size N`, with AsyncLLM's
interface, so the HTTP front does not know how many ranks serve it.

N rank processes (parallel/serving_rank.py), each with its own engine, scheduler and cache,
stepping continuously over its own requests; with --expert-parallel-size N too they also shard
the experts and step together. All prompts of one HTTP request go to one rank: the one named by
`data_parallel_rank`, else the one with the least expected work (entrypoints/dp_balancer.py).
One thread here (the pump) reads every rank's pipe: answers to adds, deltas (handed to the event
loop in one batch per message, as AsyncLLM does) and load reports (`loads()`, the /metrics
snapshot, summed).

A rank that dies or raises fails its requests with an error naming it and why, and the instance
stops serving (`alive` is False, /health says unhealthy): a router should restart it. The other
ranks' requests finish (without expert parallelism; with it the ranks step together, so every
rank's requests fail). close() stops every rank process and removes the group's rendezvous dir.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Pipe, wait

import torch

from deepinfer.core.disaggregated import NOT_DISAGGREGATED
from deepinfer.entrypoints.async_llm import EngineDead, InvalidRequest, NotDisaggregated, QueueFull, _deliver, \
    call_soon, check_data_parallel_rank, check_request_ids_free
from deepinfer.entrypoints.dp_balancer import LeastWorkBalancer
from deepinfer.entrypoints.metrics import combine_snapshots
from deepinfer.entrypoints.streams import RequestGroup
from deepinfer.parallel.executor import _stop, how_it_ended

logger = logging.getLogger("deepinfer.server")


@dataclass(frozen=True, slots=True)
class RankEngineInfo:
    """What the HTTP handlers read from `client.engine` (AsyncLLM hands them its LLMEngine)."""

    max_model_len: int
    multimodal_placeholders: dict

    def process_multimodal(self, prompt_token_ids, data, what: str = "prompt"):
        raise ValueError(f"{what}: images are not served with data_parallel_size > 1 yet; serve the "
                         "multimodal model with one rank")


@dataclass(slots=True)
class _Live:
    """The front's record of one engine request on a rank (also what ServerMetrics.on_progress reads)."""

    group: RequestGroup
    index: int
    rank: int
    arrival: float
    prompt_tokens: int
    owed_tokens: int  # prompt tokens the rank must compute (the rest it probably has cached)
    accepted: bool = False
    sent_tokens: int = 0
    first_token_time: float | None = None


def _engine_configs(**engine_args):
    """LLM's keyword arguments (all optional, as `deepinfer serve` passes them) as the configs a rank
    builds its engine from: (EngineConfig, ParallelConfig, accelerator name)."""
    from deepinfer.backends import get_accelerator
    from deepinfer.core.engine import EngineConfig
    from deepinfer.core.kv_events import KVEventsConfig
    from deepinfer.llm import LLM
    from deepinfer.parallel import ParallelConfig

    bound = inspect.signature(LLM.__init__).bind_partial(None, **engine_args)
    bound.apply_defaults()
    a = bound.arguments
    engine = EngineConfig(max_num_seqs=a["max_num_seqs"], max_num_batched_tokens=a["max_num_batched_tokens"],
                          max_model_len=a["max_model_len"], cache_bytes=a["cache_bytes"],
                          gpu_memory_utilization=a["gpu_memory_utilization"],
                          num_cache_pages=a["num_cache_pages"], dtype=a["dtype"], seed=a["seed"],
                          kv_events=KVEventsConfig.parse(a["kv_events_config"]), kv_store=a["kv_store"],
                          kv_host_cache_bytes=a["kv_host_cache_bytes"])
    parallel = ParallelConfig(a["expert_parallel_size"], a["data_parallel_size"], a["context_parallel_size"],
                              a["num_redundant_experts"], a["eplb_window_size"], a["eplb_step_interval"])
    return engine, parallel, get_accelerator(a["accelerator"]).name


class DataParallelClient:
    disaggregation_mode = "null"  # prefill/decode roles run one engine per worker (api_server refuses both)
    encoders = None  # encoder workers (--encoder-urls) serve one engine per worker too

    def disaggregation_stats(self) -> dict:
        return {"mode": "null"}

    def __init__(self, model: str, tokenizer=None, *, max_waiting_requests: int = 1024, metrics=None,
                 start_timeout_s: float = 600.0, **engine_args):
        from deepinfer.core.tokenizer import Tokenizer
        from deepinfer.models.registry import load_config
        from deepinfer.parallel.config import LayoutError
        from deepinfer.parallel.worker import WorkerArgs

        engine_config, parallel, accelerator = _engine_configs(**engine_args)
        engine_config.validate()
        cfg, _ = load_config(model)
        parallel.validate(getattr(cfg, "n_routed_experts", None))
        if parallel.context_parallel_size > 1:
            raise LayoutError("context_parallel_size > 1 is not served with data_parallel_size > 1")
        self.dp_size = parallel.data_parallel_size
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.tokenizer = Tokenizer(tokenizer or model, bos_token_id=cfg.bos_token_id) \
            if tokenizer is not None or os.path.isfile(os.path.join(model, "tokenizer.json")) else None
        self.lockstep = parallel.expert_parallel_size > 1  # MoE collectives in every step: ranks step together
        self.error: EngineDead | None = None
        self._lock = threading.RLock()  # _live, _pending, _failed, error: the event loop and the pump share them
        self._live: dict[str, _Live] = {}
        self._pending: dict[int, tuple[asyncio.Future, list[str]]] = {}
        self._add_ids = itertools.count()
        self._failed: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_deadline: float | None = None
        self._drained = False
        self._closing = False
        self._closed = False

        ctx = torch.multiprocessing.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="deepinfer-group-")
        init_method = f"file://{os.path.join(self._store_dir, 'store')}"
        args = WorkerArgs(model, os.fspath(tokenizer) if tokenizer is not None else None, engine_config,
                          parallel, accelerator)
        from deepinfer.parallel.serving_rank import serve_rank

        self.conns, self.procs = [], []
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs, self._store_dir)
        try:
            for rank in range(parallel.world_size):
                parent, child = ctx.Pipe()
                self.conns.append(parent)
                proc = ctx.Process(target=serve_rank, args=(child, rank, parallel.world_size, init_method, args),
                                   name=f"deepinfer-dp-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
        except BaseException:
            self._abandon_start()
            raise
        self._send_locks = [threading.Lock() for _ in self.procs]
        infos = self._wait_ready(start_timeout_s)
        for rank, proc in enumerate(self.procs):
            logger.info("data-parallel rank %d of %d: pid %d", rank, parallel.world_size, proc.pid)
        self.engine = RankEngineInfo(infos[0]["max_model_len"], infos[0]["multimodal_placeholders"])
        self._loads = [info["load"] for info in infos]
        self._snapshots = [info["snapshot"] for info in infos]
        if self.metrics is not None:  # the gauges exist (zeros) before the first request
            self.metrics.set_snapshot(combine_snapshots(self._snapshots))
        self.balancer = LeastWorkBalancer([info["num_pages"] for info in infos], infos[0]["page_tokens"],
                                          infos[0]["prefix_cache"])
        self._pump_thread = threading.Thread(target=self._pump, name="deepinfer-dp-pump", daemon=True)
        self._pump_thread.start()

    def _wait_ready(self, timeout_s: float) -> list[dict]:
        infos: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(infos) < len(self.procs):
            pending = [r for r in range(len(self.procs)) if r not in infos]
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                         max(0.0, deadline - time.monotonic()))
            if not ready:
                self._abandon_start(f"ranks {pending} did not start within {timeout_s:.0f} s")
            for r in pending:
                if self.conns[r].poll():
                    try:
                        kind, value = self.conns[r].recv()
                    except (EOFError, OSError):
                        kind, value = "fatal", None
                    if kind == "ready":
                        infos[r] = value
                        continue
                    self._abandon_start(f"data-parallel rank {r} failed while starting:\n"
                                        f"{value or 'it ' + self._exit_reason(r)}")
                elif self.procs[r].sentinel in ready:
                    self._abandon_start(f"data-parallel rank {r} (pid {self.procs[r].pid}) failed while starting: "
                                        f"it {self._exit_reason(r)}")
        return [infos[r] for r in range(len(self.procs))]

    def _abandon_start(self, message: str | None = None):
        """Stop what started (processes, pipes, the rendezvous dir); raise `message` if given."""
        self._finalizer()
        self._wake_r.close()
        self._wake_w.close()
        if message is not None:
            raise RuntimeError(message)

    def _exit_reason(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(1.0)  # the sentinel closes a moment before the exit status is ready
        return how_it_ended(proc.exitcode) if proc.exitcode is not None else "closed its pipe"

    # ------------------------------------------------------------ event-loop side
    @property
    def alive(self) -> bool:
        return self.error is None and self._drain_deadline is None and not self._closing \
            and self._pump_thread.is_alive()

    @property
    def num_live(self) -> int:
        """Accepted requests that have not finished on any rank (what a drain waits for)."""
        with self._lock:
            return len(self._live)

    def loads(self) -> list[dict]:
        """One dict per data-parallel rank, as its last report had it (metrics.engine_load)."""
        return [dict(load) for load in self._loads[:self.dp_size]]

    def num_waiting(self) -> int:
        """Accepted requests that have not produced a token yet (queued, prefilling, compiling a
        grammar) on every rank."""
        with self._lock:
            return sum(live.sent_tokens == 0 for live in self._live.values())

    async def add(self, prompts: list[tuple], arrival: float, request_ids: list[str],
                  data_parallel_rank: int | None = None, disagg=None) -> RequestGroup:
        """AsyncLLM.add, on one rank: `data_parallel_rank`, or the least loaded one. Raises
        InvalidRequest (naming the prompt, or InvalidDataParallelRank), QueueFull or EngineDead."""
        if disagg is not None:  # no prefill/decode role with several ranks (api_server refuses the pair)
            raise NotDisaggregated(NOT_DISAGGREGATED, 0)
        pinned = check_data_parallel_rank(data_parallel_rank, self.dp_size)
        prompts = [p if len(p) == 4 else (*p, None) for p in prompts]
        for i, (*_, mm_items) in enumerate(prompts):
            if mm_items:
                raise InvalidRequest("images are not served with data_parallel_size > 1 yet; serve the "
                                     "multimodal model with one rank", i)
        self._loop = asyncio.get_running_loop()
        group = RequestGroup(request_ids)
        answer = self._loop.create_future()
        keys = [self.balancer.page_keys(ids) for ids, *_ in prompts]
        with self._lock:
            if not self.alive:
                raise EngineDead(self._dead_reason())
            waiting = self.num_waiting()
            if waiting + len(prompts) > self.max_waiting_requests:
                raise QueueFull(f"{waiting} requests are waiting for the engine (limit "
                                f"--max-waiting-requests={self.max_waiting_requests}); retry later")
            check_request_ids_free(request_ids, self._live)
            rank = pinned if pinned is not None else self._choose(keys[0])
            for i, ((ids, *_), rid, k) in enumerate(zip(prompts, request_ids, keys)):
                owed = len(ids) - min(self.balancer.hit_tokens(rank, k), len(ids) - 1)
                self._live[rid] = _Live(group, i, rank, arrival, len(ids), owed)
                self.balancer.remember(rank, k)
            add_id = next(self._add_ids)
            self._pending[add_id] = (answer, list(request_ids))
        self._send(rank, ("add", add_id, [(ids, p, text) for ids, p, text, _ in prompts], list(request_ids), arrival))
        try:
            await answer
        except asyncio.CancelledError:
            self.abort(request_ids)
            raise
        return group

    def _choose(self, keys) -> int:
        owed, held = [0] * self.dp_size, [0] * self.dp_size
        for live in self._live.values():
            if live.sent_tokens:
                held[live.rank] += live.prompt_tokens + live.sent_tokens
            else:
                owed[live.rank] += live.owed_tokens
        return self.balancer.choose(keys, owed, held, range(self.dp_size))

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (a client went away); their streams end with finish_reason "abort"."""
        by_rank: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                live = self._live.get(rid)
                if live is not None:
                    by_rank.setdefault(live.rank, []).append(rid)
        for rank, rids in by_rank.items():
            self._send(rank, ("abort", rids))

    def start_draining(self, grace_seconds: float) -> None:
        """Accept nothing new; what runs may finish within `grace_seconds`, then is aborted."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + grace_seconds
            self._wake()

    def close(self, timeout: float = 30.0) -> None:
        """Stop every rank process and the pump; what still runs fails (idempotent)."""
        if self._closed:
            return
        self._closed = self._closing = True
        self._wake()
        self._pump_thread.join(timeout)
        self._finalizer()  # stop, then terminate / kill, each rank; close the pipes; remove the rendezvous dir
        self._wake_r.close()
        self._wake_w.close()
        self._fail(list(self._live), EngineDead("the server is shutting down"))

    def _dead_reason(self) -> str:
        return str(self.error) if self.error is not None else "the server is shutting down"

    def _send(self, rank: int, message) -> None:
        """Write to a rank; a rank that is gone is reported by the pump, which fails its requests."""
        with self._send_locks[rank]:
            try:
                self.conns[rank].send(message)
            except (OSError, ValueError):
                pass

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"")
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------ pump thread
    def _pump(self) -> None:
        try:
            while not self._closing:
                ranks = [r for r in range(len(self.procs)) if r not in self._failed]
                timeout = None
                if self._drain_deadline is not None and not self._drained:
                    timeout = max(0.0, self._drain_deadline - time.monotonic())
                ready = wait([self._wake_r] + [self.conns[r] for r in ranks] +
                             [self.procs[r].sentinel for r in ranks], timeout)
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
                if self._closing:
                    return
                for r in ranks:
                    self._read(r, ready)
                if self._drain_deadline is not None and not self._drained \
                        and time.monotonic() >= self._drain_deadline:
                    self._drained = True
                    self.abort(list(self._live))
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave clients waiting forever
            logger.exception("the data-parallel pump failed")
            self.error = EngineDead(f"the data-parallel front failed: {exc!r}")
            self._fail(list(self._live), self.error)

    def _read(self, rank: int, ready) -> None:
        conn = self.conns[rank]
        while rank not in self._failed and conn.poll():
            try:
                kind, *payload = conn.recv()
            except (EOFError, OSError):
                self._rank_failed(rank, self._exit_reason(rank))
                return
            if kind == "out":
                self._on_out(rank, *payload)
            elif kind == "added":
                self._on_added(*payload)
            elif kind == "fatal":
                logger.error("data-parallel rank %d failed:\n%s", rank, payload[0])
                last = payload[0].strip().splitlines()[-1]
                self._rank_failed(rank, f"raised {last}")
        if rank not in self._failed and self.procs[rank].sentinel in ready and not conn.poll():
            self._rank_failed(rank, self._exit_reason(rank))

    def _on_added(self, add_id: int, refused) -> None:
        with self._lock:
            answer, rids = self._pending.pop(add_id)
            if refused is not None:
                for rid in rids:
                    self._live.pop(rid, None)
            else:
                for rid in rids:
                    if rid in self._live:
                        self._live[rid].accepted = True
                        if self.metrics is not None:
                            self.metrics.on_added(self._live[rid].prompt_tokens)
        if refused is None:
            self._call_soon(answer.set_result, None)
        else:
            self._call_soon(answer.set_exception, InvalidRequest(*refused))

    def _on_out(self, rank: int, deltas, load: dict, snapshot: dict) -> None:
        now = time.perf_counter()
        batch = []
        with self._lock:
            for rid, delta in deltas:
                live = self._live.get(rid)
                if live is None:
                    continue
                live.sent_tokens += len(delta.token_ids)
                if live.first_token_time is None and delta.token_ids:
                    live.first_token_time = now
                if delta.finished:
                    del self._live[rid]
                batch.append((live.group, live.index, delta))
                if self.metrics is not None:
                    self.metrics.on_progress(live, delta, now)
            self._loads[rank] = load
            self._snapshots[rank] = snapshot
        if self.metrics is not None:
            self.metrics.set_snapshot(combine_snapshots(self._snapshots))
        if batch:
            self._call_soon(_deliver, batch)

    def _rank_failed(self, rank: int, why: str) -> None:
        """Fail the rank's requests (every rank's, when they step together) and stop serving."""
        failed = range(len(self.procs)) if self.lockstep else [rank]
        message = (f"data-parallel rank {rank} (pid {self.procs[rank].pid}) {why}; its requests failed and "
                   "this instance no longer accepts requests (restart it)")
        if self.lockstep:
            message += "; the other ranks were stopped too (expert-parallel ranks step together)"
        logger.error("%s", message)
        with self._lock:
            self._failed.update(failed)
            if self.error is None:
                self.error = EngineDead(message)
            error = EngineDead(message)
            doomed = [rid for rid, live in self._live.items() if live.rank in failed]
        for r in failed:
            if r != rank and self.procs[r].is_alive():
                self.procs[r].kill()
        self._fail(doomed, error)

    def _fail(self, request_ids, error: BaseException) -> None:
        """End these requests' streams (and unanswered adds) with `error`."""
        with self._lock:
            doomed = {rid: self._live.pop(rid) for rid in request_ids if rid in self._live}
            adds = [add_id for add_id, (_, rids) in self._pending.items() if any(rid in doomed for rid in rids)]
            answers = [self._pending.pop(add_id)[0] for add_id in adds]
        for answer in answers:
            self._call_soon(answer.set_exception, error)
        groups = {id(live.group): live.group for live in doomed.values() if live.accepted}
        for group in groups.values():
            self._call_soon(group.queue.put_nowait, error)

    def _call_soon(self, fn, *args) -> None:
        call_soon(self._loop, fn, *args)
