"""Publishing KV events (core/kv_events.py) over ZMQ, as vLLM's ZmqEventPublisher does.

Every message on the PUB socket has three frames: the topic, the batch's sequence number (8 bytes,
big-endian, from 0 and up by one per batch) and the msgpack batch [ts, events, data_parallel_rank].
The last `buffer_steps` batches are kept; a client of the ROUTER socket (replay_endpoint) that
sends a start sequence number (8 bytes big-endian; as a REQ socket sends it, or a DEALER after an
empty frame) gets, per kept batch from that number on, [sequence number, batch], then
[-1 (8 bytes, signed), b""] to end it. A subscriber that joined late or saw a gap in the numbers
asks for what it missed.

The engine thread only queues (publish never blocks a step; a full queue drops the batch with a
warning); one thread per publisher encodes, sends and answers replay requests, and owns the
sockets from then on. close() lets it send what is queued (ending with AllBlocksCleared: the
cache goes with the engine), then the thread closes the sockets and the ZMQ context and exits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from deepinfer.core.kv_events import AllBlocksCleared, KVEventsConfig, medium_of

logger = logging.getLogger("deepinfer")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket again
    LINGER_MS = 500  # how long closing sockets may take to hand the last batches to connected subscribers
    CLOSE_S = 5.0  # how long close() waits for the thread

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.topic = config.topic.encode()
        self.queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped = 0  # batches the full queue refused
        self.stopping = threading.Event()
        self.ctx = zmq.Context()
        self.pub = self.replay = None
        try:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.SNDHWM, config.hwm)
            self.pub.setsockopt(zmq.LINGER, self.LINGER_MS)
            (self.pub.bind if config.binds() else self.pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open the KV event sockets (endpoint {config.endpoint!r}, "
                             f"replay_endpoint {config.replay_endpoint!r}): {exc}; pick free ports (with "
                             "data parallelism rank r uses the ports + r)") from None
        self.thread = threading.Thread(target=self._run, name=f"deepinfer-kv-events-dp{config.data_parallel_rank}",
                                       daemon=True)
        self.thread.start()
        self.publish([AllBlocksCleared()])  # whatever a subscriber knew of an earlier run on these sockets is gone
        logger.info("KV events: publishing on %s%s (data-parallel rank %d)", config.endpoint,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "",
                    config.data_parallel_rank)

    @classmethod
    def of_cache(cls, config: KVEventsConfig, cache) -> "KVEventPublisher":
        """A publisher of `cache`'s prefix-cache events as `config` says; the cache records them from now on."""
        if cache.prefix is None:
            raise ValueError("kv_events_config: this model keeps no paged decode state, so it has no prefix cache "
                             "whose pages could be reported; leave kv_events_config out")
        publisher = cls(config)
        cache.prefix.record_events(medium_of(cache.device))
        return publisher

    def publish(self, events: list) -> None:
        """Queue one step's events as a batch (called by the engine thread; returns at once)."""
        if not events or self.stopping.is_set():
            return
        try:
            self.queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: %d batch(es) dropped, the publisher queue (max_queue_size=%d) is full; "
                               "routers' view of this cache is now incomplete", self.dropped,
                               self.config.max_queue_size)

    def close(self) -> None:
        """Send what is queued and AllBlocksCleared, then stop the thread (it closes the sockets)."""
        if self.stopping.is_set():
            return
        self.publish([AllBlocksCleared()])
        self.stopping.set()
        self.thread.join(self.CLOSE_S)
        if self.thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %.0f s", self.CLOSE_S)

    # ------------------------------------------------------------ the publisher thread
    def _run(self) -> None:
        seq = 0
        try:
            while True:
                while self.replay is not None and self.replay.poll(0):
                    self._answer_replay()
                try:
                    ts, events = self.queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    if self.stopping.is_set():
                        return
                    continue
                payload = msgpack.packb([ts, [e.wire() for e in events], self.config.data_parallel_rank])
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                self.kept.append((seq, payload))
                seq += 1
        except Exception:  # noqa: BLE001 - the engine keeps serving; routers lose this replica's events
            logger.exception("KV events: the publisher thread failed; no more events are published")
            self.stopping.set()
        finally:
            self._close_sockets()

    def _answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("KV events: ignored a replay request of %d frame(s); send the start sequence number as "
                           "8 bytes big-endian (after an empty delimiter frame from a DEALER)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self.kept:
            if seq >= start:
                self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self.replay.send_multipart([client, b"", END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close()
        self.ctx.term()
