"""Prefix-cache page bookkeeping: hash chains, sharing, LRU eviction, no page lost or doubled."""

from __future__ import annotations

from deepinfer.core.cache import StateCache
from deepinfer.models.deepseek_v4 import DeepseekV4Config
from deepinfer.models.deepseek_v4.step import cache_spec
from tiny_models import CONFIGS


def _cache(num_pages: int) -> StateCache:
    import transformers

    cfg = DeepseekV4Config.from_dict(transformers.DeepseekV4Config(**CONFIGS["csa_hc2"]).to_dict())
    return StateCache(cache_spec(cfg, margin=0), max_seqs=4, num_pages=num_pages, max_step_tokens=64,
                      max_model_len=1024)


def _run(cache: StateCache, tokens: list[int]) -> tuple[int, list[bytes]]:
    """A sequence that computed `tokens` (as the scheduler would leave it before release)."""
    keys = cache.prefix.keys([], tokens)
    pages = cache.prefix.match(keys)
    slot = cache.allocate_slot(pages)
    cache.grow(slot, len(tokens))
    return slot, keys


def test_keys_chain_the_whole_prefix():
    prefix = _cache(4).prefix
    a = prefix.keys([], list(range(300)))
    assert len(a) == 2  # full pages only
    b = prefix.keys([], [7] + list(range(1, 300)))
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different first: different key
    assert prefix.keys([], list(range(256)) + [-1]) == a  # a placeholder ends nothing before it
    assert prefix.keys([], list(range(200)) + [-1] * 100) == a[:1]


def test_shared_pages_are_held_until_the_last_user_leaves():
    cache = _cache(6)
    slot, keys = _run(cache, list(range(300)))  # 3 pages, the last one partial
    cache.release(slot, keys)
    assert cache.num_free_pages == 6 and len(cache.prefix.idle) == 2
    a, _ = _run(cache, list(range(260)))
    b, _ = _run(cache, list(range(256)) + [9] * 100)
    shared = cache.slot_pages[a][:2]
    assert cache.slot_pages[b][:2] == shared and all(cache.prefix.refs[p] == 2 for p in shared)
    cache.release(a)
    assert all(cache.prefix.refs[p] == 1 for p in shared) and not cache.prefix.idle
    cache.release(b)
    assert sorted(cache.prefix.idle) == sorted(shared)
    assert sorted(cache.free_pages + list(cache.prefix.idle)) == list(range(6))


def test_idle_pages_are_evicted_least_recently_used_and_tail_first():
    cache = _cache(4)
    old, old_keys = _run(cache, [1] * 256)
    cache.release(old, old_keys)
    new, new_keys = _run(cache, [2] * 256)
    cache.release(new, new_keys)
    assert len(cache.prefix.idle) == 4 and not cache.free_pages
    slot = cache.allocate_slot()
    cache.grow(slot, 128)  # takes the older conversation's last page
    assert cache.prefix.stats.evicted_pages == 1
    assert len(cache.prefix.match(old_keys)) == 1 and len(cache.prefix.match(new_keys)) == 2
    cache.release(slot)


def test_a_prefix_computed_twice_is_cached_once():
    cache = _cache(4)
    a, keys = _run(cache, [3] * 130)
    b, _ = _run(cache, [3] * 130)  # admitted before a finished: no hit, its own pages
    cache.release(a, keys[:1])
    cache.release(b, keys[:1])
    assert len(cache.prefix.page_of) == 1 and len(cache.prefix.idle) == 1
    assert cache.num_free_pages == 4


def test_multimodal_spans_key_the_pages_they_overlap():
    """Image positions all carry one placeholder id: the span's digest keys every page it touches (and,
    through the chain, every later page), so only the same image in the same place hits."""
    prefix = _cache(4).prefix
    tokens = [5] * 10 + [9] * 300 + [6] * 90  # a 300-position image span at 10..310 (pages 0-2)
    plain = prefix.keys([], tokens)
    a = prefix.keys([], tokens, [(10, 310, b"image-a")])
    b = prefix.keys([], tokens, [(10, 310, b"image-b")])
    assert len(a) == 3 and all(x != y for x, y in zip(a, b)) and all(x != y for x, y in zip(a, plain))
    assert prefix.keys([], tokens, [(10, 310, b"image-a")]) == a  # deterministic
    moved = prefix.keys([], tokens, [(11, 311, b"image-a")])  # same image one position later
    assert moved[0] != a[0]
    late = prefix.keys([], tokens, [(300, 310, b"image-a")])  # a span only in page 2
    assert late[:2] == plain[:2] and late[2] != plain[2]
