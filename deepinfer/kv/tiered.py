"""The tiered prefix store's policy: L1 the cache pool (core/prefix_cache.py), L2 host memory
(kv/host_cache.py), L3 a page store (kv/page_store.py).

- Write-back: pages entering the pool's prefix cache (a sequence's full, computed pages, as it ends or
  is preempted) are copied to the host on the engine thread, kept in L2, and queued for a writer
  thread that encodes them (kv/page_record.py) and puts them in L3: no step waits for the store. On
  cpu a prompt's full pages are written the same way as soon as a finished step completes them.
- Prefetch on admission: before the scheduler admits a request, `ready` extends its pool hit with
  pages from L2 (host -> pool copies), and if pages after those may be in L3, starts a fetch on a
  fetch thread and answers False: the request waits in the queue (others are admitted meanwhile)
  until the verified records are in, then they are loaded like L2's. Lookups stop at the first miss.
- A page holds exactly the pool rows of the cache spec's paged pools; the window state after a hit
  is rebuilt by bounded replay (core/prefix_replay.py), as for a pool hit. Where replay restores
  nothing (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=off) lookups are skipped: a hit would be recomputed.
- Faults: a record that fails its checks, a store that errs or is unreachable: a counted miss and
  one warning per kind; serving goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from deepinfer.core import kv_events
from deepinfer.core.cache import StateCache
from deepinfer.kv import page_record
from deepinfer.kv.host_cache import HostCache
from deepinfer.kv.fingerprint import model_fingerprint
from deepinfer.kv.page_store import PageStore, open_page_store

logger = logging.getLogger("deepinfer")

_WRITE_QUEUE = 256  # batches waiting for the writer; beyond it write-backs are dropped (counted)
_WRITTEN_MEMO = 1 << 20  # keys remembered as written, not re-queued
_DOWN_SECONDS = 10.0  # after a failed read, lookups skip the store this long (an unreachable one times out slowly)


@dataclass(slots=True)
class KVStoreStats:
    l2_hit_tokens: int = 0  # positions loaded into the pool from host memory
    l2_hit_bytes: int = 0
    l3_hit_tokens: int = 0  # positions loaded into the pool from the page store
    l3_hit_bytes: int = 0
    l3_lookups: int = 0  # fetches started
    l3_partial_fetches: int = 0  # fetches that found fewer pages than asked (the rest are recomputed)
    fetch_seconds: float = 0.0  # summed over fetches (lookup + read + verify)
    bad_records: int = 0  # records rejected: corrupt, truncated, another model's; recomputed
    read_errors: int = 0  # store reads that failed (unreachable, I/O error)
    write_errors: int = 0
    written_pages: int = 0  # pages put in L3
    written_bytes: int = 0
    dropped_writes: int = 0  # write-backs dropped: the writer was behind
    l2_pages: int = 0
    l2_bytes: int = 0
    l3_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(slots=True)
class _Fetch:
    keys: list[bytes]
    future: Future  # -> list of verified payloads, a prefix of keys


class TieredKVStore:
    def __init__(self, cache: StateCache, fingerprint: bytes, store: PageStore | None, host_bytes: int,
                 restores: bool = True):
        self.cache, self.prefix = cache, cache.prefix
        self.fingerprint, self.store, self.restores = fingerprint, store, restores
        self.pools = [p for p in cache.pools.values() if p.page_rows]
        self.page_bytes = cache.bytes_per_page()
        self.host = HostCache(host_bytes, pin=cache.device.type == "cuda") if host_bytes else None
        self.stats = KVStoreStats()
        self._lock = threading.Lock()  # stats and events written by the writer / fetch threads
        self._events: list = []
        self._warned: set[str] = set()
        self._fetches: dict[str, _Fetch] = {}
        self._written: set[bytes] = set()
        self._host_medium = "CPU"
        self._writes: queue.Queue | None = None
        self._down_until = 0.0  # monotonic time before which the store is taken as unreachable
        self._writer = self._fetcher = None
        if store is not None:
            self._writes = queue.Queue(_WRITE_QUEUE)
            self._writer = threading.Thread(target=self._write_loop, name="deepinfer-kv-writer", daemon=True)
            self._writer.start()
            self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-fetch")
            self.stats.l3_bytes = self._store_size()
        self.prefix.lower_tier = self

    # ------------------------------------------------------------ page bytes <-> pool rows
    def _rows(self, pages: list[int]):
        """Pool row indices of `pages`, per paged pool."""
        for pool in self.pools:
            r = pool.page_rows
            base = torch.tensor(pages, dtype=torch.int64) * r + pool.page_base
            yield pool, (base[:, None] + torch.arange(r)).flatten()

    def _gather(self, pages: list[int]) -> list[torch.Tensor]:
        """The payloads (uint8 host tensors) of pool pages `pages`."""
        parts = [pool.data.index_select(0, rows.to(pool.data.device)).cpu().view(len(pages), -1).view(torch.uint8)
                 for pool, rows in self._rows(pages)]
        flat = torch.cat([p.reshape(len(pages), -1) for p in parts], dim=1)
        return list(flat.unbind(0))

    def _scatter(self, page: int, payload: torch.Tensor) -> None:
        offset = 0
        for pool in self.pools:
            rows = pool.data[pool.page_base + page * pool.page_rows: pool.page_base + (page + 1) * pool.page_rows]
            n = rows.numel() * rows.element_size()
            src = payload[offset:offset + n].view(rows.dtype).view(rows.shape)
            rows.copy_(src, non_blocking=payload.is_pinned())
            offset += n

    def _name(self, key: bytes) -> str:
        return f"{key.hex()}-{self.fingerprint.hex()}"

    # ------------------------------------------------------------ L1 hooks (core/prefix_cache.py)
    def on_stored(self, keys: list[bytes], pages: list[int], new: list[int], seq) -> None:
        """Pages `new` (indices into keys / pages) of `seq` just entered the pool's prefix cache."""
        self._write_back(keys, pages, new, seq)

    def on_step(self, plan) -> None:
        """A step finished (core/engine.py's _finish; its device work is done): write back the prompt
        pages its chunks completed, so a long prompt's prefix reaches the page store as its prefill
        goes, not when the request ends. Prompt pages only: a drafted output token may be rolled
        back, a prompt token never; output pages are written on release. On a GPU the gather would
        wait for the step running meanwhile (zero-overhead scheduling), so there pages are written
        on release only (a side stream and pinned buffers would lift that)."""
        if self._writes is None or self.cache.device.type != "cpu":
            return
        page = self.cache.page_tokens
        for chunk, (start, _, _) in zip(plan.chunks, plan.prompt_rows):
            req = chunk.request
            end = min(start + chunk.num_tokens, req.num_prompt_tokens)
            first = max(start, req.num_restored) // page  # pages restored from a hit are in the tiers
            if req.slot is None or end // page <= first:
                continue
            req.page_keys = self.prefix.keys(req.page_keys, req.tokens(0, end), req.mm_spans())
            self._write_back(req.page_keys, self.cache.slot_pages[req.slot], range(first, end // page), req)

    def _write_back(self, keys: list[bytes], pages: list[int], new, seq) -> None:
        """Copy pages `new` (indices into keys / pages) of `seq` to L2 and queue them for L3."""
        todo = [i for i in new if keys[i] not in self._written and (self.host is None or keys[i] not in self.host)]
        if not todo:
            return
        payloads = self._gather([pages[i] for i in todo])
        if self.host is not None:
            for i, payload in zip(todo, payloads):
                self._drop_host(self.host.put(keys[i], payload))
            self._add_events(kv_events.stored(keys, todo, seq, self.cache.page_tokens, self._host_medium))
        if self._writes is not None:
            events = kv_events.stored(keys, todo, seq, self.cache.page_tokens, self.store.medium) \
                if self.prefix.events is not None else []
            try:
                self._writes.put_nowait(([keys[i] for i in todo], payloads, events))
            except queue.Full:
                with self._lock:
                    self.stats.dropped_writes += len(todo)
                return
            self._written.update(keys[i] for i in todo)
            if len(self._written) > _WRITTEN_MEMO:
                self._written.clear()

    def on_evicted(self, key: bytes) -> None:
        """The pool evicted the page `key`: L2 keeps it longest (it was written through on entry)."""
        if self.host is not None:
            self.host.touch(key)

    def _drop_host(self, dropped: list[bytes]) -> None:
        for key in dropped:
            if self.prefix.events is not None:
                kv_events.removed(self._events, key, self._host_medium)

    def _add_events(self, events: list) -> None:
        if self.prefix.events is not None and events:
            with self._lock:
                self._events += events

    def take_events(self) -> list:
        with self._lock:
            events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ admission (core/scheduler.py)
    def ready(self, req) -> bool:
        """Extend `req`'s pool hit from L2 and from a finished L3 fetch; False while a fetch of its
        next pages is in flight (the request waits, others are admitted)."""
        if not self.restores:
            return True
        fetch = self._fetches.get(req.request_id)
        fetched: dict[bytes, torch.Tensor] = {}
        if fetch is not None:
            if not fetch.future.done():
                return False
            del self._fetches[req.request_id]
            fetched = dict(zip(fetch.keys, fetch.future.result()))
        prefix = self.prefix
        keys = prefix.keys(req.page_keys, req.tokens(0, req.num_tokens - 1), req.mm_spans())
        held = prefix.match(keys)
        n = len(held)
        loaded = n
        while loaded < len(keys):
            payload = fetched.get(keys[loaded])
            tier = "l3"
            if payload is None and self.host is not None:
                payload, tier = self.host.get(keys[loaded]), "l2"
            if payload is None:
                break
            if not self._load(keys, loaded, payload, held, req):
                return True  # the pool is full: admit what it holds
            if tier == "l3" and self.host is not None:
                self._drop_host(self.host.put(keys[loaded], payload))
            self._count_hit(tier, payload.numel())
            loaded += 1
        if loaded < len(keys) and self._fetcher is not None and not req.store_looked_up \
                and time.monotonic() >= self._down_until:
            req.store_looked_up = True  # once per request: a miss is recomputed, not looked up again
            with self._lock:
                self.stats.l3_lookups += 1
            self._fetches[req.request_id] = _Fetch(keys[loaded:], self._fetcher.submit(self._fetch, keys[loaded:]))
            return False
        return True

    def _load(self, keys: list[bytes], i: int, payload: torch.Tensor, held: list[int], req) -> bool:
        """Copy page `keys[i]` into a free pool page and cache it there (idle); False if no page is
        free but the ones `req`'s hit already holds."""
        cache, prefix = self.cache, self.prefix
        if not cache.free_pages and not any(p not in held for p in prefix.idle):
            return False
        prefix.hold(held)  # the hit's pages are not evicted to make room
        try:
            page = cache.free_pages.pop() if cache.free_pages else prefix.evict()
            self._scatter(page, payload)
            prefix.adopt(keys, i, page, req)
        finally:
            for page_ in held:
                prefix.drop(page_)
        held.append(page)
        return True

    def _count_hit(self, tier: str, nbytes: int) -> None:
        with self._lock:
            if tier == "l2":
                self.stats.l2_hit_tokens += self.cache.page_tokens
                self.stats.l2_hit_bytes += nbytes
            else:
                self.stats.l3_hit_tokens += self.cache.page_tokens
                self.stats.l3_hit_bytes += nbytes

    def fetching(self) -> bool:
        return bool(self._fetches)

    def wait(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for any fetch to finish: the engine has nothing else to run."""
        futures = [f.future for f in self._fetches.values()]
        if futures:
            from concurrent.futures import FIRST_COMPLETED, wait
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def forget(self, req) -> None:
        """`req` left the queue (aborted): its fetch's result is not wanted."""
        self._fetches.pop(req.request_id, None)

    # ------------------------------------------------------------ L3 threads
    def _warn_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message + " (further such warnings are not logged; see the kv_store_* metrics)", *args)

    def _fetch(self, keys: list[bytes]) -> list[torch.Tensor]:
        """Fetch thread: the verified payloads of the longest prefix of `keys` the store holds."""
        t0 = time.perf_counter()
        names = [self._name(k) for k in keys]
        out: list[torch.Tensor] = []
        bad = errors = 0
        try:
            n = self.store.batch_exists(names)
            records = self.store.batch_get(names[:n]) if n else []
        except Exception as exc:  # unreachable, I/O error: a miss
            self._warn_once("read", "kv_store: reading pages failed (%s); serving goes on without them", exc)
            records, errors = [], 1
            self._down_until = time.monotonic() + _DOWN_SECONDS
        for key, record in zip(keys, records):
            try:
                if record is None:  # deleted between the lookup and the read
                    raise page_record.BadRecord("the record vanished")
                payload = page_record.decode(record, self.fingerprint, key, self.page_bytes)
            except page_record.BadRecord as exc:
                bad += 1
                self._warn_once("bad", "kv_store: a page record was rejected (%s); it is recomputed", exc)
                break
            out.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        with self._lock:
            self.stats.fetch_seconds += time.perf_counter() - t0
            self.stats.bad_records += bad
            self.stats.read_errors += errors
            self.stats.l3_partial_fetches += len(out) < len(keys)
        return out

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._writes.task_done()

    def _write(self, keys: list[bytes], payloads: list[torch.Tensor], events: list) -> None:
        records = [page_record.encode(self.fingerprint, k, p.numpy()) for k, p in zip(keys, payloads)]
        try:
            evicted = self.store.batch_put([self._name(k) for k in keys], records)
        except Exception as exc:  # full, read-only, unreachable: the pages stay in L1 / L2 only
            self._warn_once("write", "kv_store: writing pages failed (%s); serving goes on", exc)
            with self._lock:
                self.stats.write_errors += len(keys)
            return
        with self._lock:
            self.stats.written_pages += len(keys)
            self.stats.written_bytes += sum(len(r) for r in records)
            if self.prefix.events is not None:
                self._events += events
            for key in self._keys_of(evicted):
                self._written.discard(key)  # gone from the store: a later write-back puts it again
                if self.prefix.events is not None:
                    kv_events.removed(self._events, key, self.store.medium)

    def _keys_of(self, names: list[str]) -> list[bytes]:
        """The page keys of this model's records among store names (`_name`'s inverse)."""
        suffix = "-" + self.fingerprint.hex()
        return [bytes.fromhex(n[:-len(suffix)]) for n in names if n.endswith(suffix)]

    def _store_size(self) -> int:
        try:
            return self.store.size_bytes()
        except Exception:
            return 0

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            if self.host is not None:
                self.stats.l2_pages, self.stats.l2_bytes = len(self.host), self.host.bytes
            if self.store is not None:
                self.stats.l3_bytes = self._store_size()
            return self.stats.as_dict()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued write-backs are in the store (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._writes is not None and self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Write what is queued, then stop the threads and close the store."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=60)
            self._fetcher.shutdown(wait=True, cancel_futures=True)
            self.store.close()
            self._writer = None
        self.prefix.lower_tier = None


def open_kv_store(cache: StateCache, config, model_dir, tokenizer, dtype: torch.dtype,
                  restores: bool) -> TieredKVStore | None:
    """The tiers below `cache`'s pool that the engine's `config` asks for (kv_store: a page store URL,
    kv_host_cache_bytes: host memory), None when it asks for neither. `restores`: whether bounded
    replay rebuilds the window state after a hit (else lookups are skipped)."""
    if not (config.kv_store or config.kv_host_cache_bytes):
        return None
    if cache.prefix is None:
        raise ValueError("kv_store / kv_host_cache_bytes: this model keeps no paged decode state, so it has no "
                         "prefix pages to store; leave them out")
    fingerprint = model_fingerprint(model_dir, tokenizer, cache.spec, cache.page_tokens, dtype)
    store = open_page_store(config.kv_store) if config.kv_store else None
    return TieredKVStore(cache, fingerprint, store, config.kv_host_cache_bytes, restores=restores)
