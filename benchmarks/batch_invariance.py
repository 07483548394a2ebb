"""Cost of batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1) on the cpu backend: output tok/s of
the shipped model with the mode off and on, same prompts and seeds, in one run. DSpark drafting is
off in both (DEEPINFER_USE_NEXTN_DECODE=0): its dynamic choices would vary with the step costs and
hide the cost of the ops themselves.

    python benchmarks/batch_invariance.py [--model DIR] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def run(model, batch: int, new_tokens: int, invariant: bool) -> float:
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1" if invariant else "0"
    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "0"
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max(batch, 1), accelerator="cpu")
    assert llm.accel.batch_invariant == invariant
    vocab = llm.engine.model_config.vocab_size
    prompts = torch.randint(3, vocab, (batch, 32), generator=torch.Generator().manual_seed(0)).tolist()
    params = [SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seq_seed=i) for i in range(batch)]
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return batch * new_tokens / (time.perf_counter() - start)


def main() -> None:
    from deepinfer.llm import TINY_DSV4_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_DSV4_DIR, help="default: tiny-dsv4 (the README's figures)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--json", default="benchmarks/results/batch_invariance.json")
    args = parser.parse_args()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        off = run(args.model, batch, args.new_tokens, invariant=False)
        on = run(args.model, batch, args.new_tokens, invariant=True)
        rows.append(dict(batch=batch, off_tok_s=off, on_tok_s=on, ratio=on / off))
    print(f"cpu, {torch.get_num_threads()} thread(s), 32-token prompts, {args.new_tokens} new tokens, temperature 1, "
          "no drafting")
    print("| batch | mode off tok/s | mode on tok/s | on / off |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['ratio']:.2f}x |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
