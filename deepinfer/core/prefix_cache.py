"""Prefix cache: the compressed state of token prefixes, kept in hash-chained pages after the
sequences that computed them end, and taken over by later sequences that start the same way.

A page covers `page_tokens` positions, a multiple of every compress rate, so the compressed
entries and indexer keys it holds depend only on the tokens up to its end: its key is the hash
of its parent page's key and its own token ids. A cached page is reference-counted while
sequences hold it; one that nobody holds is idle, and idle pages are evicted least recently
used first when a sequence needs a page and none is free.

With KV events on (record_events), every page that enters the cache and every eviction is
recorded for routers (core/kv_events.py); the engine takes the records once per step.

Only compressed state is cached. The window state at the end of a cached prefix (sliding-window
rings, the compressors' raw projections of the last tokens) is rebuilt by replay: core/prefix_replay.py.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from deepinfer.core import kv_events


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # admissions that looked the prefix up
    hits: int = 0  # of them, found at least one cached page
    query_tokens: int = 0  # positions looked up
    hit_tokens: int = 0  # positions found cached (mode off finds them but recomputes)
    replayed_tokens: int = 0  # positions before a hit recomputed to rebuild window state
    evicted_pages: int = 0

    def as_dict(self) -> dict[str, float]:
        out = asdict(self)
        out["hit_rate"] = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return out


def _key(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes() + extra, digest_size=16).digest()


def _span_bytes(spans: Sequence[tuple[int, int, bytes]], start: int, end: int) -> bytes:
    """What a page [start, end) holds besides its token ids: the digest and place of every multimodal
    span that overlaps it (its positions all carry the same placeholder id, so the ids alone would
    let two different images share a page)."""
    return b"".join(array("q", (s - start, e - start)).tobytes() + digest for s, e, digest in spans
                    if s < end and e > start)


class PrefixCache:
    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}  # cached page -> sequences holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently used first
        self.stats = PrefixCacheStats()
        self.events: list | None = None  # KV events since take_events(); None: not recorded
        self.medium = ""  # where the pages live, as KV events name it
        # the tiers below the pool (kv/tiered.py's TieredKVStore) or None: told of every page that
        # enters the cache (written back) and of every eviction
        self.lower_tier = None

    def record_events(self, medium: str) -> None:
        """Record KV events from now on (the cache is empty: pages cached before are not told)."""
        self.events, self.medium = [], medium

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def keys(self, known: list[bytes], tokens: Sequence[int],
             spans: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
        """`known` (keys of a sequence's first pages) extended to every full page of `tokens`,
        stopping at a page that holds a placeholder (a token still being sampled, < 0). `spans`:
        the sequence's multimodal spans (first position, end, content digest), keyed with the pages
        they overlap, so a page with an image hits only for the same image in the same place."""
        p = self.page_tokens
        for i in range(len(known), len(tokens) // p):
            page = tokens[i * p:(i + 1) * p]
            if min(page) < 0:
                break
            known.append(_key(known[-1] if known else b"", page, _span_bytes(spans, i * p, (i + 1) * p)))
        return known

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest cached prefix of `keys`."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def hold(self, pages: Sequence[int]) -> None:
        """A sequence takes over cached pages."""
        for page in pages:
            self.refs[page] += 1
            self.idle.pop(page, None)

    def insert(self, keys: Sequence[bytes], pages: Sequence[int], seq=None) -> None:
        """Cache a sequence's full pages (pages[i] holds the positions keyed by keys[i]); the
        sequence still holds them. A prefix already cached under another page keeps that page.
        `seq`: the sequence (its tokens and multimodal spans), read only to record KV events."""
        new = []
        for i, (key, page) in enumerate(zip(keys, pages)):
            if page not in self.key_of and key not in self.page_of:
                self.page_of[key], self.key_of[page], self.refs[page] = page, key, 1
                new.append(i)
        if self.events is not None and new:
            self.events += kv_events.stored(keys, new, seq, self.page_tokens, self.medium)
        if self.lower_tier is not None and new:
            self.lower_tier.on_stored(keys, pages, new, seq)

    def adopt(self, keys: Sequence[bytes], i: int, page: int, seq) -> None:
        """Cache `page`, just filled from a lower tier with the page keyed `keys[i]` of `seq`, as an
        idle page (the most recently used)."""
        self.page_of[keys[i]], self.key_of[page], self.refs[page] = page, keys[i], 0
        self.idle[page] = None
        if self.events is not None:
            self.events += kv_events.stored(keys, [i], seq, self.page_tokens, self.medium)

    def drop(self, page: int) -> bool:
        """A sequence lets go of `page`; False when the page is not cached (the caller frees it)."""
        if page not in self.refs:
            return False
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.idle[page] = None
        return True

    def evict(self) -> int:
        """Forget the least recently used idle page and hand it out for reuse."""
        page, _ = self.idle.popitem(last=False)
        key = self.key_of.pop(page)
        del self.page_of[key], self.refs[page]
        self.stats.evicted_pages += 1
        if self.events is not None:
            kv_events.removed(self.events, key, self.medium)
        if self.lower_tier is not None:
            self.lower_tier.on_evicted(key)
        return page

    def num_idle_among(self, pages: Sequence[int]) -> int:
        return sum(page in self.idle for page in pages)
