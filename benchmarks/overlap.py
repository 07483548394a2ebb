"""Zero-overhead scheduling on vs off: throughput, the per-step timeline (schedule, prepare,
forward, sample, post-process, waiting for the device) and the share of wall time the model
(forward + sample, the "device") is idle, at batch 1 / 8 / 32 on tiny-dsv4 (or a tiny
test config: its phase columns are the decode-step breakdown quoted in the README).

    python benchmarks/overlap.py [--model DIR | --tiny-config mixed_hc4_yarn] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def run(model, batch: int, new_tokens: int, overlap: bool) -> dict:
    os.environ["DEEPINFER_ZERO_OVERHEAD_SCHEDULING"] = "1" if overlap else "0"
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max(batch, 1))
    vocab = llm.engine.model_config.vocab_size
    prompts = torch.randint(3, vocab, (batch, 64), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.timeline.clear()
    steps_before = 0
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    llm.engine.close()
    timeline = dict(llm.engine.timeline)
    device = timeline.get("forward", 0.0) + timeline.get("sample", 0.0)
    steps = new_tokens + steps_before  # one decode step per new token (the prefill fits one step)
    per_step_ms = {k: v / steps * 1e3 for k, v in timeline.items()}
    return dict(batch=batch, overlap=overlap, tok_s=batch * new_tokens / wall, wall_s=wall,
                device_idle=1 - device / wall, per_step_ms=per_step_ms, tokens=tokens)


def main() -> None:
    from deepinfer.llm import TINY_DSV4_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_DSV4_DIR, help="default: tiny-dsv4 (the README's figures)")
    parser.add_argument("--tiny-config", default=None, help="a tiny random V4 of the tests instead of --model")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--json", default="benchmarks/results/overlap.json")
    args = parser.parse_args()
    if args.tiny_config:
        sys.path.insert(0, os.path.dirname(__file__))
        from throughput import _model_dir  # saves the test config's model to a temporary directory

        args.model = _model_dir(args)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        off = run(args.model, batch, args.new_tokens, overlap=False)
        on = run(args.model, batch, args.new_tokens, overlap=True)
        same = off.pop("tokens") == on.pop("tokens")
        rows.append(dict(batch=batch, off=off, on=on, speedup=on["tok_s"] / off["tok_s"], identical=same))
    print(f"threads {torch.get_num_threads()}, 64-token prompts, {args.new_tokens} new tokens, greedy")
    phases = ("schedule", "prepare", "forward", "sample", "postprocess", "wait")
    print("| batch | overlap | output tok/s | device idle | speedup | identical | "
          + " | ".join(f"{p} ms/step" for p in phases) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(phases))
    for r in rows:
        for mode in ("off", "on"):
            m = r[mode]
            extra = (f"{r['speedup']:.2f}x", str(r["identical"])) if mode == "on" else ("", "")
            times = " | ".join(f"{m['per_step_ms'].get(p, 0.0):.2f}" for p in phases)
            print(f"| {r['batch']} | {mode} | {m['tok_s']:.1f} | {m['device_idle']:.0%} | {extra[0]} | {extra[1]} | "
                  f"{times} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
