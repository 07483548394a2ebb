"""Where a decode step's time goes: Python against compiled code, on a steady batch of decoding
requests (the 4-layer test model by default).

First the decode steps as the engine runs them by default on the cpu (a replayed step graph,
core/graphs.py: one C++ call per step, and several greedy decode steps per call with
DEEPINFER_MULTI_STEP_DECODE), with the time spent inside those C++ calls; the rest of the step is
outside them: Python (scheduling, planning, feeding the replay, post-processing) and, one step per
call, the sampler (its argmax is inside the multi-step call). Then the same steps op by op
(the model's Python graph, steps not captured), every accelerator op call timed: the rest of that
step is Python too (the graph's glue between op calls, op wrappers). A composite op that calls
other ops is timed once, as the outermost call. Prints tables and writes JSON.

    python benchmarks/step_profile.py [--model DIR | --tiny-config mixed_hc4_yarn [--vocab deepseek]] [--batch 32]
    python benchmarks/step_profile.py --baseline 42e561a   # + the same profile of that build, same run
    python benchmarks/step_profile.py --baseline 42e561a,main   # + both builds, alternating with this one
    python benchmarks/step_profile.py --tiny-config v3/bench --batch 1   # issue 20's DeepSeek-V3 model

--baseline REF[,REF...] profiles deepinfer as built at git refs as well (benchmarks/baseline.py), e.g. the
build before step graphs, whose fast path was a hand-written C++ copy of the V4 step (the "step
program"): its C++ calls are timed the same way.

The LM head (the `linear` call on lm_head.weight, DeepSeek-V4.1's head.weight) is reported as its own row,
`linear (LM head)`: with a real 129,280-token vocabulary it is a large share of a small model's step. The step's weight
GEMMs (GEMM_OPS, timed as op calls) are what a decode step cannot avoid; the step as run is
reported as a multiple of their time (`step_over_gemms`).

    DEEPINFER_CPU_THREADS=2 python benchmarks/step_profile.py --vocab deepseek --batch 16
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import time

import torch

OPS = ("linear", "grouped_linear", "embedding", "rms_norm", "rope", "swiglu", "hc_pre", "hc_post",
       "hc_head", "compress_windows", "indexer_topk", "sparse_attention", "route_topk", "route_grouped_topk",
       "route_hash", "moe_experts", "swiglu_mlp", "sample", "apply_token_bitmask",
       # DeepSeek-V4.1's own
       "hc_mixes", "hc_collapse", "fp8_qdq", "fp4_qdq", "sparse_attention_bf16", "dense_attention",
       "indexer_scores", "moe_experts_bf16")
GEMM_OPS = ("linear (LM head)", "linear", "grouped_linear", "moe_experts", "swiglu_mlp",
            "moe_experts_bf16")


def timed_ops(accel, lm_head: torch.Tensor) -> tuple[collections.Counter, collections.Counter]:
    """Wrap the accelerator's ops (on the instance) with timers; returns (seconds, calls) per op, the
    LM head's linear counted apart."""
    seconds, calls, depth = collections.Counter(), collections.Counter(), [0]

    def timer(op, name):
        def timed(*args, **kwargs):
            label = "linear (LM head)" if name == "linear" and args[1] is lm_head else name
            depth[0] += 1
            start = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # a composite's inner calls are part of its own time
                    seconds[label] += time.perf_counter() - start
                    calls[label] += 1
        return timed

    for name in OPS:
        if hasattr(accel, name):  # an older build (--baseline) may lack an op
            setattr(accel, name, timer(getattr(accel, name), name))
    kernel = accel.kernel  # a model's fused sequences (e.g. hc_pre_norm), timed under their own names

    def timed_kernel(name):
        found = kernel(name)
        return None if found is None else timer(found, name)

    accel.kernel = timed_kernel
    return seconds, calls


def _native_calls() -> tuple[list[float], callable]:
    """Time every call into the build's compiled step (seconds accumulated in the returned list):
    the replayed tape's calls on this build, the step program's on the build before step graphs.
    -> (the counter, a function that removes the timers)."""
    total, depth, undo = [0.0], [0], []

    def wrap(cls, name):
        original = getattr(cls, name)

        def timed(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # a call made from another timed call counts once
                    total[0] += time.perf_counter() - start

        setattr(cls, name, timed)
        undo.append(lambda: setattr(cls, name, original))

    try:
        from deepinfer.backends.cpu.replay import TapeStep
        for name in ("__call__", "run_steps"):
            wrap(TapeStep, name)
    except ImportError:  # the build before step graphs
        from deepinfer.backends.cpu.step_program import StepProgram
        for name in ("__call__", "decode", "plan"):
            wrap(StepProgram, name)
    return total, lambda: [u() for u in undo]


def profile(model: str, batch: int, prompt_len: int, steps: int) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6 * steps + 40, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)
    default, engine.multi_step = engine.multi_step, 1
    for _ in range(10):  # the prefill and a few decode steps (a step graph is recorded twice, then replayed)
        engine.step()
    native, untime = _native_calls()

    def decode_steps(n: int, multi_step: int) -> dict:
        engine.multi_step, done = multi_step, 0
        graphs = getattr(getattr(engine, "runner", engine), "graphs", None)  # builds before issue 37: the engine's
        # calls of this kind, not timed, until one records nothing (a bucket is recorded on its first
        # two steps, and its first replay chooses its threads)
        for _ in range(4):
            recorded = graphs.stats["recorded"] if graphs is not None else 0
            engine.step()
            if graphs is None or graphs.stats["recorded"] == recorded:
                break
        recorded = graphs.stats["recorded"] if graphs is not None else 0
        native[0], start = 0.0, time.perf_counter()
        while done < n:
            engine.step()
            done += engine.last_step.decode_tokens // batch
        ms = (time.perf_counter() - start) / done * 1e3
        c_ms = native[0] / done * 1e3
        # steps recorded (run eagerly under the recorder) when a new shape bucket came up in the window
        recorded = graphs.stats["recorded"] - recorded if graphs is not None else None
        return dict(ms=ms, compiled_ms=c_ms, python_ms=ms - c_ms, steps=done, recorded_steps=recorded)

    as_run = {"one step per call": decode_steps(steps, 1),
              f"up to {default} steps per call": decode_steps(steps, default)}
    untime()
    engine.multi_step = 1
    if getattr(getattr(engine, "runner", engine), "graphs", None) is not None:
        getattr(engine, "runner", engine).graphs = None  # op by op: the model's Python graph (the build before: replaced ops turn its program off)
    w = engine.model.w
    seconds, calls = timed_ops(llm.accel, w["lm_head.weight"] if "lm_head.weight" in w else w["head.weight"])  # V4.1: head
    engine.timeline.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    ops = {name: dict(ms=seconds[name] / steps * 1e3, calls=calls[name] / steps) for name in seconds}
    phases = {k: v / steps * 1e3 for k, v in engine.timeline.items()}
    engine.close()
    return dict(batch=batch, prompt_len=prompt_len, steps=steps, step_ms=step_ms, ops=ops, phases_ms=phases,
                as_run_ms=as_run, compiled_step="step graph (replayed tape)" if hasattr(engine, "graphs")
                else "step program (hand-written C++ V4 step)")


def _median(outs: list[dict]) -> dict:
    """One profile whose every number is the median of that number over `outs` (same structure)."""
    first = outs[0]
    if isinstance(first, dict):
        return {k: _median([o[k] for o in outs]) if k in outs[-1] and all(k in o for o in outs) else v
                for k, v in first.items()}
    if isinstance(first, int) and not isinstance(first, bool):
        return int(statistics.median_low(outs))
    if isinstance(first, float):
        return statistics.median(outs)
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sys.path.insert(0, os.path.dirname(__file__))
    from throughput import _model_dir, add_model_args, model_label  # the test config's model, saved to a temp dir

    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", default=None)
    parser.add_argument("--baseline", default=None, metavar="REF[,REF...]",
                        help="also profile deepinfer as built at these git refs (e.g. 42e561a,main), same run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="profiles per build, the builds alternating; each figure is the median")
    args = parser.parse_args()
    model = os.path.abspath(_model_dir(args))
    load = os.getloadavg()
    runs = {"this build": lambda: profile(model, args.batch, args.prompt_len, args.steps)}
    if args.baseline:
        from baseline import call, describe

        for ref in args.baseline.split(","):
            runs[f"deepinfer @ {describe(ref)}"] = functools.partial(call, ref, "step_profile", "profile", model,
                                                                     args.batch, args.prompt_len, args.steps)
    repeats = {name: [] for name in runs}
    for _ in range(args.repeats):  # the builds alternate: load from other work hits both alike
        for name, run in runs.items():
            repeats[name].append(run())
    builds = {name: _median(outs) for name, outs in repeats.items()}
    print(f"{model_label(args)}: batch {args.batch} decoding, {args.prompt_len}-token prompts, {args.steps} steps, "
          f"{torch.get_num_threads()} thread(s); load average before {load[0]:.2f}")
    print("| build | the same decode steps | ms/step | in compiled calls (ms) | outside them (ms) | share outside |")
    print("|---|---|---|---|---|---|")
    for build, out in builds.items():
        for name, m in out["as_run_ms"].items():
            recorded = "" if m.get("recorded_steps") is None else f" ({m['recorded_steps']} of {m['steps']} recorded)"
            print(f"| {build} | {out['compiled_step']}, {name}{recorded} | {m['ms']:.3f} | {m['compiled_ms']:.3f} | "
                  f"{m['python_ms']:.3f} | {100 * m['python_ms'] / m['ms']:.0f}% |")
        in_ops = sum(v["ms"] for v in out["ops"].values())
        out["op_calls_ms"] = in_ops
        print(f"| {build} | Python graph, op by op | {out['step_ms']:.3f} | {in_ops:.3f} (op calls) | "
              f"{out['step_ms'] - in_ops:.3f} | {100 * (out['step_ms'] - in_ops) / out['step_ms']:.0f}% |")
    out = builds["this build"]
    print()
    print("This build, op by op:")
    print("| op | ms/step | calls/step |")
    print("|---|---|---|")
    for name, v in sorted(out["ops"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"| {name} | {v['ms']:.3f} | {v['calls']:.1f} |")
    calls = sum(v["calls"] for v in out["ops"].values())
    print(f"| all op calls | {out['op_calls_ms']:.3f} | {calls:.1f} |")
    print(f"| rest of the step (Python) | {out['step_ms'] - out['op_calls_ms']:.3f} | |")
    print(f"| whole step | {out['step_ms']:.3f} | |")
    print("phases (ms/step): " + ", ".join(f"{k} {v:.3f}" for k, v in out["phases_ms"].items()))
    out["threads"] = torch.get_num_threads()
    head_ms = out["ops"].get("linear (LM head)", {"ms": 0.0})["ms"]
    as_run = out["as_run_ms"]["one step per call"]["ms"]
    out["lm_head_ms"] = head_ms
    out["lm_head_share"] = {"op-by-op step": head_ms / out["step_ms"], "step as run": head_ms / as_run}
    print(f"LM head: {head_ms:.3f} ms = {100 * head_ms / out['step_ms']:.0f}% of the op-by-op step, "
          f"{100 * head_ms / as_run:.0f}% of the step as run (one step per call)")
    # the step's weight GEMMs timed as op calls (the LM head, projections, experts with their fused
    # activation): the work a decode step cannot avoid; the step as run (its faster mode) against it
    gemm_ms = sum(out["ops"][n]["ms"] for n in GEMM_OPS if n in out["ops"])
    best = min(m["ms"] for m in out["as_run_ms"].values())
    out["gemm_ms"], out["step_over_gemms"] = gemm_ms, best / gemm_ms if gemm_ms else None
    if gemm_ms:
        print(f"weight GEMMs ({', '.join(n for n in GEMM_OPS if n in out['ops'])}): {gemm_ms:.3f} ms/step; "
              f"the step as run: {best:.3f} ms = {best / gemm_ms:.2f}x of them")
    name = "model" if args.model else \
        f"{args.tiny_config.replace('/', '_')}_batch{args.batch}" if args.tiny_config.startswith("v3/") else \
        "tiny_test" if args.vocab == "test" else "tiny_test_deepseek_vocab"
    path = args.json or f"benchmarks/results/step_profile_{name}.json"
    with open(path, "w") as f:
        json.dump(dict(model=model_label(args), batch=args.batch, prompt_len=args.prompt_len, steps=args.steps,
                       repeats=args.repeats, load_average=load, load_average_after=os.getloadavg(), builds=builds), f,
                  indent=1)


if __name__ == "__main__":
    main()
