"""The prefill role: run a request's prompt and its first token, keep its slot and pages until decode
has them, write them into decode's cache through the transfer engine, then free them.

Rooms (one per request, keyed by the router's bootstrap_room) meet two arrivals in either order:
the engine's finished request (`hold`, on the engine thread) and decode's destination (`offer`, on
a bootstrap-server thread). When both are in, one writer thread moves the bytes; the result (first
token, logprobs, bytes) waits for decode's long poll. Every room ends within the transfer timeout:
a finished request whose decode never asks (decode killed, client gone) is freed, a destination whose
request never comes is dropped. The engine's slot and pages are only freed on the engine thread
(`post`).

Where the destination came first (the usual order: decode asks as soon as the router sends it the
request) and the transfer engine can post a write and poll it (NIXL), the engine thread writes
inline when the request finishes, polling for at most INLINE_WRITE_S before a thread takes over: a
writer thread would wait for the GIL the engine thread holds while it runs Python, up to the
interpreter's 5 ms switch interval, several times a sub-millisecond write."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from deepinfer.kv import transfer_layout as layout
from deepinfer.kv.bootstrap import BootstrapServer
from deepinfer.kv.transfer import TransferError

logger = logging.getLogger("deepinfer.kv")

PENDING, TRANSFERRING, DONE, FAILED = "pending", "transferring", "done", "failed"
INLINE_WRITE_S = 0.002  # how long the engine thread polls a write it posted before a thread finishes it


@dataclass
class _Room:
    created: float
    status: str = PENDING
    held: dict | None = None  # the finished request: rid, slot, pages, prompt tokens, first token, logprobs
    dest: dict | None = None  # decode's destination
    result: dict = field(default_factory=dict)
    released: bool = False


class PrefillRole:
    mode = "prefill"

    def __init__(self, config, engine, model_dir: str, host: str, transport, post):
        self.config, self.engine, self.transport, self.post = config, engine, transport, post
        self.cache = engine.cache
        self.drafter = engine.spec.drafter if engine.spec is not None else None  # its rings move too
        self.layout = layout.describe(self.cache, model_dir, config.transfer_backend, self.drafter)
        for address, length in layout.regions(self.cache, self.drafter):
            transport.register(address, length)
        self.rooms: dict[int, _Room] = {}
        self.cond = threading.Condition()
        # inline_writes: transfers the engine thread posted and saw done itself (INLINE_WRITE_S)
        self.counters = {"transfers": 0, "failed": 0, "bytes": 0, "seconds": 0.0, "write_seconds": 0.0, "pages": 0,
                         "inline_writes": 0}
        self._closed = False
        self.server = BootstrapServer(host, config.bootstrap_port, self)
        self.host = _reachable(host)  # where a decode worker finds the bootstrap server (vLLM's remote_host)
        self.reaper = threading.Thread(target=self._reap, name="deepinfer-kv-reaper", daemon=True)
        self.reaper.start()
        logger.info("prefill: bootstrap server on %s:%d, transfer session %s", host, self.server.port,
                    transport.session_id)

    # ------------------------------------------------------------ engine thread
    @staticmethod
    def prefill_params(params):
        """A request's parameters on the prefill side: its prompt and first token only."""
        return dataclasses.replace(params, max_tokens=1, min_tokens=0)

    def hold(self, req) -> None:
        """`req` finished its first token; the engine keeps its slot and pages for us (core/disaggregated.py)."""
        pages = list(self.cache.slot_pages[req.slot])
        held = {"rid": req.request_id, "slot": req.slot, "pages": pages, "prompt_tokens": req.num_prompt_tokens,
                "first_token": req.output_token_ids[0] if req.output_token_ids else None,
                "logprobs": _jsonable(req.output_logprobs[0]) if req.output_logprobs else None,
                "finish_reason": req.finish_reason}
        with self.cond:
            room = self.rooms.setdefault(req.disagg.room, _Room(time.monotonic()))
            room.held, room.created = held, time.monotonic()
            start = room.dest is not None and room.status == PENDING
            if start:
                room.status = TRANSFERRING
        if start:
            self._start(req.disagg.room, on_engine_thread=True)
        elif room.status != PENDING:  # cancelled before its prompt ran
            self._release(room)

    def dropped(self, req) -> None:
        """`req` was aborted before its first token (its own client went away): decode is told."""
        self._fail(req.disagg.room, f"the prefill request {req.request_id} was aborted before its first token")

    # ------------------------------------------------------------ bootstrap server threads
    def route(self) -> dict:
        return {"session_id": self.transport.session_id, "layout": self.layout, "mode": "prefill"}

    def offer(self, room_id: int, body: dict) -> str | None:
        refusal = layout.mismatch(self.layout, body.get("layout", {}), "the decode worker") \
            if isinstance(body.get("layout"), dict) and "model_digest" in body["layout"] else \
            "the destination has no cache description (layout)"
        if refusal:
            return refusal
        with self.cond:
            room = self.rooms.setdefault(room_id, _Room(time.monotonic()))
            if room.dest is not None:
                return f"bootstrap_room {room_id} already has a destination: a room names one request"
            room.dest = body
            start = room.held is not None and room.status == PENDING
            if start:
                room.status = TRANSFERRING
            self.cond.notify_all()
        if start:
            self._start(room_id)
        elif self.transport.posts_writes:  # meet the peer now, not when the engine thread writes
            try:
                self.transport.connect(body.get("session_id", ""))
            except TransferError as exc:  # the write reports it, with the room
                logger.warning("bootstrap_room %d: %s", room_id, exc)
        return None

    def wait(self, room_id: int, timeout: float) -> dict:
        with self.cond:
            self.cond.wait_for(lambda: self._terminal(room_id), timeout)
            room = self.rooms.get(room_id)
            if room is None:
                return {"status": FAILED, "error": f"bootstrap_room {room_id} is unknown to this prefill worker "
                                                   "(it expired, or the prefill restarted)"}
            if room.status in (DONE, FAILED):
                del self.rooms[room_id]  # decode read its result
            return {"status": room.status, **room.result}

    def cancel(self, room_id: int) -> dict:
        """Decode's request was cancelled: no write starts after this returns, and one in flight has ended."""
        with self.cond:
            room = self.rooms.setdefault(room_id, _Room(time.monotonic()))
            self.cond.wait_for(lambda: room.status != TRANSFERRING, self.config.transfer_timeout)
            if room.status == PENDING:
                room.status, room.result = FAILED, {"error": "cancelled by the decode worker"}
            self.cond.notify_all()
            status = room.status
        self._release(room)
        return {"status": status}

    # ------------------------------------------------------------ transfers
    def _terminal(self, room_id: int) -> bool:
        room = self.rooms.get(room_id)
        return room is None or room.status in (DONE, FAILED)

    def _start(self, room_id: int, on_engine_thread: bool = False) -> None:
        if on_engine_thread and self._inline(self.rooms[room_id].dest):
            self._transfer(room_id, inline=True)
        else:
            threading.Thread(target=self._transfer, args=(room_id,), name=f"deepinfer-kv-write-{room_id}",
                             daemon=True).start()

    def _inline(self, dest) -> bool:
        """Whether the engine thread may post this write itself: the transport posts and polls, and it
        holds the peer's metadata already (fetching it may take a while)."""
        try:
            return self.transport.posts_writes and self.transport.connected(dest["session_id"])
        except (TransferError, KeyError, TypeError):
            return False  # a thread reports it

    def _transfer(self, room_id: int, inline: bool = False) -> None:
        room = self.rooms[room_id]
        held, dest = room.held, room.dest
        t0 = time.perf_counter()
        try:
            skip = int(dest["skip_pages"])
            pages = held["pages"][skip:self.cache.pages_for(held["prompt_tokens"])]
            if len(pages) != len(dest["pages"]):
                raise ValueError(f"decode offers {len(dest['pages'])} pages for a prompt of {held['prompt_tokens']} "
                                 f"tokens of which it holds {skip} pages; this side has {len(pages)} to send")
            segs = layout.segments(self.cache, held["slot"], pages, dest["addresses"], int(dest["slot"]), dest["pages"],
                                   self.drafter)
            t_write = time.perf_counter()
            if inline:
                write = self.transport.start_write(dest["session_id"], segs.src, segs.dst, segs.lengths)
                if not write.wait(INLINE_WRITE_S):
                    threading.Thread(target=self._finish, args=(room_id, write, segs, len(pages), skip, t0, t_write),
                                     name=f"deepinfer-kv-write-{room_id}", daemon=True).start()
                    return
            else:
                self.transport.write(dest["session_id"], segs.src, segs.dst, segs.lengths)
        except (TransferError, ValueError, KeyError, TypeError) as exc:
            self._failed_write(room_id, exc)
            return
        self._done(room_id, segs, len(pages), skip, t0, t_write, inline)

    def _finish(self, room_id: int, write, segs, pages: int, skip: int, t0: float, t_write: float) -> None:
        """A write the engine thread posted, waited for on this thread."""
        try:
            write.wait(float("inf"))
        except TransferError as exc:
            self._failed_write(room_id, exc)
            return
        self._done(room_id, segs, pages, skip, t0, t_write)

    def _failed_write(self, room_id: int, exc: Exception) -> None:
        logger.warning("bootstrap_room %d: transfer failed: %s", room_id, exc)
        self._fail(room_id, f"the prefill worker could not write the decode state: {exc}")

    def _done(self, room_id: int, segs, pages: int, skip: int, t0: float, t_write: float, inline: bool = False) -> None:
        room, held = self.rooms[room_id], self.rooms[room_id].held
        now = time.perf_counter()
        seconds, write_seconds = now - t0, now - t_write
        result = {"first_token": held["first_token"], "logprobs": held["logprobs"], "bytes": segs.nbytes,
                  "pages": pages, "skipped_pages": skip, "segments": len(segs.src), "seconds": seconds,
                  "write_seconds": write_seconds}
        logger.info("bootstrap_room %d: wrote %d bytes (%d pages, %d skipped, one slot's rings) in %d segments, "
                    "%.2f ms (the engine's write call %.2f ms)", room_id, segs.nbytes, pages, skip, len(segs.src),
                    seconds * 1e3, write_seconds * 1e3)
        with self.cond:
            room.status, room.result = DONE, result
            c = self.counters
            c["transfers"] += 1
            c["bytes"] += segs.nbytes
            c["pages"] += pages
            c["seconds"] += seconds
            c["write_seconds"] += write_seconds
            c["inline_writes"] += inline
            self.cond.notify_all()
        self._release(room)

    def _fail(self, room_id: int, error: str) -> None:
        with self.cond:
            room = self.rooms.setdefault(room_id, _Room(time.monotonic()))
            if room.status in (DONE, FAILED):
                return
            room.status, room.result = FAILED, {"error": error}
            self.counters["failed"] += 1
            self.cond.notify_all()
        self._release(room)

    def _release(self, room: _Room) -> None:
        """Free the room's held slot and pages on the engine thread (once)."""
        with self.cond:
            if room.held is None or room.released:
                return
            room.released = True
            rid = room.held["rid"]
        self.post(lambda: self.engine.disagg.release_held(rid))

    def _reap(self) -> None:
        """Rooms past the transfer timeout fail (and free what they hold); answered ones are dropped."""
        while not self._closed:
            time.sleep(0.25)
            now, late = time.monotonic(), []
            with self.cond:
                for room_id, room in list(self.rooms.items()):
                    if now - room.created <= self.config.transfer_timeout:
                        continue
                    if room.status in (DONE, FAILED):
                        del self.rooms[room_id]  # nobody came for the result
                    elif room.status == PENDING:
                        late.append((room_id, room))
            for room_id, room in late:
                what = "the decode worker never asked for it (gone?)" if room.held is not None else \
                    "its prefill request never came"
                self._fail(room_id, f"bootstrap_room {room_id} timed out after {self.config.transfer_timeout:g} s: "
                                    f"{what}")

    # ------------------------------------------------------------ reports
    def stats(self) -> dict:
        with self.cond:
            held = sum(r.held is not None and not r.released for r in self.rooms.values())
            return {"mode": "prefill", "bootstrap_port": self.server.port, "held_requests": held,
                    "rooms": len(self.rooms), **self.counters}

    def close(self) -> None:
        self._closed = True
        self.server.close()
        self.transport.close()


def _reachable(host: str) -> str:
    """An address of this host a peer can connect to: `host`, or for a wildcard bind the address the
    host name resolves to."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _jsonable(logprobs: dict | None) -> dict | None:
    return None if logprobs is None else {str(k): v for k, v in logprobs.items()}
