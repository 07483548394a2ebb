"""The decode state costs what the architecture needs: window rings + compressed entries."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.core.cache import CacheFull, StateCache
from deepinfer.models.deepseek_v4 import DeepseekV4Config
from deepinfer.models.deepseek_v4.step import CacheView, cache_spec
from tiny_models import CONFIGS


def _config(**overrides) -> DeepseekV4Config:
    import transformers

    return DeepseekV4Config.from_dict(transformers.DeepseekV4Config(**{**CONFIGS["csa_hc2"], **overrides}).to_dict())


def _cache(cfg, **kwargs) -> StateCache:
    return StateCache(cache_spec(cfg, margin=0), **kwargs)


def test_sliding_only_state_does_not_grow_with_length():
    cfg = _config(compress_ratios=[0, 0, 0])
    cache = _cache(cfg, max_seqs=2, num_pages=4, max_step_tokens=64, max_model_len=100_000)
    slot = cache.allocate_slot()
    for length in (10, 1_000, 99_999):
        cache.grow(slot, length)  # a sliding-only model needs no pages at any length
        assert cache.num_free_pages == 4
    # each layer keeps exactly one window ring per slot, nothing per token
    for layer in CacheView(cache, cfg).layers:
        assert layer.kv.shape[0] == cache.ring_slots * cfg.sliding_window + cache.max_step_tokens  # + the trash slot
        assert layer.comp_ring is None and layer.index_keys is None


def test_compressed_layers_grow_by_pages_and_release_them():
    cfg = _config()  # CSA, CSA, sliding
    cache = _cache(cfg, max_seqs=2, num_pages=5, max_step_tokens=64, max_model_len=1024)
    a, b = cache.allocate_slot(), cache.allocate_slot()
    cache.grow(a, 129)  # 129 positions span two 128-token pages
    assert cache.num_free_pages == 3
    assert not cache.can_grow(b, 4 * 128)
    with pytest.raises(CacheFull):
        cache.grow(b, 4 * 128)
    cache.release(a)
    assert cache.num_free_pages == 5 and cache.num_free_slots == 1
    # per page: 32 CSA entries of head_dim + 32 indexer keys of index_head_dim, on 2 CSA layers
    assert cache.bytes_per_page() == 2 * 32 * (cfg.head_dim + cfg.index_head_dim) * 4


def test_entry_rows_follow_the_block_table():
    cfg = _config()
    cache = _cache(cfg, max_seqs=2, num_pages=4, max_step_tokens=8, max_model_len=512)
    a, b = cache.allocate_slot(), cache.allocate_slot()
    cache.grow(a, 128)
    cache.grow(b, 256)
    cache.grow(a, 256)
    view = CacheView(cache, cfg)
    layer = view.layers[0]  # CSA: 32 entries per 128-token page
    rows = view.entry_rows(layer, np.array([a, a, b, b]), np.array([0, 40, 0, 40]))
    pages_a, pages_b = cache.slot_pages[a], cache.slot_pages[b]
    assert rows.tolist() == [pages_a[0] * 32, pages_a[1] * 32 + 8, pages_b[0] * 32, pages_b[1] * 32 + 8]
