"""What of a cache moves from prefill to decode, as byte segments of registered memory.

A request's decode state is what its model's CacheSpec lists, nothing more (core/cache.py):
- the slot rows of every pool with `ring` rows (sliding-window rings, compressors' partial
  windows): one contiguous run of ring x width elements per pool;
- the page rows of every paged pool (compressed entries, indexer keys, latent pages) for the pages
  holding positions [0, prompt length): one contiguous run per pool and page, page-granular (a
  partly filled last page moves whole). Pages the decode side already holds (its prefix-cache
  hit) are not sent.
- with DSpark drafting, the drafter's context rings of the slot (Drafter.slot_pools), as ring pools.
Scratch rows are a step's staging area and never move.

Both sides describe their cache with `describe` (the fingerprint: model, dtype, page size, every
pool's shape) and refuse a peer whose description differs; the addresses are each side's own."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from deepinfer.core.cache import StateCache
from deepinfer.models.base import Pool


def model_digest(model_dir: str) -> str:
    """A digest of the model's config.json: two workers of one model (and config) agree on it."""
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unknown"


def pools(cache: StateCache, drafter=None) -> dict[str, Pool]:
    """Every pool a request's decode state lives in: the cache's, and the drafter's rings (if any)."""
    out = dict(cache.pools)
    if drafter is not None:
        out.update({p.spec.name: p for p in drafter.slot_pools()})
    return out


def describe(cache: StateCache, model_dir: str, backend: str, drafter=None) -> dict:
    """What a peer must share with this cache for its bytes to mean the same here, and the transfer
    engine that moves them (JSON-able)."""
    return {"backend": backend, "model": os.path.basename(os.path.normpath(model_dir)), "model_digest": model_digest(model_dir),
            "dtype": str(cache.dtype).removeprefix("torch."), "page_tokens": cache.page_tokens,
            "pools": [[p.spec.name, p.spec.width, p.spec.ring, p.spec.stride, str(p.data.dtype).removeprefix("torch.")]
                      for p in pools(cache, drafter).values()]}


def mismatch(mine: dict, theirs: dict, who: str) -> str | None:
    """Why a peer's description (`theirs`, of `who`) cannot exchange state with this one; None: it can."""
    if mine["backend"] != theirs.get("backend"):
        return (f"{who} moves state with {theirs.get('backend')!r}, this worker with {mine['backend']!r}: give both "
                "the same --disaggregation-transfer-backend")
    if mine["model_digest"] != theirs["model_digest"]:
        return (f"{who} serves model {theirs['model']!r} (config.json digest {theirs['model_digest']}), this worker "
                f"{mine['model']!r} ({mine['model_digest']}): start prefill and decode with the same --model")
    for key, flag in (("dtype", "--dtype"), ("page_tokens", "the page size")):
        if mine[key] != theirs[key]:
            return f"{who} has {key}={theirs[key]}, this worker {key}={mine[key]}: give both the same {flag}"
    if mine["pools"] != theirs["pools"]:
        diff = [(a, b) for a, b in zip(mine["pools"], theirs["pools"]) if a != b] or [(mine["pools"], theirs["pools"])]
        return (f"{who}'s cache pools differ from this worker's ([name, width, ring rows, stride, dtype]: theirs "
                f"{diff[0][1]}, mine {diff[0][0]}): the same model, dtype and speculative settings on both sides")
    return None


def regions(cache: StateCache, drafter=None) -> list[tuple[int, int]]:
    """(address, bytes) of every pool tensor: what the transfer engine registers."""
    return [(p.data.data_ptr(), p.data.numel() * p.data.element_size()) for p in pools(cache, drafter).values()]


def addresses(cache: StateCache, drafter=None) -> dict:
    """Per pool, the address of its first slot row and first page row, and its row bytes: what a decode
    side sends prefill so that it can compute where each of its segments goes."""
    out = {}
    for name, p in pools(cache, drafter).items():
        row = p.spec.width * p.data.element_size()
        base = p.data.data_ptr()
        out[name] = [base, base + p.page_base * row, row]
    return out


@dataclass(slots=True)
class Segments:
    src: list[int]
    dst: list[int]
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


def segments(cache: StateCache, slot: int, pages: list[int], peer: dict, peer_slot: int,
             peer_pages: list[int], drafter=None) -> Segments:
    """The writes that copy `slot`'s ring rows and `pages` (this cache) into `peer_slot` and
    `peer_pages` of the peer whose `addresses` are `peer`; runs contiguous on both sides are merged."""
    runs: list[tuple[int, int, int]] = []
    for name, p in pools(cache, drafter).items():
        row = p.spec.width * p.data.element_size()
        base = p.data.data_ptr()
        peer_base, peer_page_base, peer_row = peer[name]
        if peer_row != row:
            raise ValueError(f"pool {name}: row bytes differ ({row} here, {peer_row} at the peer)")
        if p.spec.ring:
            n = p.spec.ring * row
            runs.append((base + slot * n, peer_base + peer_slot * n, n))
        if p.page_rows:
            n = p.page_rows * row
            page_base = base + p.page_base * row
            runs += [(page_base + s * n, peer_page_base + d * n, n) for s, d in zip(pages, peer_pages, strict=True)]
    runs.sort()
    out = Segments([], [], [])
    for src, dst, n in runs:
        if out.src and out.src[-1] + out.lengths[-1] == src and out.dst[-1] + out.lengths[-1] == dst:
            out.lengths[-1] += n
        else:
            out.src.append(src)
            out.dst.append(dst)
            out.lengths.append(n)
    return out


def expected_bytes(cache: StateCache, pages: int, drafter=None) -> int:
    """Bytes a request moves: one slot's ring rows plus `pages` pages, by the cache spec, plus the
    drafter's rings of one slot."""
    rings = sum(p.spec.ring * p.spec.width * p.data.element_size() for p in (drafter.slot_pools() if drafter else ()))
    return cache.bytes_per_slot() + pages * cache.bytes_per_page() + rings
