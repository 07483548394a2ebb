#!/usr/bin/env python
"""How often greedy continuations of the trained tiny DeepSeek-V4.1 change with the *schedule* alone,
in deepinfer and in DeepSeek's reference code: the yardstick for issue 23's greedy criterion.

    PYTHONPATH=. python tools/v41_greedy_noise.py

Same prompts and length as tools/v41_trained_vs_reference.py (60 held-out prompts, bos + 48 tokens,
32 greedy tokens, eos ignored). Schedules, each of which computes the same function in exact
arithmetic:
- deepinfer: all prompts as one batch (the default fast GEMMs), the same with
  DEEPINFER_BATCH_INVARIANT=1, and one prompt per `generate` call;
- reference: one prompt at a time (prefill, then one token per step, as its generate.py),
  20 prompts per batch, one prefill of the prompt plus its own continuation (teacher forced:
  the argmax at every generated position), and one prompt at a time computing in float32 (the
  goldens tool's "fp32" probe: the same FP8/FP4 quantization points, fp32 between them).
A pair of schedules agrees on a prompt when all 32 tokens are equal. The reference computes in bf16
with FP8 activation quantization; its GEMMs' summation order changes with the batch and the
schedule, so near-tied tokens flip between its own runs, and so do near-tied expert choices, which
move a token's log-probs by more than a nat (tools/v41_routing_flip.py: prompt 58, token 28, where
the second and third experts of layer 4 are 0.003 apart in selection score). Writes benchmarks/results/v41_greedy_noise.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import v41_trained_vs_reference as trained  # noqa: E402


def deepinfer_schedules(model: Path, count: int, length: int, new_tokens: int):
    """-> (the prompts, as tools/v41_trained_vs_reference.py cuts them; {schedule: continuations})."""
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out, prompts = {}, None
    for name, env, single in (("deepinfer, one batch", {}, False),
                              ("deepinfer, one batch, batch-invariant", {"DEEPINFER_BATCH_INVARIANT": "1"}, False),
                              ("deepinfer, one prompt per call", {}, True)):
        os.environ.update(env)
        llm = LLM(str(model), max_num_seqs=16, max_num_batched_tokens=4096)
        prompts = prompts or trained.greedy_prompts(trained.heldout_docs(llm.tokenizer, 1024), count, length)
        if single:
            out[name] = [llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0]
                         .outputs[0].token_ids for p in prompts]
        else:
            out[name] = [o.outputs[0].token_ids for o in
                         llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
        del llm
        for key in env:
            del os.environ[key]
        print(name, "done", flush=True)
    return prompts, out


def reference_schedules(tool, runner, fp32_runner, prompts, new_tokens: int, batch: int):
    single, gaps = [], []
    for prompt in prompts:
        tokens, gap = trained.reference_greedy(tool, runner, prompt, new_tokens)
        single.append(tokens)
        gaps.append(gap)
    fp32 = [trained.reference_greedy(tool, fp32_runner, prompt, new_tokens)[0] for prompt in prompts]
    batched = []
    for i in range(0, len(prompts), batch):  # prompts have equal lengths
        batched += tool.generate(runner, torch.tensor(prompts[i:i + batch]), new_tokens, drafts=False)[
            "greedy.tokens"].tolist()
    forced = []
    for prompt, tokens in zip(prompts, single):
        logits, _ = runner.forward(torch.tensor([prompt + tokens[:-1]]), 0)
        forced.append(logits[0, len(prompt) - 1:].argmax(-1).tolist())
    print("reference done", flush=True)
    return {"reference, one prompt at a time": single, f"reference, {batch} prompts per batch": batched,
            "reference, prefill of its own continuation": forced, "reference in fp32, one prompt at a time": fp32}, gaps


def dump(result: dict) -> str:
    """JSON with one token list per line (indent=1 would put each of ~16k token ids on its own)."""
    def value(k, v):
        if k == "prompts_ids":
            return "[\n  " + ",\n  ".join(json.dumps(x) for x in v) + "\n ]"
        if k == "continuations":
            return "{\n" + ",\n".join(f"  {json.dumps(n)}: [\n   " + ",\n   ".join(json.dumps(x) for x in c) + "\n  ]"
                                      for n, c in v.items()) + "\n }"
        return json.dumps(v, indent=1).replace("\n", "\n ")
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(k, v)}" for k, v in result.items()) + "\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "deepinfer" / "assets" / "tiny-dsv41")
    ap.add_argument("--reference", help="the deepseek_v41 reference folder (default as tools/v41_goldens.py)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=20, help="the reference's batched schedule")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both engines)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "v41_greedy_noise.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    prompts, runs = deepinfer_schedules(a.model, a.prompts, a.prompt_len, a.new_tokens)
    tool = trained.goldens_tool()
    ref = tool.import_reference(tool.find_reference(a.reference))
    max_len = a.prompt_len + 1 + a.new_tokens + 8
    runner = trained.reference_runner(tool, ref, a.model, max_len, a.batch)
    fp32_runner = trained.reference_runner(tool, ref, a.model, max_len, 1, probe="fp32")
    ref_runs, gaps = reference_schedules(tool, runner, fp32_runner, prompts, a.new_tokens, a.batch)
    runs.update(ref_runs)
    names = list(runs)
    agree = {x: {y: sum(p == q for p, q in zip(runs[x], runs[y])) for y in names} for x in names}
    base = "reference, one prompt at a time"
    flips = {}
    for name in names:
        if name != base:
            flips[name] = [dict(prompt=j, position=at, reference_top2_gap=round(gaps[j][at], 5))
                           for j, (p, q) in enumerate(zip(runs[name], runs[base])) if p != q
                           for at in [next(i for i, (x, y) in enumerate(zip(p, q)) if x != y)]]
    # A deepinfer continuation the reference itself produces under one of its schedules is inside the
    # reference's own noise; the rest are not explained by it.
    ref_names = [n for n in names if n.startswith("reference")]
    within = {name: sum(any(runs[name][j] == runs[r][j] for r in ref_names) for j in range(len(prompts)))
              for name in names if not name.startswith("reference")}
    result = dict(command="PYTHONPATH=. python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
                  model=os.path.relpath(a.model.resolve(), REPO), prompts=len(prompts), prompt_len=a.prompt_len,
                  new_tokens=a.new_tokens, agreement=agree, equal_to_some_reference_schedule=within,
                  differs_from_reference_one_at_a_time=flips, prompts_ids=prompts, continuations=runs,
                  wall_s=round(time.time() - t0, 1), load_average=os.getloadavg(), torch_threads=a.threads)
    a.json.write_text(dump(result))
    width = max(map(len, names))
    print(f"prompts (of {len(prompts)}) whose {a.new_tokens} greedy tokens agree")
    for x in names:
        print(f"{x:{width}s} " + " ".join(f"{agree[x][y]:3d}" for y in names))
    print(f"equal to at least one of the reference's {len(ref_names)} schedules: {within}")


if __name__ == "__main__":
    main()
