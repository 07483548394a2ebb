"""What prefill/decode disaggregation moves, computed from a cache (kv/transfer_layout.py): one slot's
ring rows and whole pages of every paged pool, written where the peer's addresses say, contiguous
runs merged, and a peer whose cache differs refused with the field named. Two caches in one process
stand for the two workers; the copy is done here with ctypes.memmove over the computed segments
(the transfer engine does the same writes across processes)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from deepinfer.core.cache import StateCache
from deepinfer.kv import transfer_layout as layout
from deepinfer.models.base import CacheSpec, PoolSpec

SPEC = CacheSpec((PoolSpec("window", 8, ring=6, scratch=True), PoolSpec("entries", 4, stride=4),
                  PoolSpec("keys", 2, stride=16), PoolSpec("history", 1, ring=3, dtype=torch.int64)))


def _cache(max_seqs: int = 3, pages: int = 6, dtype=torch.float32) -> StateCache:
    return StateCache(SPEC, max_seqs=max_seqs, num_pages=pages, max_step_tokens=8, max_model_len=512,
                      page_tokens=32, dtype=dtype)


def test_segments_copy_the_slot_rings_and_pages_and_nothing_else():
    src, dst = _cache(), _cache(max_seqs=2, pages=8)  # different sizes: only the layout must agree
    for pool in src.pools.values():
        pool.data.copy_(torch.arange(pool.data.numel()).view_as(pool.data))
    slot = src.allocate_slot()
    src.grow(slot, 70)  # 3 pages of 32 positions
    dslot = dst.allocate_slot()
    dst.grow(dslot, 70)
    src_pages, dst_pages = src.slot_pages[slot], dst.slot_pages[dslot]
    segs = layout.segments(src, slot, src_pages, layout.addresses(dst), dslot, dst_pages)
    for s, d, n in zip(segs.src, segs.dst, segs.lengths):
        ctypes.memmove(d, s, n)
    assert segs.nbytes == layout.expected_bytes(src, 3) == src.bytes_per_slot() + 3 * src.bytes_per_page()
    for name, p in src.pools.items():
        q = dst.pools[name]
        if p.spec.ring:
            ring = p.spec.ring
            assert torch.equal(q.data[dslot * ring:(dslot + 1) * ring], p.data[slot * ring:(slot + 1) * ring])
            assert not q.data[q.scratch_base:q.page_base].any()  # scratch rows never move
        for sp, dp in zip(src_pages, dst_pages):
            rows = p.page_rows
            if rows:
                assert torch.equal(q.data[q.page_base + dp * rows:q.page_base + (dp + 1) * rows],
                                   p.data[p.page_base + sp * rows:p.page_base + (sp + 1) * rows])
    # a run contiguous on both sides is one write: fewer segments than pools x pages
    assert len(segs.src) < 2 + 2 * len(src_pages)


def test_a_peer_with_another_cache_is_refused_naming_the_field(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
    mine = layout.describe(_cache(), str(tmp_path), "mooncake")
    assert layout.mismatch(mine, layout.describe(_cache(max_seqs=5, pages=2), str(tmp_path), "mooncake"), "peer") is None
    other = layout.describe(_cache(dtype=torch.bfloat16), str(tmp_path), "mooncake")
    assert "--dtype" in layout.mismatch(mine, other, "the decode worker")
    nixl = layout.describe(_cache(), str(tmp_path), "nixl")
    assert "same --disaggregation-transfer-backend" in layout.mismatch(mine, nixl, "the decode worker")
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3"}')
    assert "same --model" in layout.mismatch(mine, layout.describe(_cache(), str(tmp_path), "mooncake"), "peer")
    with pytest.raises(ValueError, match="row bytes"):
        wide = dict(layout.addresses(_cache()))
        wide["window"] = [wide["window"][0], wide["window"][1], 999]
        cache = _cache()
        layout.segments(cache, 0, [], wide, 0, [])


def test_the_drafters_rings_move_with_the_slot(monkeypatch, tmp_path):
    """With DSpark drafting, each stage's context ring of the request's slot moves too (Drafter.slot_pools),
    into the peer drafter's ring of its slot; a peer without drafting is refused by the pool list."""
    from deepinfer import LLM
    from deepinfer.llm import TINY_DSV4_DIR

    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "5")
    src_llm, dst_llm = LLM(TINY_DSV4_DIR, max_num_seqs=2), LLM(TINY_DSV4_DIR, max_num_seqs=3)
    try:
        src, dst = src_llm.engine, dst_llm.engine
        drafter, peer = src.spec.drafter, dst.spec.drafter
        pools = drafter.slot_pools()
        assert len(pools) == len(drafter.kv) >= 1 and all(p.spec.ring == drafter.ring for p in pools)
        for kv in drafter.kv:
            kv.copy_(torch.arange(kv.numel(), dtype=kv.dtype).view_as(kv))
        before = [kv.clone() for kv in peer.kv]  # (the step-cost profiling at start-up may have drafted)
        segs = layout.segments(src.cache, 1, [], layout.addresses(dst.cache, peer), 2, [], drafter)
        for s, d, n in zip(segs.src, segs.dst, segs.lengths):
            ctypes.memmove(d, s, n)
        ring = drafter.ring
        for kv, got, old in zip(drafter.kv, peer.kv, before):
            assert torch.equal(got[2 * ring:3 * ring], kv[ring:2 * ring])
            assert torch.equal(got[:2 * ring], old[:2 * ring]) and torch.equal(got[3 * ring:], old[3 * ring:])
        assert segs.nbytes == layout.expected_bytes(src.cache, 0, drafter) > src.cache.bytes_per_slot()
        model_dir = str(tmp_path)
        (tmp_path / "config.json").write_text("{}")
        with_rings = layout.describe(src.cache, model_dir, "mooncake", drafter)
        without = layout.describe(src.cache, model_dir, "mooncake")
        assert "cache pools differ" in layout.mismatch(with_rings, without, "the decode worker")
    finally:
        src_llm.close()
        dst_llm.close()
