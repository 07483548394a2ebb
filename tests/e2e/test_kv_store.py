"""The tiered prefix KV store (deepinfer/kv, docs/kv-store.md) on tiny models: a page written back
by one engine is read by another (L3) and restores what a hit in the pool restores; evictions under a
workload larger than the pool come back from host memory; every storage fault is a counted miss with
the cold run's output."""

from __future__ import annotations

import os
import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.llm import TINY_DSV41_DIR

PARAMS = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, top_logprobs=2)


def _doc(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(2, vocab - 1) for _ in range(n)]


def _llm(path, monkeypatch, mode="compact", **kw) -> LLM:
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", mode)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")  # the shipped V4.1's drafter: its verify batches vary
    return LLM(path, **{"max_num_seqs": 4, "max_num_batched_tokens": 1024, **kw})


def _run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]


def _same(a, b, tol: float = 1e-5) -> bool:
    """Same tokens, and logprobs of the same top tokens within `tol`."""
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        if ta != tb:
            return False
        for x, y in zip(la, lb):
            if [t for t, _ in x] != [t for t, _ in y] or max(abs(p - q) for (_, p), (_, q) in zip(x, y)) > tol:
                return False
    return True


def _kv(llm: LLM) -> dict:
    llm.engine.kv_store.flush()
    return {k[len("kv_store_"):]: v for k, v in llm.stats().items() if k.startswith("kv_store_")}


def _models(request):
    return {"v4": lambda: request.getfixturevalue("tiny_model_dir")[0],
            "v3": lambda: request.getfixturevalue("tiny_v3_model_dir")[0],
            "v41": lambda: TINY_DSV41_DIR}


@pytest.mark.parametrize("family", ["v4", "v3", "v41"])
def test_a_second_engine_restores_the_prefix_from_the_file_store(family, request, monkeypatch, tmp_path):
    """Engine A computes a prefix and writes its pages back; engine B, started on the same directory,
    reads them (an L3 hit) and computes exactly what A computes after a hit in its own pool. V3's
    latent pages are its whole decode state: there the hit also equals a cold run."""
    path = _models(request)[family]()
    store = f"file://{tmp_path}"
    vocab = 500 if family != "v41" else 8000
    doc = _doc(700, seed=3, vocab=vocab)
    a = _llm(path, monkeypatch, kv_store=store, max_num_seqs=1)
    _run(a, [doc[:600]])
    _run(a, [doc[:650]])  # caches (and writes) every full page of doc[:650], as B will find them
    _run(a, [_doc(300, seed=5, vocab=vocab)])  # leaves its rows in the slot's window rings, as B has none
    hit0 = a.stats()["prefix_cache_hit_tokens"]
    warm_a = _run(a, [doc[:650]])  # a hit in A's pool
    hit_a = a.stats()["prefix_cache_hit_tokens"] - hit0
    assert _kv(a)["written_pages"] >= 4
    a.close()
    b = _llm(path, monkeypatch, kv_store=store, max_num_seqs=1)
    warm_b = _run(b, [doc[:650]])
    stats = _kv(b)
    page = b.engine.cache.page_tokens
    assert stats["l3_hit_tokens"] == (649 // page) * page and stats["bad_records"] == 0
    # the same hit length as A's: compact replay's approximation depends on where the hit ends, so
    # only hits of one length compute the same thing
    assert b.stats()["prefix_cache_hit_tokens"] == stats["l3_hit_tokens"] == hit_a
    assert _same(warm_b, warm_a)
    if family == "v3":
        cold = _run(_llm(path, monkeypatch), [doc[:650]])
        assert _same(warm_b, cold, tol=1e-4)
    b.close()


def test_a_foreign_model_never_reads_the_pages(tiny_model_dir, tiny_v3_model_dir, monkeypatch, tmp_path):
    """Pages of the V4 model stay unread by the V3 one on the same directory: other keys (and were a file
    renamed, its header names another model)."""
    store = f"file://{tmp_path}"
    doc = _doc(700, seed=4)
    v4 = _llm(tiny_model_dir[0], monkeypatch, kv_store=store)
    _run(v4, [doc[:600]])
    v4.close()
    v3 = _llm(tiny_v3_model_dir[0], monkeypatch, kv_store=store)
    _run(v3, [doc[:600]])
    stats = _kv(v3)
    assert stats["l3_hit_tokens"] == 0 and stats["written_pages"] >= 4
    v3.close()


def test_damaged_pages_are_counted_misses_with_the_cold_output(tiny_model_dir, monkeypatch, tmp_path):
    """A flipped byte, a truncated record, another model's record under the page's name, a record
    deleted between lookup and read: each a counted miss, and the output is the cold run's."""
    path = tiny_model_dir[0]
    store = f"file://{tmp_path}"
    docs = [_doc(300, seed=10 + i) for i in range(4)]
    writer = _llm(path, monkeypatch, kv_store=store)
    _run(writer, docs)
    tiers = writer.engine.kv_store
    tiers.flush()
    # the record of each doc's first page
    first = [tiers.store._path(tiers._name(writer.engine.cache.prefix.keys([], d)[0])) for d in docs]
    other = tiers.store._path(tiers._name(writer.engine.cache.prefix.keys([], docs[3])[1]))
    writer.close()
    assert all(os.path.exists(f) for f in first + [other])
    cold = _run(_llm(path, monkeypatch), [d + [7] for d in docs])

    flip, trunc = (open(f, "rb").read() for f in first[:2])
    with open(first[0], "r+b") as f:
        f.seek(len(flip) // 2)
        f.write(bytes([flip[len(flip) // 2] ^ 0x40]))
    with open(first[1], "wb") as f:
        f.write(trunc[:len(trunc) // 3])
    with open(first[2], "wb") as f:  # a record of another page under this page's name
        f.write(open(other, "rb").read())

    reader = _llm(path, monkeypatch, kv_store=store)
    store_obj = reader.engine.kv_store.store
    real_get = store_obj.batch_get

    def get_after_delete(keys):  # the record goes between the lookup and the read
        for key in keys:
            if store_obj._path(key) == first[3]:
                os.unlink(first[3])
        return real_get(keys)

    monkeypatch.setattr(store_obj, "batch_get", get_after_delete)
    outs = [_run(reader, [d + [7]])[0] for d in docs]
    stats = _kv(reader)
    # both pages of a doc are read in one batch; each damaged first page stops its doc's fetch
    assert stats["bad_records"] == 4 and stats["l3_hit_tokens"] == 0
    for out, c in zip(outs, cold):
        assert out[0] == c[0]
    reader.close()


def test_a_store_it_cannot_write_serves_on(tiny_model_dir, monkeypatch, caplog):
    """Writes that fail (a directory nobody may write: /proc's, for root too) are counted errors and
    one warning; requests are served as without a store."""
    path = tiny_model_dir[0]
    docs = [_doc(300, seed=20 + i) for i in range(3)]
    llm = _llm(path, monkeypatch, kv_store="file:///proc/self/fdinfo")
    outs = _run(llm, docs)
    stats = _kv(llm)
    assert stats["write_errors"] >= 6 and stats["written_pages"] == 0
    assert sum("writing pages failed" in r.message for r in caplog.records) == 1
    assert _same(outs, _run(_llm(path, monkeypatch), docs), tol=1e-4)
    llm.close()


def test_evictions_from_a_small_pool_come_back_from_host_memory(tiny_model_dir, monkeypatch, tmp_path):
    """A pool of 8 pages, a working set of 24: the second round finds what the pool evicted in L2 and
    computes what an engine whose pool holds everything computes after its own hits."""
    path = tiny_model_dir[0]
    docs = [_doc(400, seed=30 + i) for i in range(4)]  # six full pages each (page 64)
    prompts = docs + [d + [9] * 20 for d in docs]
    small = _llm(path, monkeypatch, num_cache_pages=8, max_num_seqs=1, kv_host_cache_bytes=64 << 20)
    got = [_run(small, [p])[0] for p in prompts]
    stats = _kv(small)
    page = small.engine.cache.page_tokens
    assert stats["l2_hit_tokens"] >= 4 * (400 // page - 1) * page and stats["l2_pages"] >= 4 * (400 // page)
    assert small.stats()["prefix_cache_evicted_pages"] > 0
    big = _llm(path, monkeypatch, max_num_seqs=1)
    want = [_run(big, [p])[0] for p in prompts]
    assert _same(got, want)
    small.close()


def test_store_evictions_are_kv_events(tiny_model_dir, monkeypatch, tmp_path):
    """A file store over its byte budget (file:///dir?max_bytes=N) drops its least recently used
    records; with KV events on, every page written is a BlockStored and every record dropped a
    BlockRemoved, both with medium DISK, so a router's view of the store matches the directory."""
    from deepinfer.core.kv_events import BlockRemoved, BlockStored, external_hash, medium_of

    path = tiny_model_dir[0]
    docs = [_doc(300, seed=50 + i) for i in range(4)]
    sizer = _llm(path, monkeypatch, kv_store=f"file://{tmp_path / 'sizer'}")
    _run(sizer, docs[:1])
    _kv(sizer)
    sizer.close()
    record = max(f.stat().st_size for f in (tmp_path / "sizer").rglob("*") if f.is_file())
    llm = _llm(path, monkeypatch, kv_store=f"file://{tmp_path / 'store'}?max_bytes={3 * record}")
    llm.engine.cache.prefix.record_events(medium_of(llm.engine.cache.device))  # as start_kv_events does
    for d in docs:
        _run(llm, [d])
    stats = _kv(llm)
    events = llm.engine.kv_store.take_events()
    stored = [h for e in events if isinstance(e, BlockStored) and e.medium == "DISK" for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes]
    left = {external_hash(bytes.fromhex(f.name.split("-")[0]))
            for f in (tmp_path / "store").rglob("*") if f.is_file()}
    assert len(stored) == stats["written_pages"] >= 8
    assert removed and set(removed) <= set(stored)
    assert left == set(stored) - set(removed) and len(left) <= 3
    llm.close()


def test_prompt_pages_are_written_as_the_prefill_goes(tiny_model_dir, monkeypatch, tmp_path):
    """A long prompt prefilled in chunks reaches the store page by page: while its request is still
    decoding, a second engine on the same directory already restores the prompt's prefix from L3,
    and computes what the first engine computes after a hit in its own pool."""
    from deepinfer import SamplingParams as Params

    path = tiny_model_dir[0]
    store = f"file://{tmp_path}"
    doc = _doc(700, seed=60)
    a = _llm(path, monkeypatch, kv_store=store, max_num_seqs=1, max_num_batched_tokens=128)
    page = a.engine.cache.page_tokens
    req = a.engine.add_request(doc[:600], Params(temperature=0.0, ignore_eos=True, max_tokens=200))
    while req.num_computed < req.num_prompt_tokens + 2:
        a.engine.step()
    assert not req.is_finished
    assert _kv(a)["written_pages"] == 600 // page  # the prompt's full pages, before the request ends
    b = _llm(path, monkeypatch, kv_store=store, max_num_seqs=1)
    warm_b = _run(b, [doc[:620]])  # as many full pages as the first prompt (page 64 or 128)
    assert _kv(b)["l3_hit_tokens"] == 600 // page * page
    b.close()
    a.engine.abort_request(req.request_id)
    while a.engine.has_unfinished():
        a.engine.step()
    a.engine.pop_finished()
    hit0 = a.stats()["prefix_cache_hit_tokens"]
    warm_a = _run(a, [doc[:620]])
    assert a.stats()["prefix_cache_hit_tokens"] - hit0 == 600 // page * page
    assert _same(warm_b, warm_a)
    a.close()
