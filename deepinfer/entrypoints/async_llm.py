"""AsyncLLM: the engine behind the server. One thread owns the LLMEngine and keeps stepping it
while requests arrive and leave (continuous batching across clients); asyncio code talks to it
through a command queue and gets each request's output as a stream of deltas.

Only the engine thread touches the engine, so adds, aborts and steps never race: an HTTP
handler sends a command and awaits its answer. After each step the thread publishes, per live
request, what it produced since the last delta, then hands the whole batch to the event loop
with one wake-up. Text is the engine's incrementally detokenized text (which never ends in half
a UTF-8 character); with stop strings, the last len(longest stop) - 1 characters wait until
they cannot turn into a stop (the engine cuts a stop string out of the text).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from deepinfer.core.disaggregated import NOT_DISAGGREGATED, check_disaggregated
from deepinfer.core.request import Request, Status
from deepinfer.entrypoints.metrics import engine_load
from deepinfer.entrypoints.streams import RequestGroup, next_delta

logger = logging.getLogger("deepinfer.server")


class QueueFull(RuntimeError):
    """Too many requests wait for the engine (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine thread failed or is shutting down; nothing more will be served."""


class InvalidRequest(ValueError):
    """A prompt the engine refuses; `index` says which prompt of the group. `param`, when set, is
    the request field at fault (else the handler names the prompt's field)."""

    param: str | None = None

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class InvalidDataParallelRank(InvalidRequest):
    """A `data_parallel_rank` this instance does not have (HTTP 400 on that field)."""

    param = "data_parallel_rank"


class NotDisaggregated(InvalidRequest):
    """PD bootstrap fields sent to a worker without a prefill/decode role (HTTP 400 on bootstrap_room)."""

    param = "bootstrap_room"


class RequestIdInUse(InvalidRequest):
    """A request id (from the client's X-Request-Id) that a running request already has."""

    param = "X-Request-Id"


def check_data_parallel_rank(value, dp_size: int) -> int | None:
    """`value` as a rank of an instance of `dp_size` ranks (None: the instance chooses)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < dp_size:
        raise InvalidDataParallelRank(
            f"data_parallel_rank={value!r} is not a rank of this instance: it serves data_parallel_size="
            f"{dp_size} rank(s), 0 to {dp_size - 1}; leave it out to let the instance choose", 0)
    return value


def check_request_ids_free(request_ids, live) -> None:
    """Refuse ids a running request has (`live`: the running ids), naming the header they came from."""
    for rid in request_ids:
        if rid in live:
            raise RequestIdInUse(f"request id {rid!r} is in use by a running request; send a unique X-Request-Id "
                                 "(or none, and the server makes one)", 0)


@dataclass(slots=True)
class _Live:
    req: Request
    group: RequestGroup
    index: int
    arrival: float
    holdback: int  # characters withheld while a stop string could still match
    sent_tokens: int = 0
    sent_text: int = 0
    first_token_time: float | None = None


class AsyncLLM:
    dp_size = 1  # one engine: data_parallel_rank 0 or none

    def __init__(self, llm, max_waiting_requests: int = 1024, metrics=None, disaggregation=None,
                 host: str = "127.0.0.1", model_dir: str = ""):
        """`disaggregation` (kv/disagg.py DisaggregationConfig): serve `model_dir`'s model as a prefill
        or decode worker, its bootstrap server and transfer engine on `host`."""
        if llm.engine is None:
            raise ValueError("the server runs one engine in this process; parallel layouts "
                             "(expert/data/context_parallel_size > 1) are not served yet")
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._caught_up = True  # the event loop has sent the last mid-call deltas (_publish_progress)
        self._prompt_tokens_total = 0
        self._load = engine_load(self.engine, 0, 0, 0)
        if metrics is not None:  # the gauges exist (zeros) before the first request: routers scrape them at once
            metrics.update_engine(self.engine, 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_deadline: float | None = None
        self._stopped = False
        if disaggregation is not None and disaggregation.enabled:
            from deepinfer.kv.disagg import make_role

            self.engine.attach_disaggregation(make_role(disaggregation, self.engine, model_dir, host,
                                                        self.call_soon_on_engine))
        self.encoders = None  # kv/encode_client.py EncoderClient: the requests' images go to encoder workers
        if disaggregation is not None and disaggregation.encoder_urls:
            from deepinfer.kv.encode_client import EncoderClient

            d = disaggregation
            self.encoders = EncoderClient(list(d.encoder_urls), self.engine, model_dir, d.transfer_backend, host,
                                          d.transfer_protocol, d.ib_device, d.transfer_timeout,
                                          d.encoder_buffer_mb << 20)
        self.engine.stream_tokens(self._publish_progress)  # multi-step calls' tokens as they come
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def disaggregation_mode(self) -> str:
        """"prefill", "decode", or "null" (SGLang's name for a worker that does both)."""
        return self.engine.disagg.mode if self.engine.disagg is not None else "null"

    def disaggregation_stats(self) -> dict:
        out = self.engine.disagg.role.stats() if self.engine.disagg is not None else {"mode": "null"}
        if self.encoders is not None:
            # the images encoded here (a prefill with encoder workers runs none itself)
            out = {**out, "encoders": {**self.encoders.stats(), "encoded_locally": self.engine.num_encoded_items}}
        return out

    def kv_transfer_params(self, room: int) -> dict:
        """A prefill worker's vLLM-style kv_transfer_params for the request it keeps in `room`."""
        from deepinfer.entrypoints.kv_transfer_params import answer

        role = self.engine.disagg.role
        return answer(role.host, role.server.port, role.transport.session_id, room)

    def call_soon_on_engine(self, fn) -> None:
        """Run fn() on the engine thread, between steps (the disaggregation roles' threads change the
        engine only this way)."""
        self._commands.put(("call", fn))

    # ------------------------------------------------------------ event-loop side
    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive() and self._drain_deadline is None

    @property
    def num_live(self) -> int:
        """Accepted requests that have not finished (what a drain waits for)."""
        return len(self._live)

    def loads(self) -> list[dict]:
        """The engine's load as of its last step, as one data-parallel rank (metrics.engine_load)."""
        return [dict(self._load)]

    async def add(self, prompts: list[tuple], arrival: float, request_ids: list[str],
                  data_parallel_rank: int | None = None, disagg=None) -> RequestGroup:
        """Queue every prompt of an HTTP request, or none: raises InvalidRequest (naming the
        prompt, or a subclass naming its field), QueueFull or EngineDead. If the caller is cancelled
        meanwhile, the requests are aborted again. A prompt is (token ids, SamplingParams, text or
        None) and, for a multimodal one, its MultimodalItems (the engine's process_multimodal).
        `data_parallel_rank` may only be 0 (or None): this is one engine. `disagg` (kv/disagg.py
        Bootstrap, one prompt only): the request's prefill/decode room."""
        check_data_parallel_rank(data_parallel_rank, self.dp_size)
        if not self.alive:
            raise EngineDead(self._dead_reason())
        self._loop = asyncio.get_running_loop()
        group = RequestGroup(request_ids)
        answer = self._loop.create_future()
        self._commands.put(("add", prompts, group, arrival, answer, disagg))
        try:
            await answer
        except asyncio.CancelledError:
            self.abort(request_ids)
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (a client went away): their pages and grammar state are freed before
        the engine's next step."""
        self._commands.put(("abort", request_ids))

    def start_draining(self, grace_seconds: float) -> None:
        """Shutdown, step one: accept nothing new; what runs may finish within `grace_seconds`,
        then is aborted (its stream ends with finish_reason "abort")."""
        self._commands.put(("drain", time.monotonic() + grace_seconds))
        self._drain_deadline = self._drain_deadline or time.monotonic() + grace_seconds

    def close(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the engine thread and the engine's worker (idempotent)."""
        self._commands.put(("stop",))
        self._thread.join(timeout)
        if self.encoders is not None:
            self.encoders.close()
            self.encoders = None
        if not self._thread.is_alive() and self.llm is not None:
            self.llm.close()
            self.llm = None

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {self.error!r}"
        return "the server is shutting down"

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands(block=not self.engine.has_unfinished())
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    self._abort(list(self._live))
                if not self._stopped and self.engine.has_unfinished():
                    self.engine.step()
                self._publish()
            self._abort(list(self._live))  # stopped: what still runs ends with finish_reason "abort"
            self._publish()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting client, then logged
            logger.exception("engine loop failed")
            self.error = exc
        finally:
            self._stopped = True
            self._fail_all(EngineDead(self._dead_reason()))

    def _apply_commands(self, block: bool) -> None:
        timeout = None  # idle: sleep until a command comes, or until a drain's deadline
        if self._drain_deadline is not None and self._live:
            timeout = max(0.0, self._drain_deadline - time.monotonic())
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "drain":
                self._drain_deadline = command[1]
            elif kind == "stop":
                self._stopped = True
            elif kind == "call":
                command[1]()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, prompts, group: RequestGroup, arrival: float, answer: asyncio.Future, disagg=None) -> None:
        try:
            if self._drain_deadline is not None or self._stopped:
                raise EngineDead("the server is shutting down")
            waiting = self.num_waiting()
            if waiting + len(prompts) > self.max_waiting_requests:
                raise QueueFull(f"{waiting} requests are waiting for the engine (limit "
                                f"--max-waiting-requests={self.max_waiting_requests}); retry later")
            check_request_ids_free(group.request_ids, self._live)
            prompts = [p if len(p) == 4 else (*p, None) for p in prompts]  # (ids, params, text[, mm_items])
            if disagg is not None and self.engine.disagg is None:
                raise NotDisaggregated(NOT_DISAGGREGATED, 0)
            if disagg is not None and self.disaggregation_mode == "prefill":  # the prompt and first token only
                prefill = self.engine.disagg.role.prefill_params
                prompts = [(ids, prefill(params), text, mm) for ids, params, text, mm in prompts]
            for i, (ids, params, _, mm_items) in enumerate(prompts):  # all or nothing
                try:
                    self.engine.validate_request(ids, params, mm_items=mm_items or ())
                    if disagg is not None:
                        check_disaggregated(self.engine.disagg, params, mm_items)
                except ValueError as exc:
                    raise InvalidRequest(str(exc), i) from None
            for i, ((ids, params, text, mm_items), rid) in enumerate(zip(prompts, group.request_ids)):
                req = self.engine.add_request(ids, params, text, request_id=rid, mm_items=mm_items, disagg=disagg)
                req.metrics.arrival_time = arrival  # latency counts from the HTTP request, not the queue
                stops = params.stop_strings
                self._live[rid] = _Live(req, group, i, arrival, max(map(len, stops)) - 1 if stops else 0)
                self._prompt_tokens_total += len(ids)
                if self.metrics is not None:
                    self.metrics.on_added(len(ids))
        except BaseException as exc:  # noqa: BLE001 - the handler raises it
            self._call_soon(answer.set_exception, exc)
            return
        self._call_soon(answer.set_result, None)

    def num_waiting(self) -> int:
        """Accepted requests that do not run: queued, compiling a grammar, or preempted."""
        return sum(live.req.status is Status.WAITING for live in self._live.values())

    def _abort(self, request_ids) -> None:
        for rid in request_ids:
            if rid in self._live:
                self.engine.abort_request(rid)

    def _publish(self) -> None:
        """Deltas of every live request that changed, handed to the event loop in one batch."""
        self.engine.pop_finished()
        batch = self._deltas(finishing=True)
        waiting, stats = self.num_waiting(), self.engine.stats()  # one read of the counters for both
        self._load = engine_load(self.engine, 0, waiting, self._prompt_tokens_total, stats)
        if self.metrics is not None:
            self.metrics.update_engine(self.engine, waiting, stats)
        if batch:
            self._call_soon(_deliver, batch)

    def _publish_progress(self) -> None:
        """Deltas of the streams a multi-step call advanced, while it runs on (requests that stopped
        in it get theirs, text flushed, from _publish when it ends). Nothing while the event loop
        has not sent the last ones yet: the tokens ride with the next deltas, so a loop that falls
        behind gets fewer, larger pieces instead of a wake-up per step."""
        if not self._caught_up or self._loop is None:
            return
        batch = self._deltas(finishing=False)
        if batch:
            self._caught_up = False
            self._call_soon(self._deliver_progress, batch)

    def _deliver_progress(self, batch) -> None:  # on the event loop
        _deliver(batch)
        # runs after the handlers that _deliver woke have written their pieces
        self._loop.call_soon(setattr, self, "_caught_up", True)

    def _deltas(self, finishing: bool) -> list:
        """(group, index, delta) of each live request that changed; `finishing`: finished requests
        too (their last delta; they leave the live set)."""
        now = time.perf_counter()
        batch = []
        for rid, live in list(self._live.items()):
            if not finishing and live.req.is_finished:
                continue
            delta = next_delta(live, live.req, now)
            if delta is None:
                continue
            if delta.finished:
                del self._live[rid]
            batch.append((live.group, live.index, delta))
            if self.metrics is not None:
                self.metrics.on_progress(live, delta, now)
        return batch

    def _fail_all(self, exc: BaseException) -> None:
        groups = {id(live.group): live.group for live in self._live.values()}
        self._live.clear()
        for group in groups.values():
            self._call_soon(group.queue.put_nowait, exc)
        while True:  # adds nobody will serve
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._call_soon(command[4].set_exception, exc)

    def _call_soon(self, fn, *args) -> None:
        call_soon(self._loop, fn, *args)


def call_soon(loop, fn, *args) -> None:
    """Run fn(*args) on the server's event loop from an engine thread (both engine clients use it)."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(_safely, fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _safely(fn, *args) -> None:
    try:
        fn(*args)
    except asyncio.InvalidStateError:  # the awaiting handler was cancelled already
        pass


def _deliver(batch) -> None:
    for group, index, delta in batch:
        group.queue.put_nowait((index, delta))
