"""Multi-step scheduling: several greedy decode steps per model call (DEEPINFER_MULTI_STEP_DECODE)
must give exactly what one step per call gives, stop where that stops, and free everything."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tiny_models import hf_greedy
from deepinfer import LLM, SamplingParams


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in lengths]


def _llm(path, monkeypatch, steps: int, **kw) -> LLM:
    monkeypatch.setenv("DEEPINFER_MULTI_STEP_DECODE", str(steps))
    kw = dict(max_num_seqs=8, max_num_batched_tokens=512, num_cache_pages=64) | kw
    return LLM(path, **kw)


def _count_calls(llm: LLM) -> list[int]:
    """Counts the engine's multi-step calls (steps per call)."""
    engine, calls = llm.engine, []
    decode_steps = engine.runner.decode_steps

    def counted(ids, slots, starts, steps, *a, **kw):
        calls.append(steps)
        return decode_steps(ids, slots, starts, steps, *a, **kw)

    engine.runner.decode_steps = counted
    return calls


def _outputs(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].text)
            for o in outs]


def test_multi_step_equals_one_step_per_call(tiny_model_dir, monkeypatch):
    path, hf = tiny_model_dir
    one = _llm(path, monkeypatch, 1)
    prompts = _prompts([3, 50, 130, 290, 77, 20], seed=1)
    # stop ids and strings taken from the free-running outputs, so requests stop inside a call
    free = _outputs(one, prompts, SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[free[2][0][10]], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=False),
              SamplingParams(temperature=0.0, max_tokens=45, stop=[free[4][3][20:23]], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    ref = _outputs(one, prompts, params)
    multi = _llm(path, monkeypatch, 8)
    calls = _count_calls(multi)
    got = _outputs(multi, prompts, params)
    assert got == ref
    assert ref[2][1] == "stop" and len(ref[2][0]) == free[2][0].index(free[2][0][10]) + 1
    assert ref[4][1] == "stop" and isinstance(ref[4][2], str)
    assert calls and max(calls) == 8, calls  # it ran, in calls of up to 8 steps
    engine = multi.engine
    assert engine.cache.num_free_pages == engine.cache.num_pages and engine.cache.num_free_slots == engine.cache.max_seqs
    for prompt, (tokens, *_) in zip(prompts[:2], got[:2]):
        assert tokens == hf_greedy(hf, prompt, len(tokens))


def test_without_a_tokenizer_stops_by_token_id_fall_where_one_step_per_call_puts_them(tiny_model_dir, monkeypatch,
                                                                                        tmp_path):
    """Without a tokenizer (no text to build, no stop strings) a call's stops are found from the token
    ids alone: stop ids, EOS and max_tokens must end each request at the same token as one step per call."""
    path, _ = tiny_model_dir
    prompts = _prompts([3, 50, 130, 77, 20, 9], seed=7)

    def bare(eos: int | None) -> str:  # the checkpoint without its tokenizer files (and with another EOS)
        out = tmp_path / f"eos{eos}"
        out.mkdir()
        for name in os.listdir(path):
            if name.endswith(".safetensors") or name in ("config.json", "generation_config.json"):
                shutil.copy(os.path.join(path, name), out / name)
        if eos is not None:
            for name in ("config.json", "generation_config.json"):
                if (out / name).exists():
                    config = json.loads((out / name).read_text())
                    (out / name).write_text(json.dumps(config | {"eos_token_id": eos}))
        return str(out)

    free = _outputs(_llm(bare(None), monkeypatch, 1), prompts,
                    SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True))
    eos = free[4][0][10]  # a token the fifth request produces: with EOS honoured it stops there (or before)
    model = bare(eos)
    params = [SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),  # a call of 8, then one of 1
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[free[2][0][12]], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=33, stop_token_ids=[free[3][0][5]], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=False),
              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)]
    one = _llm(model, monkeypatch, 1)
    assert one.engine.tokenizer is None
    ref = _outputs(one, prompts, params)
    multi = _llm(model, monkeypatch, 8)
    calls = _count_calls(multi)
    assert _outputs(multi, prompts, params) == ref and calls
    assert [len(r[0]) for r in ref[:2]] == [45, 9] and ref[2][1] == ref[3][1] == ref[4][1] == "stop"
    assert ref[4][0][-1] == eos and len(ref[4][0]) <= 11


def test_state_after_a_stop_inside_a_call_serves_the_prefix_cache(tiny_model_dir, monkeypatch):
    """A request that stops mid-call leaves its full pages in the prefix cache: they must hold the
    state of the tokens it kept, not of the ones computed past its stop."""
    path, _ = tiny_model_dir
    prompt = _prompts([200], seed=3)[0]
    one = _llm(path, monkeypatch, 1)
    free = one.generate(prompt_token_ids=[prompt], use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True))[0]
    stop_at = next(i for i in range(61, 90) if free.outputs[0].token_ids[i] not in free.outputs[0].token_ids[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=90, stop_token_ids=[free.outputs[0].token_ids[stop_at]],
                          ignore_eos=True)
    multi = _llm(path, monkeypatch, 8)
    calls = _count_calls(multi)
    first = multi.generate(prompt_token_ids=[prompt], sampling_params=stop, use_tqdm=False)[0].outputs[0]
    assert first.token_ids == free.outputs[0].token_ids[:stop_at + 1] and calls
    follow = prompt + first.token_ids + [7, 8, 9]  # pages of positions 0..255 come from the cache
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = multi.generate(prompt_token_ids=[follow], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert multi.stats()["prefix_cache_hit_tokens"] >= 128
    fresh = _llm(path, monkeypatch, 1)
    assert got.token_ids == fresh.generate(prompt_token_ids=[follow], sampling_params=params,
                                           use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, max_tokens=12, seq_seed=3, ignore_eos=True),
                                    SamplingParams(temperature=0.0, max_tokens=12, top_logprobs=2, ignore_eos=True)],
                         ids=["sampled", "logprobs"])
def test_rows_that_need_the_host_between_tokens_run_one_step_per_call(tiny_model_dir, monkeypatch, params):
    path, _ = tiny_model_dir
    prompts = _prompts([40, 60], seed=4)
    one = _outputs(_llm(path, monkeypatch, 1), prompts, params)
    multi = _llm(path, monkeypatch, 8)
    calls = _count_calls(multi)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    mixed = multi.generate(prompt_token_ids=prompts, sampling_params=[params, greedy], use_tqdm=False)
    assert not calls  # one such row keeps the whole batch at one step per call
    assert [o.outputs[0].token_ids for o in mixed][0] == one[0][0]


def test_a_waiting_request_is_not_held_back_by_a_call(tiny_model_dir, monkeypatch):
    """With a request waiting for a slot, steps stay single so it is admitted as soon as one frees."""
    path, _ = tiny_model_dir
    multi = _llm(path, monkeypatch, 8, max_num_seqs=2)
    engine = multi.engine
    waiting_at_calls = []
    decode_steps = engine.runner.decode_steps
    engine.runner.decode_steps = lambda *a, **kw: waiting_at_calls.append(len(engine.scheduler.waiting)) or decode_steps(*a, **kw)
    prompts = _prompts([30, 30, 30], seed=5)
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts, (3, 40, 10))]
    steps_until_admitted = 0
    while reqs[2].slot is None:
        engine.step()
        steps_until_admitted += 1
    assert steps_until_admitted <= 4  # prefill, then the first request's two decode steps
    while engine.has_unfinished():
        engine.step()
    assert [len(r.output_token_ids) for r in reqs] == [3, 40, 10]
    assert waiting_at_calls and set(waiting_at_calls) == {0}


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
def test_replayed_steps_give_the_eager_engines_outputs(family_model_dir, monkeypatch, invariant):
    """The engine with recorded and replayed decode steps (plain and multi-step calls, greedy and
    sampled rows, requests arriving and finishing) against DEEPINFER_ENFORCE_EAGER=1, for each
    model family: the same tokens and logprobs, and the replay did run."""
    _replayed_equals_eager(family_model_dir[0], monkeypatch, invariant)


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
def test_replayed_v41_steps_give_the_eager_engines_outputs(monkeypatch, invariant):
    """The same on DeepSeek-V4.1's golden ced10 (Engram, ratio-2 and ratio-1 KV sources and their
    consumers, a candidate source, a Reindex layer, the CED split of the 290-token prompt): its
    decode steps are replayed, in plain and multi-step calls, never eager."""
    from v41_goldens import checkpoint_dir

    _replayed_equals_eager(str(checkpoint_dir("ced10")), monkeypatch, invariant)


@pytest.mark.parametrize("config", ["ced10", "mini6"])
def test_v41_multi_step_equals_one_step_per_call(monkeypatch, config):
    """DeepSeek-V4.1 plans up to 8 decode steps per call (each step's plan stacked): the tokens of one
    step per call, stops inside a call included, everything freed."""
    from v41_goldens import checkpoint_dir

    path = str(checkpoint_dir(config))
    prompts = _prompts([3, 50, 130, 290, 77, 20], seed=1)
    one = _llm(path, monkeypatch, 1)
    free = _outputs(one, prompts, SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[free[2][0][10]], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    ref = _outputs(one, prompts, params)
    multi = _llm(path, monkeypatch, 8)
    calls = _count_calls(multi)
    assert _outputs(multi, prompts, params) == ref
    assert ref[2][1] == "stop" and len(ref[2][0]) == free[2][0].index(free[2][0][10]) + 1
    assert calls and max(calls) == 8, calls
    cache = multi.engine.cache
    assert cache.num_free_pages == cache.num_pages and cache.num_free_slots == cache.max_seqs


def _replayed_equals_eager(path, monkeypatch, invariant: bool) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
    prompts = _prompts([3, 50, 130, 290, 77, 20, 64, 9], seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 12, 33, 45)] + \
             [SamplingParams(temperature=0.8, max_tokens=30, seq_seed=s, ignore_eos=True) for s in (1, 2)] + \
             [SamplingParams(temperature=0.0, max_tokens=20, top_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]

    def run(eager: str):
        monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", eager)
        llm = _llm(path, monkeypatch, 8)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        llm.generate(prompt_token_ids=prompts[:3], sampling_params=params[:3], use_tqdm=False)  # all greedy: multi-step
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm.engine.runner.graphs

    eager, none = run("1")
    replayed, graphs = run("0")
    assert none is None
    assert replayed == eager
    assert graphs.stats["replayed"] > 50 and graphs.stats["eager"] == 0, graphs.stats


def test_calls_after_the_first_replay_all_their_steps_at_once(tiny_model_dir, monkeypatch):
    """Once a batch's multi-step bucket is compiled (recorded in the first call), each later call finds
    it and replays its k steps in one call of the tape, not k lookups of single steps."""
    path, _ = tiny_model_dir
    multi = _llm(path, monkeypatch, 8)
    graphs = multi.engine.runner.graphs
    if graphs is None:
        pytest.skip("steps are not captured on this build (no C++ replay)")
    single, run = [], graphs.run
    monkeypatch.setattr(graphs, "run", lambda key, *a, **kw: single.append(key[0]) or run(key, *a, **kw))
    calls = _count_calls(multi)
    multi.generate(prompt_token_ids=_prompts([20, 30], seed=6), use_tqdm=False,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True))
    assert len(calls) >= 4 and single.count("greedy decode") == calls[0], (calls, single)  # the first call's steps


def _record_yields(engine) -> list[tuple[int, int, list[int]]]:
    """Per multi-step call: (first position fed, steps asked, steps in each yield)."""
    calls, decode_steps = [], engine.runner.decode_steps

    def recorded(ids, slots, starts, steps, *a, **kw):
        calls.append((starts[0], steps, []))
        for tokens in decode_steps(ids, slots, starts, steps, *a, **kw):
            calls[-1][2].append(tokens.shape[0])
            yield tokens

    engine.runner.decode_steps = recorded
    return calls


@pytest.mark.parametrize("interval", [1, 3])
def test_a_stream_listener_gets_a_calls_tokens_as_its_steps_end(tiny_model_dir, monkeypatch, interval):
    """With a stream listener (a server's), a multi-step call hands its tokens out every
    stream_interval steps while it runs on: the listener is called between them and sees every
    running request `interval` tokens further each time; the outputs equal a listener-less run."""
    path, _ = tiny_model_dir
    prompts = _prompts([30, 70], seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (21, 40)]
    ref = _outputs(_llm(path, monkeypatch, 8), prompts, params)
    multi = _llm(path, monkeypatch, 8, stream_interval=interval)
    engine = multi.engine
    calls = _record_yields(engine)
    seen = []  # per listener call: (multi-step call, output lengths of the running requests)
    engine.stream_tokens(lambda: seen.append((len(calls), {r.request_id: len(r.output_token_ids)
                                                           for r in engine.scheduler.running if not r.is_finished})))
    assert _outputs(multi, prompts, params) == ref
    assert calls and max(steps for _, steps, _ in calls) == 8, calls
    for c, (_, steps, yields) in enumerate(calls, start=1):
        assert yields == [interval] * (steps // interval) + ([steps % interval] if steps % interval else []), calls
        within = [lengths for call, lengths in seen if call == c]
        assert len(within) == len(yields) - 1
        for before, after in zip(within, within[1:]):
            assert all(after[r] == before[r] + interval for r in after if r in before), (before, after)


def test_a_call_ends_at_the_step_where_its_last_request_stopped(tiny_model_dir, monkeypatch):
    """Handing out every step's tokens lets a call stop early: a request that stops at the third
    step of a call, alone in the batch, ends the call there (the remaining steps never run), with
    the tokens of a run without a listener."""
    path, _ = tiny_model_dir
    prompt = _prompts([40], seed=8)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    multi = _llm(path, monkeypatch, 8)
    engine = multi.engine
    engine.stream_tokens(lambda: None)
    calls = _record_yields(engine)
    free = multi.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0].outputs[0].token_ids
    # output index of each full call's third step: position fed - prompt length + 1 (the prefill made token 0)
    third = [start - len(prompt) + 1 + 2 for start, steps, _ in calls if steps == 8]
    stop_at = next(i for i in third if free[i] not in free[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[free[stop_at]], ignore_eos=True)
    calls.clear()
    got = multi.generate(prompt_token_ids=[prompt], sampling_params=stop, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == free[:stop_at + 1] and got.finish_reason == "stop"
    assert calls[-1][1] == 8 and calls[-1][2] == [1, 1, 1], calls
    listenerless = _llm(path, monkeypatch, 8)
    assert _outputs(listenerless, [prompt], stop)[0][0] == got.token_ids
    assert engine.cache.num_free_pages == engine.cache.num_pages and engine.cache.num_free_slots == engine.cache.max_seqs
