"""Step graphs (core/graphs.py, backends/cpu/replay.py): a decode step of any registered model
recorded once per shape bucket and replayed from C++ must give the eager graph's logits and leave
its cache state, bit for bit, on every later step of the bucket (fast and batch-invariant); a changed argument in a
recording must be caught by that comparison; what a replay could not repeat stays eager."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model_runner import build_model, new_cache
from tiny_models import CONFIGS, make_hf_model
from tiny_models_v3 import CONFIGS as V3_CONFIGS
from tiny_models_v3 import make_hf_model as make_hf_model_v3
from v41_goldens import CONFIGS as V41_CONFIGS, WIDE_CONFIG
import v41_models

from deepinfer.backends.base import Const, Instruction
from deepinfer.backends.cpu import kernels, replay
from deepinfer.core.graphs import StepGraphs, record, signature
from deepinfer.models.base import step_inputs
from deepinfer.models.base import StepInput
from deepinfer.models.deepseek_v41.step import StepMeta as V41StepMeta


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", "1")
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "1")  # no thread calibration: the same calls each time
    if not kernels.load() or replay.load() is None:
        pytest.skip("the cpu kernels or the replay could not be built here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (padding writes NaN into the trash page: NaN != NaN, equal bits are equal)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32) \
        if t.is_floating_point() else t


def _pools(cache) -> list[torch.Tensor]:
    return [pool.data for pool in cache.pools.values()]


def _schedule(lengths: list[int], seed: int, max_chunk: int) -> list[list[tuple[int, int]]]:
    """Sequences join at different steps and advance by prefill chunks or single decode tokens; once
    a sequence's prompt is fed it decodes, so runs of decode steps repeat their buckets."""
    rng = random.Random(seed)
    fed, join, steps, step_no = [0] * len(lengths), [rng.randint(0, 5) for _ in lengths], [], 0
    while any(f < n for f, n in zip(fed, lengths)):
        step = []
        for s, n in enumerate(lengths):
            if step_no >= join[s] and fed[s] < n:
                prefill = fed[s] < n // 2
                take = min(n - fed[s], rng.choice([1, 2, rng.randint(3, max_chunk)]) if prefill else 1)
                step.append((s, take))
                fed[s] += take
        rng.shuffle(step)
        if step:
            steps.append(step)
        step_no += 1
    return steps


def _same_step(step, inputs, fn, cache) -> tuple[bool, str]:
    """Run one step both ways from the same cache state: eagerly (fn) and replayed (step). -> whether
    the logits and every pool are equal bit for bit (and what differed). Leaves the eager state."""
    before = [t.clone() for t in _pools(cache)]
    replayed = step(inputs)[0]
    after_replay = [t.clone() for t in _pools(cache)]
    for pool, saved in zip(_pools(cache), before):
        pool.copy_(saved)
    with torch.inference_mode():
        eager = fn()
    if not torch.equal(_bits(replayed), _bits(eager)):
        return False, f"logits differ by {(replayed - eager).abs().max()}"
    for k, (pool, got) in enumerate(zip(_pools(cache), after_replay)):
        if not torch.equal(_bits(pool), _bits(got)):
            return False, f"pool {k} differs"
    return True, ""


def _run(model, cache, prompts, steps, on_replay=None, head=None):
    """Feed the schedule; every decode step (one token per sequence) is recorded the first time its
    bucket appears and compiled, and checked against the replay of that first recording every later
    time (on_replay(step, inputs, fn) may replace the check). `head(logits)`: what the step returns
    of its logits (default: the logits). -> number of steps checked."""
    slots = [cache.allocate_slot() for _ in prompts]
    fed, tapes, checked = [0] * len(prompts), {}, 0
    for step in steps:
        ids, starts, lens = [], [], []
        for seq, n in step:
            cache.grow(slots[seq], fed[seq] + n)
            ids.append(prompts[seq][fed[seq]:fed[seq] + n])
            starts.append(fed[seq])
            lens.append(n)
            fed[seq] += n
        inp = StepInput(torch.cat(ids), torch.tensor([slots[s] for s, _ in step]), torch.tensor(starts),
                        torch.tensor(lens))
        meta = model.prepare(inp, cache)
        rows = torch.cumsum(inp.lens, 0) - 1  # each sequence's last row, as the engine samples

        def fn(meta=meta, rows=rows, inp=inp):
            logits = model.forward(inp, cache, rows, meta)
            return logits if head is None else head(logits)

        if int(inp.lens.sum()) != len(step):
            fn()
            continue
        tensors, sizes = step_inputs(meta)
        inputs = tensors + [rows]
        key = (sizes,) + signature(inputs)
        if key in tapes:
            if on_replay is None:
                same, why = _same_step(tapes[key], inputs, fn, cache)
                assert same, why
            else:
                on_replay(tapes[key], inputs, fn)
            checked += 1
        else:
            recording, failure, _ = record(fn, inputs)
            assert recording is not None, failure
            tapes[key] = model.accel.compile_step(recording, None)
    for slot in slots:
        cache.release(slot)
    return checked, tapes


@pytest.mark.parametrize("name", sorted(CONFIGS) + [f"v3/{n}" for n in sorted(V3_CONFIGS)])
@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
def test_replayed_decode_steps_equal_the_eager_graph_bit_for_bit(name, invariant, monkeypatch):
    """Every registered family's test configs: the three V4 ones (every layer kind, hash and top-k
    MoE, hc_mult 2 and 4) and the three V3 ones (q LoRA or not, group-limited routing, YaRN both
    ways): six sequences of 40-330 tokens joining at different steps, prefilled in chunks of 1-48
    tokens while others decode; V4 crosses the window and finishes CSA and HCA windows while
    replayed, V3's attention width crosses its size buckets."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
    hf, cfg = make_hf_model_v3(name.removeprefix("v3/"), seed=7) if name.startswith("v3/") else \
        make_hf_model(name, seed=7)
    model = build_model(hf, cfg)
    g = torch.Generator().manual_seed(1)
    lengths = [330, 40, 97, 150, 260, 64]
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in lengths]
    checked, tapes = _run(model, new_cache(model), prompts, _schedule(lengths, 0, 48))
    assert checked > 60 and len(tapes) < checked / 3, (checked, len(tapes))  # buckets recur


def test_a_greedy_step_replays_its_lm_head_and_argmax_as_one_call(monkeypatch):
    """A step that ends in the greedy pick of its logits (the engine's multi-step decode) is
    compiled with the LM head and the argmax fused (linear_argmax: the logits never leave the cache),
    and its replays give the eager step's tokens and cache bit for bit. A vocabulary of 4,500 spans
    three of the fused kernel's blocks. A step that returns its logits keeps both calls."""
    model_hf, cfg = make_hf_model("csa_hc2", seed=7, vocab_size=4500)
    model = build_model(model_hf, cfg)
    g = torch.Generator().manual_seed(3)
    lengths = [120, 40, 77, 64]
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in lengths]
    checked, tapes = _run(model, new_cache(model), prompts, _schedule(lengths, 1, 24), head=model.accel.argmax)
    assert checked > 30
    for tape in tapes.values():
        names = tape.tape.op_names()
        assert "deepinfer_cpu::linear_argmax" in names and "deepinfer_cpu::argmax_rows" not in names, names
    _, tapes = _run(model, new_cache(model), prompts[:2], _schedule(lengths[:2], 1, 24))
    names = next(iter(tapes.values())).tape.op_names()
    assert "deepinfer_cpu::linear" in names and "deepinfer_cpu::linear_argmax" not in names


def test_only_the_kernel_accelerators_fuse_calls():
    """The bf16 rounding pair becomes bf16_round on the kernel accelerators (same bits) and stays two
    aten calls on the reference ops (DEEPINFER_CPU_KERNELS=0 keeps the C++ kernels out)."""
    from deepinfer.backends.cpu import CpuAccelerator, CpuKernelAccelerator

    x = torch.randn(3, 70)
    recording, failure, _ = record(lambda: x.to(torch.bfloat16).float() * 2, [x])
    assert recording is not None, failure
    for accel, fused in ((CpuKernelAccelerator(), True), (CpuAccelerator(), False)):
        tape = accel.compile_step(recording, None)
        assert ("deepinfer_cpu::bf16_round" in tape.tape.op_names()) == fused
        assert torch.equal(tape([x])[0], x.to(torch.bfloat16).float() * 2)


@pytest.mark.parametrize("name", V41_CONFIGS + (WIDE_CONFIG,))
@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
def test_replayed_v41_decode_steps_equal_the_eager_graph_bit_for_bit(name, invariant, monkeypatch):
    """DeepSeek-V4.1's golden configs (ced10: 10 layers, mini6: 6; both with Engram at two layers,
    ratio-2 and ratio-1 KV sources with their consumers, a candidate source and a Reindex layer, and
    the CED split): the same mixed schedule as above, with prefill chunks up to 60 tokens over a
    KEEP of 40, so the decoder layers of long chunks run on their tail only (those steps eagerly)
    while other sequences decode. Every decode step is recorded (no host read, no data-shaped op
    left in it), and its replays cross the window, finish ratio-2 pairs and not, and cross the
    candidate entries' size buckets. mini6wide (sequences up to its 128 positions): a Reindex layer
    whose tokens attend every entry they see, its top-k being wider than the candidate blocks."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "40")
    model = v41_models.build(name)
    g = torch.Generator().manual_seed(1)
    lengths = [min(n, model.config.max_position_embeddings) for n in (330, 40, 97, 150, 260, 64)]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g) for n in lengths]
    split, original = [], V41StepMeta.split_decoder

    def split_decoder(meta, *args):
        original(meta, *args)
        split.append(meta.decoder is not meta.encoder)

    monkeypatch.setattr(V41StepMeta, "split_decoder", split_decoder)
    checked, tapes = _run(model, v41_models.new_cache(model), prompts, _schedule(lengths, 0, 60))
    assert checked > 40 and len(tapes) < checked / 3, (checked, len(tapes))  # buckets recur (mini6wide: 52)
    assert any(split), "no prefill chunk ran the CED split"
    # the bf16 rounding points replay as one call each (replay.fuse_calls), checked bit for bit above
    assert all("deepinfer_cpu::bf16_round" in tape.tape.op_names() for tape in tapes.values())


def test_a_changed_argument_in_a_recording_is_caught(monkeypatch):
    """The mutation test: the same check fails once one argument of one recorded call is changed
    (an RMSNorm's eps), or one constant swapped (a layer's weight for another's)."""
    hf, cfg = make_hf_model("mixed_hc4_yarn", seed=7)
    model = build_model(hf, cfg)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in (40, 40)]
    steps = [[(0, 30), (1, 30)]] + [[(0, 1), (1, 1)]] * 10
    verdicts = {"exact": [], "eps": [], "weight": []}

    def mutated(recording, how):
        rec = copy.copy(recording)
        rec.instructions = list(recording.instructions)
        for k, ins in enumerate(rec.instructions):
            if how == "eps" and str(ins.op) == "deepinfer_cpu.rms_norm.default":
                rec.instructions[k] = Instruction(ins.op, (ins.args[0], ins.args[1], ins.args[2] * 2), ins.kwargs, ins.outs)
                return rec
            if how == "weight" and str(ins.op) == "deepinfer_cpu.linear.default" and k > 10:
                other = next(i for i, c in enumerate(rec.constants) if c.shape == rec.constants[ins.args[1].index].shape
                             and i != ins.args[1].index)
                rec.instructions[k] = Instruction(ins.op, (ins.args[0], Const(other)), ins.kwargs, ins.outs)
                return rec
        raise AssertionError(f"nothing to change for {how}")

    def check(step, inputs, fn):
        for how, verdict in verdicts.items():
            tape = step if how == "exact" else model.accel.compile_step(mutated(step.recording, how), None)
            verdict.append(_same_step(tape, inputs, fn, cache)[0])

    original = replay.compile_recording
    monkeypatch.setattr(replay, "compile_recording",
                        lambda rec, *a, **kw: _Kept(original(rec, *a, **kw), rec))  # keep each tape's recording for the mutation
    cache = new_cache(model)
    checked, _ = _run(model, cache, prompts, steps, on_replay=check)
    assert checked >= 5
    assert all(verdicts["exact"]) and not any(verdicts["eps"]) and not any(verdicts["weight"]), verdicts


class _Kept:
    """A compiled step with the recording it was compiled from."""

    def __init__(self, step, recording):
        self.step, self.recording = step, recording

    def __call__(self, inputs):
        return self.step(inputs)


def test_what_a_replay_could_not_repeat_is_not_recorded():
    x = torch.arange(6.0)
    assert record(lambda: x * x.sum().item(), [x])[1].startswith("item")  # a read into Python
    assert record(lambda: x[x > 2] * 2, [x])[0] is None  # a shape that depends on the data
    assert record(lambda: torch.tensor([1.0]) + x, [x])[1].startswith("tensor")  # data made in Python
    rec, failure, out = record(lambda: (x * 2)[1:], [x])
    assert failure is None and torch.equal(out, (x * 2)[1:])


def test_a_step_that_reads_host_data_stays_eager_after_two_different_recordings():
    """A forward reading a tensor made from numpy (not among the step's tensors) records a different
    constant each time: the two recordings differ and the bucket stays eager, with the right results."""
    graphs = StepGraphs(kernels_accel(), max_tokens=8)
    x = torch.ones(3)
    for step in range(5):
        hidden = torch.from_numpy(np.array([float(step)] * 3, dtype=np.float32))
        out = graphs.run(("k",), lambda: x + hidden, [x])
        assert torch.equal(out, x + step)
    bucket = next(iter(graphs.buckets.values()))
    assert bucket.step is None and "different operators" in bucket.eager and graphs.stats["replayed"] == 0


def test_views_of_the_cache_are_taken_once_and_writes_through_them_land():
    accel = kernels_accel()
    graphs = StepGraphs(accel, max_tokens=8)
    pool = torch.zeros(10, 4)

    def step(rows, values):
        pool[2:6].index_copy_(0, rows, values * 2)  # a view of the pool, written in place
        return pool[:].sum(0)  # a whole-tensor view: the pool itself

    for k in range(4):
        rows, values = torch.tensor([k % 4, (k + 1) % 4]), torch.full((2, 4), float(k))
        got = graphs.run(("w",), lambda: step(rows, values), [rows, values])
        assert torch.equal(got, pool.sum(0)) and pool[2 + k % 4, 0] == 2 * k
    assert graphs.stats == {"recorded": 2, "replayed": 2, "eager": 0, "compiled": 1, "failed": 0}
    ops = next(iter(graphs.buckets.values())).recording.ops()
    assert ops == ["aten.mul.Tensor", "aten.index_copy_.default", "aten.sum.dim_IntList"], ops


def test_recording_a_step_does_not_import_torch_dynamo():
    """A fresh process records a step without importing torch._dynamo: TorchDispatchMode would wrap the
    recorder in torch._dynamo.disable, whose first call imported it (1.5 s of a fresh engine's first
    generate, benchmarks/bucket_warmup.py)."""
    code = ("import sys, torch\n"
            "from deepinfer.core.graphs import record\n"
            "x = torch.ones(4, 8)\n"
            "rec, failure, _ = record(lambda: (x * 2).sum(dim=0), [x])\n"
            "assert failure is None and len(rec.instructions) == 2, (failure, rec)\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_enforce_eager_turns_capture_off(monkeypatch):
    accel = kernels_accel()
    assert StepGraphs.enabled(accel)
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    assert not StepGraphs.enabled(accel)


def test_a_call_keeps_more_threads_only_where_they_saved_time():
    step = replay.TapeStep(tape=None, options=[1, 2])  # one thread, or both cores
    assert step._choose([100e-6, 40e-6]) == 2  # saved 60%, 60 us
    assert step._choose([100e-6, 95e-6]) == 0  # 5%: noise
    assert step._choose([10e-6, 2e-6]) == 0  # a tiny call: 8 us is not worth a thread's wake-up
    assert step._choose([100e-6, -1.0]) == 0  # not timed at 2
    # calls faster on two threads that are a large share of the step put the whole tape on two (no
    # wake-up of the idle core per call); a small share keeps the choice call by call
    assert step._whole_tape([0, 2, 0, 0], [1.0, 3.0, 1.0, 1.0]) == [2, 2, 2, 2]
    assert step._whole_tape([0, 2, 0, 0], [10.0, 1.0, 10.0, 10.0]) == [0, 2, 0, 0]
    assert step._whole_tape([0, 0], [1.0, 1.0]) == [0, 0]


def test_threads_are_chosen_again_after_a_while(monkeypatch):
    """A choice made while other processes loaded the cores (no call faster on two threads) does not
    stay: after _RECHOOSE_EVERY replays, single or multi-step, the calls are timed again and the
    tape follows the new times."""
    monkeypatch.setattr(replay, "_RECHOOSE_EVERY", 10)

    class Tape:  # two calls, timed [one thread, two threads, the replay's share]
        def __init__(self):
            self.times, self.set, self.runs = [[1e-3, 1e-3, 1e-3], [1e-3, 1e-3, 1e-3]], [], 0

        def profile(self, inputs, options, repeats, min_seconds):
            return [inputs[0] + 1], self.times

        def set_threads(self, threads):
            self.set.append(list(threads))

        def run(self, inputs):
            self.runs += 1
            return [inputs[0] + 1]

        def run_steps(self, per_step, shared, first, steps, feedback, previous):
            self.runs += steps
            return [per_step[0][first:first + steps] + 1]

    tape = Tape()
    step = replay.TapeStep(tape, options=[1, 2])
    x = torch.zeros(1)
    step([x])
    assert tape.set == [[0, 0]]  # loaded: nothing faster on two
    tape.times = [[1e-3, 4e-4, 1e-3], [1e-3, 4e-4, 1e-3]]  # the load went away
    for _ in range(10):
        step([x])
    assert tape.set == [[0, 0]] and tape.runs == 10
    step([x])  # the 11th call chooses again
    assert tape.set == [[0, 0], [2, 2]]
    for _ in range(2):  # 16 replays of 8-step calls: the count runs out within the second
        out = step.run_steps([torch.zeros(8, 1)], [], 8, [])
        assert out[0].shape == (8, 1) and len(tape.set) == 2
    tape.times = [[1e-3, 1e-3, 1e-3], [1e-3, 1e-3, 1e-3]]
    step.run_steps([torch.zeros(8, 1)], [], 8, [])  # the next call's first step chooses
    assert tape.set[-1] == [0, 0] and len(tape.set) == 3
    fixed = replay.TapeStep(tape, options=[])  # DEEPINFER_CPU_THREADS set: nothing to choose from
    for _ in range(25):
        fixed([x])
    assert len(tape.set) == 3


def kernels_accel():
    from deepinfer.backends.cpu import make

    return make()


def _engine(tmp_path, accel):
    from deepinfer.core.engine import EngineConfig, LLMEngine

    path = tmp_path / "model"
    if not path.exists():
        make_hf_model("mixed_hc4_yarn", seed=3)[0].save_pretrained(path)
    return LLMEngine(str(path), accel, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, num_cache_pages=32))


def _greedy_tokens(engine, lengths: list[int]) -> list[list[int]]:
    from deepinfer import SamplingParams

    engine.multi_step = 1  # plain steps: what a GPU with overlapped scheduling runs
    g = torch.Generator().manual_seed(5)
    reqs = [engine.add_request(torch.randint(2, 512, (n,), generator=g).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for n, m in zip(lengths, (16, 5, 12, 8, 14))]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


def test_padded_decode_batches_and_static_buffers_give_the_unpadded_tokens(tmp_path, monkeypatch):
    """What the nvidia backend does, on cpu: decode batches padded to the captured sizes (the extra
    sequences at the trash slot) and each bucket run on static input buffers through the step's
    own graph (backends/nvidia/graphs.py with an eager stand-in for the CUDA graph). Batch-invariant
    ops, so a padded row must give exactly the unpadded row's tokens."""
    from deepinfer.backends.cpu import CpuInvariantKernelAccelerator
    from deepinfer.backends.nvidia.graphs import CapturedStep

    class StaticBuffers(CpuInvariantKernelAccelerator):
        pad_graph_batches = True

        def compile_step(self, recording, step_fn):
            return CapturedStep(recording, step_fn, self.device, capture=lambda fn: fn)

    monkeypatch.setenv("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", "4")
    lengths = [40, 70, 33, 90, 12]  # batches of 5, 4, 3, 2, 1 as the requests finish
    want = _greedy_tokens(_engine(tmp_path, CpuInvariantKernelAccelerator()), lengths)
    engine = _engine(tmp_path, StaticBuffers())
    assert [engine.runner.graphs.padded_batch(b) for b in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert _greedy_tokens(engine, lengths) == want
    graphs = engine.runner.graphs
    batches = {key[2][0][0] for key, b in graphs.buckets.items() if b.step is not None}  # the ids' length
    assert batches <= {1, 2, 4, 8} and graphs.stats["replayed"] > 5, (batches, graphs.stats)


# ---------------------------------------------------------------- a capture or replay that fails
class _FailsOnce:
    """An accelerator whose capture of the first bucket it compiles fails, the way it is passed to
    the engine: `how` = "compile" (compile_step raises) or "capture" (the CUDA-graph path's capture
    raises at the bucket's first replay; backends/nvidia/graphs.py with a stand-in for the graph)."""

    def __new__(cls, how: str):
        from deepinfer.backends.cpu import CpuInvariantKernelAccelerator
        from deepinfer.backends.nvidia.graphs import CapturedStep

        class FailsOnce(CpuInvariantKernelAccelerator):
            compiled = 0

            def compile_step(self, recording, step_fn):
                self.compiled += 1
                first = self.compiled == 1
                if how == "compile":
                    if first:
                        raise RuntimeError("injected: compile failed")
                    return super().compile_step(recording, step_fn)

                def capture(fn):
                    if first:
                        raise RuntimeError("injected: operation not permitted when stream is capturing")
                    return fn  # a stand-in graph: the step's own graph on the static buffers, every replay

                return CapturedStep(recording, step_fn, self.device, capture)

        return FailsOnce()


@pytest.mark.parametrize("how", ["compile", "capture"])
def test_a_bucket_whose_capture_fails_runs_eagerly_with_one_warning_and_the_engine_keeps_serving(
        tmp_path, monkeypatch, how):
    """Capture is on by default on nvidia, so a bucket whose capture fails must not take the engine
    down: its steps (the failing one too) run eagerly, one RuntimeWarning names it, the other buckets
    are still replayed, and later requests (which meet the failed bucket again) are served, all with
    the eager engine's tokens."""
    import warnings as warnings_module

    from deepinfer.backends.cpu import CpuInvariantKernelAccelerator
    from deepinfer.core.graphs import bucket_name

    lengths = [40, 70, 33, 90, 12]  # decode batches of 5, 4, 3, 2, 1 as the requests finish
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    eager = _engine(tmp_path, CpuInvariantKernelAccelerator())
    assert eager.runner.graphs is None
    want = [_greedy_tokens(eager, lengths), _greedy_tokens(eager, lengths)]
    monkeypatch.delenv("DEEPINFER_ENFORCE_EAGER")
    engine = _engine(tmp_path, _FailsOnce(how))
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        got = [_greedy_tokens(engine, lengths)]
        got.append(_greedy_tokens(engine, lengths))  # the failed bucket comes back: eager, no new warning
    graphs = engine.runner.graphs
    assert got == want
    assert len(graphs.failed) == 1, graphs.failed
    [failed] = graphs.failed
    ours = [w for w in caught if "step bucket" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning), [str(w.message) for w in ours]
    assert bucket_name(failed) in str(ours[0].message) and "injected" in str(ours[0].message)
    assert graphs.stats["eager"] > 1 and graphs.stats["replayed"] > 5, graphs.stats  # others still replayed


class _BadTape:
    """A cpu accelerator whose tapes have one constant swapped for a tensor of the wrong shape, so
    their replays raise at that call: before the step's pool write, or after it."""

    def __new__(cls, bad: torch.Tensor, swapped: torch.Tensor):
        base = type(kernels_accel())

        class BadTape(base):
            def compile_step(self, recording, step_fn):
                rec = copy.copy(recording)
                rec.constants = [bad if c is swapped else c for c in recording.constants]
                return super().compile_step(rec, step_fn)

        return BadTape()


@pytest.mark.parametrize("where", ["before the pool write", "after the pool write"])
def test_a_replay_that_fails_reruns_eagerly_only_when_it_had_written_nothing(where):
    """A replay that raised before any call that writes a pool leaves the state as it found it: the
    step runs eagerly instead, with the eager results and pool writes, and the bucket stays eager. One
    that raised after the write cannot be rerun (the eager step would start from half its writes):
    that is an error naming the bucket and DEEPINFER_ENFORCE_EAGER, not a silent wrong answer."""
    import warnings as warnings_module

    from deepinfer.core.graphs import bucket_name

    pool, scale, weight = torch.zeros(10, 4), torch.full((4,), 2.0), torch.arange(4.0)
    swapped = scale if where.startswith("before") else weight
    graphs = StepGraphs(_BadTape(torch.ones(3), swapped), max_tokens=8)

    def step(rows, values):
        pool.index_copy_(0, rows, values * scale)
        return pool.sum(0) * weight

    for k in range(2):  # recorded twice, compiled
        rows, values = torch.tensor([k, k + 1]), torch.full((2, 4), float(k + 1))
        graphs.run(("w",), lambda: step(rows, values), [rows, values])
    [bucket_key] = graphs.buckets
    rows, values = torch.tensor([5, 6]), torch.full((2, 4), 7.0)
    want_pool = pool.clone()
    want_pool[5:7] = 14.0
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        if where.startswith("before"):
            got = graphs.run(("w",), lambda: step(rows, values), [rows, values])
            assert torch.equal(pool, want_pool) and torch.equal(got, want_pool.sum(0) * weight)
            rows, values = torch.tensor([8, 9]), torch.full((2, 4), 1.0)
            graphs.run(("w",), lambda: step(rows, values), [rows, values])  # eager now: no replay, no warning
            assert torch.equal(pool[8:10], torch.full((2, 4), 2.0))
        else:
            with pytest.raises(RuntimeError, match="DEEPINFER_ENFORCE_EAGER") as raised:
                graphs.run(("w",), lambda: step(rows, values), [rows, values])
            assert bucket_name(bucket_key) in str(raised.value)
    assert [bucket_name(bucket_key) in str(w.message) for w in caught] == [True]
    assert graphs.stats["replayed"] == 0 and graphs.stats["failed"] == 1 and list(graphs.failed) == [bucket_key]


def test_a_recorder_error_leaves_the_eager_step_whole(monkeypatch):
    """A bug of the recorder's own (here: it raises on every multiplication it notes) must not break the
    eager step it watches: the step's result and writes are whole, one warning names the bucket, and
    the bucket runs eagerly, never recorded again."""
    import warnings as warnings_module

    from deepinfer.core import graphs as graphs_module

    original = graphs_module._Recorder._note

    def note(self, func, args, kwargs, out):
        if func is torch.ops.aten.mul.Tensor:
            raise KeyError("injected")
        return original(self, func, args, kwargs, out)

    monkeypatch.setattr(graphs_module._Recorder, "_note", note)
    graphs = StepGraphs(kernels_accel(), max_tokens=8)
    pool = torch.zeros(4)
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        for k in range(4):
            x = torch.full((4,), float(k))
            out = graphs.run(("r",), lambda: pool.add_(x * 2) + 1, [x])
            assert torch.equal(out, pool + 1)
    assert torch.equal(pool, torch.full((4,), 12.0))
    assert graphs.stats == {"recorded": 1, "replayed": 0, "eager": 3, "compiled": 0, "failed": 1}, graphs.stats
    assert len([w for w in caught if "step bucket" in str(w.message)]) == 1
