"""DSpark's drafting and verify steps recorded and replayed like decode steps (core/speculative/decoder.py
through core/graphs.py): every replayed drafter block (drafts and survival) and every replayed
verify forward (logits, every cache pool and the drafter's context rings) equals the same step run
eagerly from the same state, bit for bit; a changed argument in a recorded drafting step is caught
by that comparison; and the engine's tokens and draft statistics equal DEEPINFER_ENFORCE_EAGER=1's.
For both drafters: V4's (the shipped tiny-dsv4) and V4.1's three native stages (tiny-dsv41, whose
routed experts are one recorded host call, as the backbone's)."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.backends.base import Instruction
from deepinfer.backends.cpu import kernels, replay
from deepinfer.core import graphs as graphs_mod
from deepinfer.core.graphs import StepGraphs, signature
from deepinfer.llm import TINY_DSV4_DIR as SHIPPED, TINY_DSV41_DIR as SHIPPED_V41
MODELS = [pytest.param(SHIPPED, id="v4"), pytest.param(SHIPPED_V41, id="v41", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _setup(monkeypatch, tmp_path):
    if not kernels.load() or replay.load() is None:
        pytest.skip("the cpu kernels or the replay could not be built here")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")  # fixed lengths: the same drafts every run
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "1")  # no thread calibration: the same calls each time
    monkeypatch.setenv("DEEPINFER_DECODE_PERF_CACHE_DIR", str(tmp_path))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32) \
        if t.is_floating_point() else t


def _generate(llm) -> list[list[int]]:
    """Greedy requests of different lengths finishing at different steps, then a batch with seeded
    sampled requests among greedy ones (their drafter draws with the cpu sampler, which reads tensor
    data into Python: those drafting steps stay eager, their verify steps are replayed). Eight
    sequences: a drafting block then puts 8 x 5 tokens x top-2 = 80 rows on tiny-dsv41's 4 stage
    experts, past what the experts kernel took in one call before it took every size."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 8000, (n,), generator=g).tolist() for n in (5, 40, 17, 90, 33, 8, 21, 12)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 24, 36, 30, 40, 28, 34, 38)]
    mixed = greedy[:6] + [SamplingParams(temperature=0.8, max_tokens=24, seq_seed=s, ignore_eos=True) for s in (1, 2)]
    return [o.outputs[0].token_ids for params in (greedy, mixed)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def _checking_graphs(monkeypatch, engine_ref: list, verdicts: dict):
    """StepGraphs.run that, for every drafting / verify step it replays, also runs the step eagerly
    from the state before the replay and records whether outputs and state are equal bit for bit."""
    original = StepGraphs.run

    def state():
        engine = engine_ref[0]
        return [p.data for p in engine.cache.pools.values()] + list(engine.spec.drafter.kv)

    def run(self, key, fn, inputs, step_fn=None):
        bucket = self.buckets.get(key + signature(inputs))
        if key[0] not in ("draft", "verify") or bucket is None or bucket.step is None:
            return original(self, key, fn, inputs, step_fn)
        before = [t.clone() for t in state()]
        replayed = graphs_mod._flatten(original(self, key, fn, inputs, step_fn))
        replayed = [t.clone() for t in replayed]
        after = [t.clone() for t in state()]
        for t, saved in zip(state(), before):
            t.copy_(saved)
        with torch.inference_mode():
            result = fn()
        same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(replayed, graphs_mod._flatten(result))) and \
            all(torch.equal(_bits(a), _bits(b)) for a, b in zip(after, state()))
        verdicts.setdefault(key[0], []).append(same)
        return result

    monkeypatch.setattr(StepGraphs, "run", run)


@pytest.mark.parametrize("model", MODELS)
def test_replayed_drafting_and_verify_steps_equal_eager_steps_and_the_eager_engine(monkeypatch, model):
    """A shipped model drafting 3 tokens (_generate's two batches): every replayed step checked
    against its eager run, and the whole run against DEEPINFER_ENFORCE_EAGER=1 (tokens, and draft
    tokens verified / accepted); no drafting or verify bucket runs eagerly but those of sampled
    drafting steps (so the replayed drafting steps checked are the greedy ones)."""
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    llm = LLM(model, max_num_seqs=8)
    eager, eager_stats = _generate(llm), dict(llm.engine.spec.stats)
    assert llm.engine.runner.graphs is None
    del llm

    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "0")
    verdicts, engine = {}, []
    _checking_graphs(monkeypatch, engine, verdicts)
    llm = LLM(model, max_num_seqs=8)
    engine.append(llm.engine)
    assert _generate(llm) == eager
    assert llm.engine.spec.stats == eager_stats and eager_stats["verified"] > 20, eager_stats
    assert len(verdicts.get("draft", [])) >= 5 and len(verdicts.get("verify", [])) >= 5, \
        {k: len(v) for k, v in verdicts.items()}
    assert all(verdicts["draft"]) and all(verdicts["verify"]), verdicts
    eager_buckets = {b.eager for k, b in llm.engine.runner.graphs.buckets.items() if k[0] in ("draft", "verify") and b.eager}
    assert eager_buckets <= {"__bool__: the step reads tensor data into Python"}, eager_buckets


@pytest.mark.parametrize("model", MODELS)
def test_a_changed_argument_in_a_recorded_drafting_step_is_caught(monkeypatch, model):
    """The mutation test: the check above fails once one argument of one recorded call is changed
    (the first RMSNorm's eps, made 1: from 1e-6 on V4, 1e-20 on V4.1)."""
    original = replay.compile_recording

    def mutated(recording, *rest, **options):
        rec = copy.copy(recording)
        rec.instructions = list(recording.instructions)
        for k, ins in enumerate(rec.instructions):
            eps = [j for j, a in enumerate(ins.args) if isinstance(a, float)]
            if "rms_norm" in str(ins.op) and eps:
                args = tuple(1.0 if j == eps[0] else a for j, a in enumerate(ins.args))
                rec.instructions[k] = Instruction(ins.op, args, ins.kwargs, ins.outs)
                return original(rec, *rest, **options)
        raise AssertionError("no RMSNorm with an eps in the recording")

    monkeypatch.setattr(replay, "compile_recording", mutated)
    verdicts, engine = {}, []
    _checking_graphs(monkeypatch, engine, verdicts)
    llm = LLM(model, max_num_seqs=8)
    engine.append(llm.engine)
    _generate(llm)
    caught = {k: v.count(False) / len(v) for k, v in verdicts.items()}
    assert len(verdicts.get("draft", [])) >= 5 and caught["draft"] > 0.75 and caught["verify"] > 0.75, caught
