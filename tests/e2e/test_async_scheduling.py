"""Zero-overhead (overlapped) scheduling gives exactly the outputs of synchronous scheduling."""

from __future__ import annotations

import random


from deepinfer import LLM, SamplingParams


def _workload(seed: int):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(40):
        prompts.append([rng.randint(2, 511) for _ in range(rng.randint(1, 160))])
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 200), ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=rng.randint(1, 120), seq_seed=rng.getrandbits(64),
                               ignore_eos=True)
        elif kind == 2:  # stops on a token id (and on eos) long before max_tokens, sometimes
            p = SamplingParams(temperature=0.8, max_tokens=rng.randint(1, 150), seq_seed=rng.getrandbits(64),
                               stop_token_ids=[rng.randint(2, 511) for _ in range(40)])
        else:
            p = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 60), stop_token_ids=[1, 7])
        params.append(p)
    return prompts, params


def _run(path, monkeypatch, overlap: bool, abort_every: int):
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1" if overlap else "0")
    llm = LLM(path, max_num_seqs=12, max_num_batched_tokens=192, num_cache_pages=10)  # forces preemption
    engine = llm.engine
    prompts, params = _workload(3)
    reqs = [engine.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(prompts, params))]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % abort_every == 0:
            # abort by a schedule that depends only on the step count, so both runs abort the same ids
            victim = reqs[(steps * 7) % len(reqs)]
            engine.abort_request(victim.request_id)
    engine.pop_finished()
    assert engine.cache.num_free_pages == engine.cache.num_pages
    assert engine.cache.num_free_slots == engine.cache.max_seqs
    preemptions = engine.scheduler.num_preemptions
    engine.close()
    return [(r.output_token_ids, r.finish_reason) for r in reqs], preemptions


def test_async_equals_sync_on_a_mixed_workload(family_model_dir, monkeypatch):
    path, _ = family_model_dir
    sync, sync_preempt = _run(path, monkeypatch, overlap=False, abort_every=10_000)
    overlapped, async_preempt = _run(path, monkeypatch, overlap=True, abort_every=10_000)
    assert sync_preempt > 0 and async_preempt > 0, "the small cache should force preemption"
    assert overlapped == sync
    reasons = {r for _, r in sync}
    assert {"length", "stop"} <= reasons
    for tokens, reason in sync:
        assert all(t >= 0 for t in tokens)


def test_aborts_under_overlap_leave_no_placeholder(tiny_model_dir, monkeypatch):
    path, _ = tiny_model_dir
    results, _ = _run(path, monkeypatch, overlap=True, abort_every=3)
    assert any(reason == "abort" for _, reason in results)
    for tokens, reason in results:
        assert all(t >= 0 for t in tokens), "an in-flight placeholder leaked into the output"
        assert reason in ("abort", "stop", "length")
