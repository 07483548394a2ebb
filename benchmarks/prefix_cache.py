"""Prefix cache on a multi-turn workload: time to first token and prefill tokens computed with
replay mode off (every turn recomputes its whole history) and compact (a turn restores the
cached pages of its history and replays KEEP tokens), same conversations, in one run.

Each conversation starts from its own held-out CPython file (the first --context tokens) and
adds --turn-tokens of the same file per turn (the "user message") plus --reply greedy tokens
(the "assistant"); conversations are served one request at a time, so TTFT is prefill time.

    python benchmarks/prefix_cache.py [--model DIR] [--conversations 4] [--turns 6]
    python benchmarks/prefix_cache.py --quality   # held-out perplexity after a hit, compact vs exact

--quality scores held-out files of the shipped model after a hit at 256/512/768 tokens for KEEP
134, 140 and 256 (tests/prefix_quality.py, which tests/e2e/test_prefix_cache.py bounds) and writes
benchmarks/results/prefix_cache_quality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def conversations(tokenizer, count: int, need: int) -> list[list[int]]:
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from train_tiny import collect_corpus

    _, _, held = collect_corpus()
    docs = [d for d in (tokenizer.encode(text) for _, text in held) if len(d) >= need]
    if len(docs) < count:
        raise SystemExit(f"only {len(docs)} held-out files have {need} tokens; lower --turns or --context")
    return docs[:count]


def run(model, mode: str, args) -> dict:
    os.environ["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"] = mode
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=2048)
    engine = llm.engine
    docs = conversations(llm.tokenizer, args.conversations, args.context + args.turns * args.turn_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True)
    engine.add_request(docs[0][:64], SamplingParams(max_tokens=2))  # warm-up, not cached (under a page)
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished()
    ttft = [[] for _ in range(args.turns)]
    prefill = [0] * args.turns
    start = time.perf_counter()
    for doc in docs:
        history = doc[:args.context]
        for turn in range(args.turns):
            if turn:
                cut = args.context + turn * args.turn_tokens
                history += doc[cut - args.turn_tokens:cut]
            req = engine.add_request(list(history), params)
            while engine.has_unfinished():
                engine.step()
                prefill[turn] += engine.last_step.prefill_tokens
            engine.pop_finished()
            ttft[turn].append(req.metrics.time_to_first_token)
            history += req.output_token_ids
    wall = time.perf_counter() - start
    stats = llm.stats()
    engine.close()
    later = [t for turn in ttft[1:] for t in turn]
    return dict(mode=mode, ttft_first_turn_ms=1e3 * statistics.mean(ttft[0]),
                ttft_later_turns_ms=1e3 * statistics.mean(later),
                prefill_tokens_first_turn=prefill[0], prefill_tokens_later_turns=sum(prefill[1:]),
                wall_s=wall, stats=stats)


def quality(path: str) -> None:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from prefix_quality import heldout_quality

    from deepinfer import LLM
    from deepinfer.llm import TINY_DSV4_DIR

    os.environ["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"] = "compact"
    rows = []
    for keep in (128 + 6, 140, 256):
        os.environ["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"] = str(keep)
        rows += heldout_quality(LLM(TINY_DSV4_DIR, max_num_seqs=8, max_num_batched_tokens=2048), keep)
    print("relative perplexity change of compact vs off (per-token deviation as a fraction of truncation's)")
    print("| KEEP | " + " | ".join(f"H={h}" for h in sorted({r['hit'] for r in rows})) + " |")
    print("|---|---|---|---|")
    for keep in sorted({r["keep"] for r in rows}):
        cells = [f"{r['rel_change']:+.3%} ({r['deviation_fraction']:.3f})" for r in rows if r["keep"] == keep]
        print(f"| {keep} | " + " | ".join(cells) + " |")
    with open(path, "w") as f:
        json.dump(dict(model="deepinfer/assets/tiny-dsv4", rows=rows), f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quality", action="store_true", help="held-out perplexity after a hit, not speed")
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--context", type=int, default=512, help="tokens of the first turn")
    parser.add_argument("--turn-tokens", type=int, default=96, help="tokens each later turn adds")
    parser.add_argument("--reply", type=int, default=32, help="greedy tokens generated per turn")
    parser.add_argument("--json", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args()
    if args.quality:
        return quality("benchmarks/results/prefix_cache_quality.json")
    rows = [run(args.model, mode, args) for mode in ("off", "compact")]
    off, compact = rows
    print({k: round(v, 3) for k, v in compact["stats"].items()})
    keep = compact["stats"].get("prefix_cache_replayed_tokens", 0) // max(compact["stats"]["prefix_cache_hits"], 1)
    print(f"cpu, {torch.get_num_threads()} thread(s); {args.conversations} conversations x {args.turns} turns, "
          f"first turn {args.context} tokens, +{args.turn_tokens} + {args.reply} reply per turn; "
          f"KEEP {os.environ.get('DEEPINFER_YOCO_PREFILL_KEEP_TOKENS', 140)} (mean replay {keep} tokens/hit)")
    print("| mode | TTFT turn 1 (ms) | TTFT turns 2+ (ms) | prefill tokens turn 1 | prefill tokens turns 2+ "
          "| wall (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ttft_first_turn_ms']:.1f} | {r['ttft_later_turns_ms']:.1f} | "
              f"{r['prefill_tokens_first_turn']} | {r['prefill_tokens_later_turns']} | {r['wall_s']:.2f} |")
    print(f"compact vs off, turns 2+: TTFT {compact['ttft_later_turns_ms'] / off['ttft_later_turns_ms']:.2f}x, "
          f"prefill tokens {compact['prefill_tokens_later_turns'] / off['prefill_tokens_later_turns']:.2f}x")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(args=vars(args), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
