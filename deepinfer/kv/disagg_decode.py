"""The decode role: take a request whose prompt a prefill worker runs, reserve its slot and pages
here (pages this side's prefix cache already holds are kept and not asked for), tell prefill where
to write, wait for the state and the first token, then decode as if the prompt had run here.

A fetch thread per request talks to prefill's bootstrap server (kv/bootstrap.py); its outcome goes
back to the engine thread (`engine.disagg.kv_arrived`, core/disaggregated.py), which alone touches
the cache. The wait is bounded by the transfer timeout; a prefill that dies or refuses fails the
request with the reason and frees its slot and pages. A cancelled request is freed only after
prefill has confirmed that no write into its pages is in flight (or cannot be reached)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from deepinfer.kv import transfer_layout as layout
from deepinfer.kv.bootstrap import BootstrapError, call

logger = logging.getLogger("deepinfer.kv")


class DecodeRole:
    mode = "decode"

    def __init__(self, config, engine, model_dir: str, transport, post):
        self.config, self.engine, self.transport, self.post = config, engine, transport, post
        self.cache = engine.cache
        drafter = engine.spec.drafter if engine.spec is not None else None  # its rings come too
        self.layout = layout.describe(self.cache, model_dir, config.transfer_backend, drafter)
        for address, length in layout.regions(self.cache, drafter):
            transport.register(address, length)
        self.addresses = layout.addresses(self.cache, drafter)
        self.pool = ThreadPoolExecutor(max_workers=max(4, engine.engine_config.max_num_seqs),
                                       thread_name_prefix="deepinfer-kv-fetch")
        self.lock = threading.Lock()
        self.routes: dict[tuple[str, int], dict] = {}  # prefill bootstrap servers already checked
        self.counters = {"transfers": 0, "failed": 0, "bytes": 0, "seconds": 0.0, "pages": 0, "skipped_pages": 0,
                         "segments": 0}
        self.receiving = 0

    # ------------------------------------------------------------ engine thread
    def receive(self, req, pages: list[int], skip: int) -> None:
        """Ask prefill for `req`'s state into its slot and `pages` (the first `skip` already hold it)."""
        with self.lock:
            self.receiving += 1
        self.pool.submit(self._fetch, req.request_id, req.disagg, req.slot, pages[skip:], skip, req.num_prompt_tokens)

    def cancel(self, req) -> None:
        self.pool.submit(self._cancel, req.request_id, req.disagg)

    # ------------------------------------------------------------ fetch threads
    def _route(self, host: str, port: int) -> dict:
        key = (host, port)
        route = self.routes.get(key)
        if route is None:
            route = call("GET", f"http://{host}:{port}/route", timeout=self.config.transfer_timeout)
            refusal = layout.mismatch(self.layout, route.get("layout", {}), f"the prefill worker at {host}:{port}")
            if refusal:
                raise BootstrapError(refusal)
            self.routes[key] = route
        return route

    def _fetch(self, rid: str, source, slot: int, pages: list[int], skip: int, prompt_tokens: int) -> None:
        base = f"http://{source.host}:{source.port}"
        deadline = time.monotonic() + self.config.transfer_timeout
        try:
            self._route(source.host, source.port)
            call("POST", f"{base}/rooms/{source.room}",
                 {"session_id": self.transport.session_id, "layout": self.layout, "addresses": self.addresses,
                  "slot": slot, "pages": pages, "skip_pages": skip, "prompt_tokens": prompt_tokens},
                 timeout=self.config.transfer_timeout)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BootstrapError(f"no decode state from the prefill worker at {source.host}:{source.port} "
                                         f"within --disaggregation-transfer-timeout={self.config.transfer_timeout:g} s")
                answer = call("GET", f"{base}/rooms/{source.room}?wait={min(left, 5.0):.3f}", timeout=left + 5)
                if answer.get("status") == "done":
                    break
                if answer.get("status") == "failed":
                    raise BootstrapError(answer.get("error", "the prefill worker failed the transfer"))
        except BootstrapError as exc:
            error = f"prefill/decode transfer of bootstrap_room {source.room} failed: {exc}"
            logger.warning("request %s: %s", rid, error)
            with self.lock:
                self.counters["failed"] += 1
                self.receiving -= 1
            self.post(lambda: self.engine.disagg.kv_arrived(rid, None, error))
            return
        with self.lock:
            c = self.counters
            c["transfers"] += 1
            c["bytes"] += answer["bytes"]
            c["pages"] += answer["pages"]
            c["skipped_pages"] += answer["skipped_pages"]
            c["segments"] += answer["segments"]
            c["seconds"] += answer["seconds"]
            self.receiving -= 1
        self.post(lambda: self.engine.disagg.kv_arrived(rid, answer, None))

    def _cancel(self, rid: str, source) -> None:
        try:
            call("DELETE", f"http://{source.host}:{source.port}/rooms/{source.room}",
                 timeout=self.config.transfer_timeout + 5)
        except BootstrapError as exc:  # prefill unreachable: no write can come from it either
            logger.info("request %s: cancel at prefill: %s", rid, exc)
        self.post(lambda: self.engine.disagg.kv_arrived(rid, None, "cancelled"))

    # ------------------------------------------------------------ reports
    def stats(self) -> dict:
        with self.lock:
            return {"mode": "decode", "receiving": self.receiving, **self.counters}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
