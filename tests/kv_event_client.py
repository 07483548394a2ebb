"""A router's side of KV events, in plain pyzmq and msgpack: a SUB socket on a publisher's
endpoint and a DEALER on its replay endpoint, decoding batches as vLLM's wire format has them
([ts, events, data_parallel_rank], events as maps tagged by "type")."""

from __future__ import annotations

import time

import msgpack
import zmq

END_OF_REPLAY = -1


class EventClient:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.live: dict[int, list] = {}  # sequence number -> decoded batch, as received live

    def poll(self, until, timeout: float = 30.0) -> None:
        """Receive live batches until `until(self.live)` holds (bounded)."""
        deadline = time.monotonic() + timeout
        while not until(self.live):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for KV events; got {self.live}")
            if self.sub.poll(int(min(left, 0.5) * 1000)):
                topic, seq, payload = self.sub.recv_multipart()
                self.live[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)

    def replay(self, start: int, timeout: float = 10.0) -> dict[int, list]:
        """The batches from `start` on that the publisher kept, asked for on its replay socket."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = {}
            while True:
                if not dealer.poll(int(timeout * 1000)):
                    raise AssertionError(f"no end-of-replay marker within {timeout}s; got {sorted(out)}")
                empty, seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == END_OF_REPLAY:
                    return out
                out[seq] = msgpack.unpackb(payload)
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


def events(batches: dict[int, list], kind: str | None = None) -> list[dict]:
    """The events of `batches` in sequence order (of one type, when `kind` is given)."""
    return [e for seq in sorted(batches) for e in batches[seq][1] if kind is None or e["type"] == kind]
