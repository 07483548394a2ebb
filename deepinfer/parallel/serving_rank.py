"""One data-parallel rank of a server (`deepinfer serve --data-parallel-size N`): a worker process
whose engine steps continuously over the requests the HTTP front sends it.

The front (entrypoints/dp_client.py) talks to each rank over its own pipe. Front -> rank:
("add", add_id, prompts, request_ids, arrival), ("abort", request_ids), ("stop", None).
Rank -> front: ("ready", info) once the engine is built; ("added", add_id, None or (message,
prompt index)) answering each add (all of its prompts queued, or none); ("out", deltas, load,
snapshot) after a step that changed something: each request's Delta since the last one, the
rank's load (DataParallelClient.loads()) and its metrics snapshot; ("fatal", traceback) when the
rank fails, after which it exits.

Without expert parallelism the ranks share no collective: each steps only when it has work and
otherwise sleeps until the front writes. With it, every rank must run every step (MoE dispatch
and combine are collectives), so the ranks agree once per iteration whether any has work
(RankWorker.step_once); a rank without requests runs an empty step, and while no rank has work
they poll for commands every IDLE_POLL_S seconds between those agreements.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass

from deepinfer.core.request import Request, Status
from deepinfer.entrypoints.metrics import engine_load, engine_snapshot
from deepinfer.entrypoints.streams import next_delta
from deepinfer.parallel import group
from deepinfer.parallel.executor import _driver_lost, join_group
from deepinfer.parallel.worker import RankWorker, WorkerArgs

IDLE_POLL_S = 0.01  # lockstep ranks with no work anywhere: how long each waits for commands between agreements


@dataclass(slots=True)
class _Cursor:
    """How far a request's output has been sent to the front (the fields next_delta advances)."""

    req: Request
    holdback: int
    sent_tokens: int = 0
    sent_text: int = 0
    first_token_time: float | None = None


class _DriverGone(Exception):
    """The front's end of the pipe closed without a stop."""


class RankLoop:
    def __init__(self, conn, worker: RankWorker, dp_rank: int):
        self.conn, self.worker, self.engine, self.dp_rank = conn, worker, worker.engine, dp_rank
        self.lockstep = worker.ep is not None
        self.live: dict[str, _Cursor] = {}
        self.prompt_tokens_total = 0
        self.stopped = False
        self._last_report = None
        self.engine.stream_tokens(self._publish_progress)  # multi-step calls' tokens as they come

    def info(self) -> dict:
        """What the front needs to know once: limits, the prefix-cache page size, the first load."""
        cache = self.engine.cache
        return {"max_model_len": self.engine.max_model_len, "page_tokens": cache.page_tokens,
                "num_pages": cache.num_pages, "prefix_cache": cache.prefix is not None,
                "multimodal_placeholders": dict(self.engine.multimodal_placeholders),
                "load": self.load(), "snapshot": engine_snapshot(self.engine, 0)}

    def run(self) -> None:
        ran = False
        while not self.stopped:
            self._apply_commands(self._wait_s(ran))
            if self.stopped:
                break
            ran = self.worker.step_once()
            self._publish()
        for rid in list(self.live):  # stopped: the front is not listening any more
            self.engine.abort_request(rid)
        self.engine.pop_finished()
        self.engine.close()  # the KV event publisher, if any

    def _wait_s(self, ran: bool) -> float | None:
        """How long to wait for a command before the next step: not at all while there is work,
        until one comes when idle (None); lockstep ranks must come back to agree on the next step."""
        if self.engine.has_unfinished() or ran:
            return 0.0
        return IDLE_POLL_S if self.lockstep else None

    # ------------------------------------------------------------ commands
    def _apply_commands(self, wait_s: float | None) -> None:
        if not self.conn.poll(wait_s):
            return
        while self.conn.poll():
            try:
                kind, *payload = self.conn.recv()
            except (EOFError, OSError):
                raise _DriverGone() from None
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                for rid in payload[0]:
                    self.engine.abort_request(rid)
            elif kind == "stop":
                self.stopped = True
                return

    def _add(self, add_id: int, prompts: list, request_ids: list[str], arrival: float) -> None:
        """All of an HTTP request's prompts, or none (a refused one named by its index)."""
        engine = self.engine
        for i, (ids, params, _) in enumerate(prompts):
            try:
                engine.validate_request(ids, params)
            except ValueError as exc:
                self.conn.send(("added", add_id, (str(exc), i)))
                return
        added = []
        for i, ((ids, params, text), rid) in enumerate(zip(prompts, request_ids)):
            try:
                req = engine.add_request(ids, params, text, request_id=rid)
            except ValueError as exc:  # e.g. a request id already in use: take the group back out
                for earlier in added:
                    engine.abort_request(earlier)
                    del self.live[earlier]
                engine.pop_finished()
                self.conn.send(("added", add_id, (str(exc), i)))
                return
            req.metrics.arrival_time = arrival
            stops = params.stop_strings
            self.live[rid] = _Cursor(req, max(map(len, stops)) - 1 if stops else 0)
            added.append(rid)
            self.prompt_tokens_total += len(ids)
        self.conn.send(("added", add_id, None))

    # ------------------------------------------------------------ outputs
    def num_waiting(self) -> int:
        return sum(c.req.status is Status.WAITING for c in self.live.values())

    def load(self, stats: dict | None = None) -> dict:
        """This rank's load as SGLang's /v1/loads reports it per DP rank (metrics.engine_load)."""
        return engine_load(self.engine, self.dp_rank, self.num_waiting(), self.prompt_tokens_total, stats)

    def _publish(self) -> None:
        self.engine.pop_finished()
        deltas = self._deltas(finishing=True)
        stats = self.engine.stats()  # one read of the counters for both
        report = (self.load(stats), engine_snapshot(self.engine, self.num_waiting(), stats))
        if deltas or report != self._last_report:
            self.conn.send(("out", deltas, *report))
            self._last_report = report

    def _publish_progress(self) -> None:
        """Deltas of the streams a multi-step call advanced, while it runs on (as AsyncLLM's); the
        load is the last step's."""
        deltas = self._deltas(finishing=False)
        if deltas and self._last_report is not None:
            self.conn.send(("out", deltas, *self._last_report))

    def _deltas(self, finishing: bool) -> list:
        """(request id, delta) of each live request that changed; `finishing`: finished requests too."""
        now = time.perf_counter()
        deltas = []
        for rid, cursor in list(self.live.items()):
            if not finishing and cursor.req.is_finished:
                continue
            delta = next_delta(cursor, cursor.req, now)
            if delta is None:
                continue
            if delta.finished:
                del self.live[rid]
            deltas.append((rid, delta))
        return deltas


def serve_rank(conn, dp_rank: int, world_size: int, init_method: str, args: WorkerArgs) -> None:
    """The rank process's main function (spawned by DataParallelClient)."""
    store_dir = os.path.dirname(init_method.removeprefix("file://"))
    try:
        loop = RankLoop(conn, join_group(dp_rank, world_size, init_method, args), dp_rank)
        if args.engine.kv_events is not None:  # each rank its own publisher, on the ports + dp_rank (as vLLM)
            loop.engine.start_kv_events(args.engine.kv_events.for_rank(dp_rank))
        conn.send(("ready", loop.info()))
        loop.run()
    except _DriverGone:
        _driver_lost(store_dir)
        return
    except BaseException:  # noqa: BLE001 - the front fails this rank's requests with it
        try:
            conn.send(("fatal", traceback.format_exc()))
        except OSError:
            pass
        return
    group.destroy_group()
