"""The cpu step program (backends/cpu/step_program.py) against the model's Python graph.

The program replays the graph's kernels from C++; it must give the same logits and leave the
same cache state, bit for bit, on every step it takes, and hand every other step to the graph."""

from __future__ import annotations

import random

import pytest
import torch

from model_runner import build_model, new_cache, run_schedule
from tiny_models import CONFIGS, make_hf_model

from deepinfer.backends.cpu import kernels
from deepinfer.core.cache import StateCache
from deepinfer.models.deepseek_v4.step import StepMeta


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", "1")
    monkeypatch.delenv("DEEPINFER_CPU_STEP_PROGRAM", raising=False)
    if not kernels.load():
        pytest.skip("the cpu kernels could not be built here")


def _pools(cache) -> list[torch.Tensor]:
    return [pool.data for pool in cache.pools.values()]


def _schedule(lengths: list[int], seed: int, max_chunk: int) -> list[list[tuple[int, int]]]:
    """Sequences join at different steps and advance by prefill chunks or single decode tokens."""
    rng = random.Random(seed)
    fed, join, steps, step_no = [0] * len(lengths), [rng.randint(0, 5) for _ in lengths], [], 0
    while any(f < n for f, n in zip(fed, lengths)):
        step = []
        for s, n in enumerate(lengths):
            if step_no >= join[s] and fed[s] < n:
                take = min(n - fed[s], rng.choice([1, 1, 1, 2, rng.randint(3, max_chunk)]))
                step.append((s, take))
                fed[s] += take
        rng.shuffle(step)
        if step:
            steps.append(step)
        step_no += 1
    return steps


def _same_meta(a: StepMeta, b: StepMeta) -> None:
    """Every index array and table row of two plans of one step, equal (values, dtypes, shapes)."""
    def same(x, y, what):
        x, y = (torch.as_tensor(v) for v in (x, y))
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), what

    for name in ("seq", "positions", "window_rows"):
        same(getattr(a, name), getattr(b, name), name)
    for k in range(2):
        same(a.window_commit[k], b.window_commit[k], "window_commit")
    for kind in ("main", "compress"):
        for k in range(2):
            same(a.rope[kind][k], b.rope[kind][k], f"rope {kind}")
    assert a._by_rate.keys() == b._by_rate.keys()
    for key, info in a._by_rate.items():
        other = b._by_rate[key]
        assert info.keys() == other.keys(), key
        for name, value in info.items():
            for x, y in zip(*((v,) if torch.is_tensor(v) else v for v in (value, other[name]))):
                same(x, y, f"{key} {name}")


def _check_every_step_against_the_graph(model):
    """Wrap model.forward: every step the program takes also runs through the graph from the same
    cache state, and logits and pools must be equal; so must the program's plan of the step and
    StepMeta's numpy plan. Returns counts of (program, graph) steps."""
    counts = {"program": 0, "graph": 0}
    forward = model.forward

    def both(inp, cache, logit_rows, meta=None, **kw):
        program = model.step_program(cache)
        assert program is not None
        view = model.view(cache)
        numpy_meta = StepMeta(inp, view, model.config)  # the definition
        planned = []
        meta = StepMeta(inp, view, model.config, planner=lambda m: planned.append(program.plan(m)) or planned[-1])
        assert planned == [True]
        _same_meta(meta, numpy_meta)
        if kw or not program.runs(meta):
            counts["graph"] += 1
            return forward(inp, cache, logit_rows, meta, **kw)
        before = [t.clone() for t in _pools(cache)]
        with torch.inference_mode():
            logits = program(meta, logit_rows)
        after = [t.clone() for t in _pools(cache)]
        for pool, saved in zip(_pools(cache), before):
            pool.copy_(saved)
        expected = model.forward_graph(meta, logit_rows)
        assert torch.equal(logits, expected), (logits - expected).abs().max()
        for pool, got in zip(_pools(cache), after):
            assert torch.equal(pool, got), "the program left a different cache state"
        counts["program"] += 1
        return logits

    model.forward = both
    return counts


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
def test_program_steps_equal_the_graph_bit_for_bit(name, invariant, monkeypatch):
    """All three test configs (every layer kind, hash and top-k MoE, hc_mult 2 and 4): six
    sequences of 40-330 tokens joining at different steps, fed in chunks of 1-48 tokens, so
    steps mix prefill chunks and decode tokens, cross the window and finish CSA and HCA windows."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
    hf, cfg = make_hf_model(name, seed=7)
    model = build_model(hf, cfg)
    counts = _check_every_step_against_the_graph(model)
    g = torch.Generator().manual_seed(1)
    lengths = [330, 40, 97, 150, 260, 64]
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in lengths]
    cache = new_cache(model)
    logits = run_schedule(model, cache, prompts, _schedule(lengths, 0, 48))
    program = model.step_program(cache)
    assert counts["program"] > 20, counts
    assert program.max_tokens >= 32
    # and the logits are the model's: the same prompts through the graph alone, in one step each
    monkeypatch.setenv("DEEPINFER_CPU_STEP_PROGRAM", "0")
    graph_only = build_model(hf, cfg)
    assert graph_only.step_program(new_cache(graph_only)) is None
    for prompt, got in zip(prompts, logits):
        alone = run_schedule(graph_only, new_cache(graph_only), [prompt], [[(0, len(prompt))]])[0]
        torch.testing.assert_close(got, alone, rtol=2e-4, atol=2e-4)


def test_steps_the_program_does_not_take_run_the_graph(monkeypatch):
    hf, cfg = make_hf_model("mixed_hc4_yarn", seed=7)
    model = build_model(hf, cfg)
    cache = new_cache(model)
    program = model.step_program(cache)
    calls = []
    graph = model.forward_graph
    monkeypatch.setattr(model, "forward_graph", lambda *a, **k: calls.append(1) or graph(*a, **k))
    prompt = torch.randint(2, cfg.vocab_size, (program.max_tokens + 1,), generator=torch.Generator().manual_seed(0))
    run_schedule(model, cache, [prompt], [[(0, program.max_tokens + 1)]])  # more tokens than the kernels take
    assert len(calls) == 1
    run_schedule(model, cache, [prompt], [[(0, program.max_tokens)], [(0, 1)]])
    assert len(calls) == 1
    # an op replaced after the program was built (a profiler, a test double) is honoured
    linear = model.accel.linear
    seen = []
    monkeypatch.setattr(model.accel, "linear", lambda x, w: seen.append(1) or linear(x, w))
    run_schedule(model, cache, [prompt[:10]], [[(0, 10)]])
    assert len(calls) == 2 and seen


def test_program_is_off_where_it_does_not_apply(monkeypatch):
    hf, cfg = make_hf_model("csa_hc2", seed=7)
    monkeypatch.setenv("DEEPINFER_CPU_STEP_PROGRAM", "0")
    model = build_model(hf, cfg)
    assert model.step_program(new_cache(model)) is None
    monkeypatch.setenv("DEEPINFER_CPU_STEP_PROGRAM", "1")
    model = build_model(hf, cfg)
    assert model.step_program(new_cache(model)) is not None
    bf16_cache = StateCache(model.cache_spec(0), max_seqs=2, num_pages=8, max_step_tokens=64, max_model_len=256,
                            dtype=torch.bfloat16)
    assert model.step_program(bf16_cache) is None  # the kernels take float32 pools only
    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", "0")
    model = build_model(hf, cfg)
    assert model.step_program(new_cache(model)) is None
