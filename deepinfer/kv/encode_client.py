"""A prefill worker's side of E/P/D (kv/encode_protocol.py): `deepinfer serve --encoder-urls URL ...`
sends each request's multimodal items to encoder workers and takes their embeddings, written by the
encoders through the transfer engine into an arena this worker registered, before the request
reaches the engine (which then runs no encoder for it).

- Which encoder: rendezvous hashing of the item's digest over the URLs (smg's default encode policy
  is consistent hashing too): an image goes to the same encoder each time while the set is the same,
  and the next in its order when that one is down. A request's items for one encoder go in one call,
  calls to different encoders run at once.
- Failover: an encoder that cannot be reached, or drops the connection before answering (killed),
  is skipped for the next in the item's order; a refusal (another model, another transfer engine,
  unreadable items) fails the request with the encoder's reason, as does every encoder being down.
- Memory: each call reserves arena room for its items' embeddings, freed when the call ends. After
  a timeout the encoder may still be writing, so that room is never reused (`quarantined_bytes`):
  a late write cannot land in another request's embeddings. A request waits for arena room at most
  the transfer timeout."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer.kv.encode_protocol import EMBED_DTYPE, embed_bytes, frame
from deepinfer.kv.transfer_layout import model_digest

logger = logging.getLogger("deepinfer.kv")


class EncodeError(RuntimeError):
    """No encoder worker could encode a request's items: the message names them and why."""


class _Unreachable(Exception):
    """An encoder could not be reached or dropped the connection: the next one may serve."""


class Arena:
    """First-fit byte ranges of one registered buffer, waited for when full."""

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), sorted, merged
        self.cond = threading.Condition()
        self.quarantined = 0

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def free_bytes(self) -> int:
        with self.cond:
            return sum(n for _, n in self.free)

    def alloc(self, nbytes: int, timeout: float) -> int:
        """The offset of `nbytes` bytes; waits up to `timeout` s for them (EncodeError after)."""
        if nbytes > self.buffer.numel():
            raise EncodeError(f"an item's embeddings take {nbytes} bytes, more than the whole encoder arena "
                              f"({self.buffer.numel()} bytes): raise --encoder-buffer-mb")
        nbytes = max(nbytes, 1)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for i, (off, n) in enumerate(self.free):
                    if n >= nbytes:
                        self.free[i:i + 1] = [(off + nbytes, n - nbytes)] if n > nbytes else []
                        return off
                left = deadline - time.monotonic()
                if left <= 0 or not self.cond.wait(left):
                    raise EncodeError(f"no room for {nbytes} bytes of embeddings in the encoder arena within "
                                      f"{timeout:g} s (too many images in flight: raise --encoder-buffer-mb)")

    def release(self, offset: int, nbytes: int) -> None:
        nbytes = max(nbytes, 1)
        with self.cond:
            spans = sorted(self.free + [(offset, nbytes)])
            merged = [spans[0]]
            for off, n in spans[1:]:
                last_off, last_n = merged[-1]
                if last_off + last_n == off:
                    merged[-1] = (last_off, last_n + n)
                else:
                    merged.append((off, n))
            self.free = merged
            self.cond.notify_all()

    def quarantine(self, nbytes: int) -> None:
        """Room a late write may still land in: never handed out again."""
        with self.cond:
            self.quarantined += max(nbytes, 1)


class EncoderClient:
    """The encoder workers at `urls`, for the engine's model (`engine.model` packs the items)."""

    def __init__(self, urls: list[str], engine, model_dir: str, backend: str, host: str, protocol: str = "tcp",
                 device: str = "", timeout: float = 30.0, buffer_bytes: int | None = None):
        from deepinfer.kv.transfer import make_transport

        if not urls:
            raise ValueError("--encoder-urls needs at least one encoder worker URL")
        if not engine.multimodal_placeholders:
            raise ValueError("--encoder-urls: this model takes text only (it has no multimodal encoder); "
                             "encoder workers serve models with images")
        self.urls = [u.rstrip("/") for u in urls]
        self.model, self.backend, self.timeout = engine.model, backend, timeout
        self.digest = model_digest(model_dir)
        self.hidden = engine.model_config.hidden_size
        # default: two full contexts of embeddings in flight
        size = buffer_bytes or 2 * embed_bytes(engine.max_model_len, self.hidden)
        self.arena = Arena(size)
        self.transport = make_transport(backend, host, protocol, device, timeout, receives=True)
        self.transport.register(self.arena.address, size)
        self.pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.urls)), thread_name_prefix="deepinfer-encode")
        self.lock = threading.Lock()
        self.routes: dict[str, dict] = {}  # encoders whose model and transfer engine were checked
        # cached: items the prefix cache held, not sent
        self.counters = {"items": 0, "cached": 0, "calls": 0, "failovers": 0, "failed": 0, "bytes": 0, "seconds": 0.0,
                         "encode_seconds": 0.0, "write_seconds": 0.0}
        logger.info("encoder workers: %s (transfer session %s, %d-byte arena)", ", ".join(self.urls),
                    self.transport.session_id, size)

    # ------------------------------------------------------------ requests
    def order(self, digest: bytes) -> list[str]:
        """The encoders in an item's preference order (rendezvous hashing)."""
        return sorted(self.urls, key=lambda u: hashlib.blake2b(digest + u.encode(), digest_size=8).digest(),
                      reverse=True)

    def encode(self, items: list, cached: list[bool] | None = None) -> None:
        """Set the `embeds` (float32 [length, hidden]) of every item not `cached` (the prefix cache
        holds its span: the engine will not need it) from the encoders; EncodeError when they
        cannot. Blocking: run it off the event loop."""
        t0 = time.perf_counter()
        groups: dict[str, list] = {}
        skipped = 0
        for item, hit in zip(items, cached or [False] * len(items), strict=True):
            if hit:
                skipped += 1
                continue
            groups.setdefault(self.order(item.digest)[0], []).append(item)
        with self.lock:
            self.counters["cached"] += skipped
        futures = [self.pool.submit(self._encode_group, group) for group in groups.values()]
        errors = []
        for f in futures:
            try:
                f.result()
            except EncodeError as exc:
                errors.append(str(exc))
        if errors:
            with self.lock:
                self.counters["failed"] += 1
            raise EncodeError("; ".join(errors))
        with self.lock:
            self.counters["seconds"] += time.perf_counter() - t0

    def _encode_group(self, items: list) -> None:
        tried = []
        for url in self.order(items[0].digest):
            try:
                return self._call(url, items)
            except _Unreachable as exc:
                tried.append(f"{url}: {exc}")
                logger.warning("encoder %s unreachable (%s); trying the next one", url, exc)
                with self.lock:
                    self.counters["failovers"] += 1
                    self.routes.pop(url, None)
        raise EncodeError("no encoder worker could be reached (" + "; ".join(tried) + ")")

    def _route(self, url: str) -> None:
        if url in self.routes:
            return
        route = self._http("GET", f"{url}/encoder_info", None)
        if route.get("backend") != self.backend:
            raise EncodeError(f"encoder {url} moves embeddings with {route.get('backend')!r}, this worker with "
                              f"{self.backend!r}: give both the same --disaggregation-transfer-backend")
        if route.get("model_digest") != self.digest or route.get("hidden_size") != self.hidden:
            raise EncodeError(f"encoder {url} serves model {route.get('model')!r} (config.json digest "
                              f"{route.get('model_digest')}), this worker another ({self.digest}): start the encoder "
                              "with the prefill's --model")
        with self.lock:
            self.routes[url] = route

    def _call(self, url: str, items: list) -> None:
        self._route(url)
        packed = [self.model.pack_multimodal(item) for item in items]
        sizes = [embed_bytes(item.length, self.hidden) for item in items]
        offsets, deadline = [], time.monotonic() + self.timeout
        try:
            for n in sizes:
                offsets.append(self.arena.alloc(n, max(deadline - time.monotonic(), 0.0)))
            header = {"session_id": self.transport.session_id, "backend": self.backend, "model_digest": self.digest,
                      "items": [{"header": h, "bytes": len(p), "address": self.arena.address + off, "capacity": n}
                                for (h, p), off, n in zip(packed, offsets, sizes)]}
            try:
                answer = self._http("POST", f"{url}/encode", frame(header, [p for _, p in packed]),
                                    timeout=max(deadline - time.monotonic(), 0.1))
            except TimeoutError:
                for n in sizes:  # the encoder may still write there
                    self.arena.quarantine(n)
                offsets = []
                raise EncodeError(f"encoder {url} did not answer within --disaggregation-transfer-timeout="
                                  f"{self.timeout:g} s") from None
            try:
                wrote = [int(got["bytes"]) for got in answer["items"]]
            except (KeyError, TypeError, ValueError):
                raise EncodeError(f"encoder {url} answered without the items' byte counts: {answer!r:.200}") from None
            if wrote != sizes:
                raise EncodeError(f"encoder {url} wrote {wrote} bytes for items of {[i.length for i in items]} "
                                  f"positions ({sizes} expected)")
            for item, off, n in zip(items, offsets, sizes):
                rows = self.arena.buffer[off:off + n].view(EMBED_DTYPE).view(item.length, self.hidden)
                item.embeds = rows.float()  # a copy: the arena room is freed below
        finally:
            for off, n in zip(offsets, sizes):
                self.arena.release(off, n)
        with self.lock:
            c = self.counters
            c["items"] += len(items)
            c["calls"] += 1
            c["bytes"] += sum(wrote)
            c["encode_seconds"] += float(answer.get("encode_seconds", 0.0))
            c["write_seconds"] += float(answer.get("write_seconds", 0.0))

    def _http(self, method: str, url: str, body: bytes | None, timeout: float | None = None) -> dict:
        req = urllib.request.Request(url, data=body, method=method,
                                     headers={"content-type": "application/octet-stream"} if body else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                reason = json.loads(exc.read()).get("error", "")
            except (ValueError, AttributeError):
                reason = ""
            if isinstance(reason, dict):  # the server's error body while it loads
                reason = reason.get("message", "")
            if exc.code == 503:  # loading, draining, or its write to us failed: another encoder may serve
                raise _Unreachable(f"answered 503: {reason}") from None
            raise EncodeError(f"encoder {url} answered {exc.code}: {reason}") from None
        except (socket.timeout, TimeoutError):
            raise TimeoutError from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (socket.timeout, TimeoutError)):
                raise TimeoutError from None
            raise _Unreachable(str(exc.reason)) from None
        except (ConnectionError, http.client.HTTPException) as exc:  # reset, or closed before the answer
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from None

    # ------------------------------------------------------------ reports
    def stats(self) -> dict:
        with self.lock:
            return {"urls": self.urls, **self.counters, "arena_bytes": self.arena.buffer.numel(),
                    "arena_free_bytes": self.arena.free_bytes, "quarantined_bytes": self.arena.quarantined}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
