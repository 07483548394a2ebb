"""Where a decode step's time goes: every accelerator op call timed inside real engine steps,
against the whole step, on a steady batch of decoding requests (the 4-layer test model by default).
The rest of the step is Python: scheduling, step planning (StepMeta), the graph's glue between op
calls, sampling bookkeeping and post-processing. A composite op that calls other ops is timed once,
as the outermost call. Timing the ops replaces them, so the model runs its Python graph op by op;
the same steps are first timed as the engine runs them by default on the cpu (the step program:
one C++ call per step, and several greedy decode steps per call with DEEPINFER_MULTI_STEP_DECODE;
a model the accelerator has no step program for, such as DeepSeek-V3, runs its Python graph).
Prints a table and writes JSON.

    python benchmarks/step_profile.py [--model DIR | --tiny-config mixed_hc4_yarn [--vocab deepseek]] [--batch 32]
    DEEPINFER_CPU_THREADS=2 python benchmarks/step_profile.py --tiny-config v3/bench --batch 1   # issue 20's V3

The LM head (the `linear` call on lm_head.weight) is reported as its own row, `linear (LM head)`:
with a real 129,280-token vocabulary it is a large share of a small model's step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

OPS = ("linear", "grouped_linear", "fp8_block_linear", "embedding", "rms_norm", "rope", "swiglu", "hc_pre", "hc_post",
       "hc_head", "compress_windows", "indexer_topk", "sparse_attention", "route_topk", "route_grouped_topk",
       "route_hash", "moe_experts", "swiglu_mlp", "sample", "apply_token_bitmask")


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
        setattr(accel, name, timer(getattr(accel, name), name))
    kernel = accel.kernel  # a model's fused sequences (e.g. hc_pre_norm), timed under their own names

    def timed_kernel(name):
        found = kernel(name)
        return None if found is None else timer(found, name)

    accel.kernel = timed_kernel
    return seconds, calls


def profile(model: str, batch: int, prompt_len: int, steps: int) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 40, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)
    default, engine.multi_step = engine.multi_step, 1
    for _ in range(10):  # the prefill and a few decode steps
        engine.step()

    def ms_per_decode_step(n: int, multi_step: int) -> float:
        engine.multi_step, start, done = multi_step, time.perf_counter(), 0
        while done < n:
            engine.step()
            done += engine.last_step.decode_tokens // batch
        return (time.perf_counter() - start) / done * 1e3

    if engine.model.step_program(engine.cache) is None:  # a model the accelerator has no program for (V3)
        as_run = {"Python graph (no step program)": ms_per_decode_step(steps, 1)}
    else:
        as_run = {"step program, one step per call": ms_per_decode_step(steps, 1),
                  f"step program, up to {default} steps per call": ms_per_decode_step(steps, default)}
    engine.multi_step = default
    seconds, calls = timed_ops(llm.accel, engine.model.w["lm_head.weight"])
    engine.timeline.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    ops = {name: dict(ms=seconds[name] / steps * 1e3, calls=calls[name] / steps) for name in seconds}
    phases = {k: v / steps * 1e3 for k, v in engine.timeline.items()}
    engine.close()
    return dict(batch=batch, prompt_len=prompt_len, steps=steps, step_ms=step_ms, ops=ops, phases_ms=phases,
                as_run_ms=as_run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sys.path.insert(0, os.path.dirname(__file__))
    from throughput import _model_dir, add_model_args, model_label  # the test config's model, saved to a temp dir

    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = _model_dir(args)
    out = profile(model, args.batch, args.prompt_len, args.steps)
    in_ops = sum(v["ms"] for v in out["ops"].values())
    calls = sum(v["calls"] for v in out["ops"].values())
    print(f"{model_label(args)}: batch {args.batch} decoding, "
          f"{args.prompt_len}-token prompts, {args.steps} steps, {torch.get_num_threads()} thread(s)")
    print("| the same decode steps, as the engine runs them | ms/step |")
    print("|---|---|")
    for name, ms in out["as_run_ms"].items():
        print(f"| {name} | {ms:.3f} |")
    print(f"| Python graph, op by op (profiled below) | {out['step_ms']:.3f} |")
    print()
    print("| op | ms/step | calls/step |")
    print("|---|---|---|")
    for name, v in sorted(out["ops"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"| {name} | {v['ms']:.3f} | {v['calls']:.1f} |")
    print(f"| all op calls | {in_ops:.3f} | {calls:.1f} |")
    print(f"| rest of the step (Python) | {out['step_ms'] - in_ops:.3f} | |")
    print(f"| whole step | {out['step_ms']:.3f} | |")
    print("phases (ms/step): " + ", ".join(f"{k} {v:.3f}" for k, v in out["phases_ms"].items()))
    out["model"] = model_label(args)
    out.update(threads=torch.get_num_threads(), load_average=os.getloadavg())
    head_ms = out["ops"].get("linear (LM head)", {"ms": 0.0})["ms"]
    as_run = next(iter(out["as_run_ms"].values()))  # one step per call, as the engine runs it
    out["lm_head_ms"] = head_ms
    out["lm_head_share"] = {"op-by-op step": head_ms / out["step_ms"], "step as run": head_ms / as_run}
    print(f"LM head: {head_ms:.3f} ms = {100 * head_ms / out['step_ms']:.0f}% of the op-by-op step, "
          f"{100 * head_ms / as_run:.0f}% of the step as run (one step per call)")
    name = "model" if args.model else \
        f"{args.tiny_config.replace('/', '_')}_batch{args.batch}" if args.tiny_config.startswith("v3/") else \
        "tiny_test" if args.vocab == "test" else "tiny_test_deepseek_vocab"
    path = args.json or f"benchmarks/results/step_profile_{name}.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
