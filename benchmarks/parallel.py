"""Parallelism on this machine: throughput of 1 process vs DP=2 (ranks run free, one core
each), EP=2 (attention replicated) and DP=2+EP=2, the time each rank spends in MoE dispatch /
experts / combine per step, and, on paper, the communication volume of one decode step of DeepSeek-V4-Flash at EP 64.

    python benchmarks/parallel.py [--model DIR] [--batch 16] [--prompt-len 64] [--new-tokens 32]

On a CPU machine the ranks share the cores, so EP shows its overhead here, not a speedup: it
pays off when each rank has its own device and the experts no longer fit on one. Pure data
parallelism shares no collective per step, so its ranks use both cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

LAYOUTS = {"1 process": {}, "DP=2": dict(data_parallel_size=2), "EP=2": dict(expert_parallel_size=2),
           "DP=2+EP=2": dict(expert_parallel_size=2, data_parallel_size=2)}


def run(model, layout: dict, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from deepinfer import LLM, SamplingParams
    from deepinfer.parallel.worker import RankWorker

    from deepinfer.models.registry import load_config

    vocab = load_config(model)[0].vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * prompt_len), **layout)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        before = llm.parallel.collective_rpc(RankWorker.stats) if llm.parallel else None
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.parallel.collective_rpc(RankWorker.stats) if llm.parallel else None
    finally:
        llm.close()
    row = dict(tok_s=batch * new_tokens / wall, wall_s=wall, tokens=[o.outputs[0].token_ids for o in outs])
    if after and "ep_seconds" in after[0]:
        steps = after[0]["steps"] - before[0]["steps"]
        for phase in ("sync", "dispatch", "experts", "combine"):  # mean over ranks, per lockstep step
            spent = [a["ep_seconds"][phase] - b["ep_seconds"][phase] for a, b in zip(after, before)]
            row[f"{phase}_ms_per_step"] = sum(spent) / len(spent) / steps * 1e3
        row["steps"] = steps
    return row


def v4_flash_decode_volume(ep: int = 64, tokens_per_rank: int = 128) -> dict:
    """Bytes one rank sends per decode step (dispatch + combine over all MoE layers) for
    DeepSeek-V4-Flash: 43 MoE layers, hidden 4096, 256 routed experts (top 6) over `ep` ranks.
    Dispatch carries fp8 activations + one fp32 scale per 128 channels, combine bf16 outputs
    (DeepEP's formats). Two counts: one row per (token, expert) as this engine sends it, and
    one row per (token, destination rank) as a deduplicating dispatch (DeepEP) sends it."""
    layers, hidden, experts, top_k = 43, 4096, 256, 6
    dispatch_row = hidden * 1 + hidden // 128 * 4
    combine_row = hidden * 2
    per_rank = experts // ep
    # expected distinct destination ranks among a token's top-6 experts (uniform routing)
    distinct = ep * (1 - math.comb(experts - per_rank, top_k) / math.comb(experts, top_k))
    remote = 1 - 1 / ep  # rows whose expert is on another rank cross the network
    out = {"ep": ep, "tokens_per_rank": tokens_per_rank, "layers": layers, "dispatch_row_bytes": dispatch_row,
           "combine_row_bytes": combine_row, "expected_destination_ranks": distinct}
    for name, rows in (("per_expert", top_k), ("per_rank_dedup", distinct)):
        per_token = rows * remote * (dispatch_row + combine_row) * layers
        out[f"{name}_bytes_per_token"] = per_token
        out[f"{name}_bytes_per_step"] = per_token * tokens_per_rank
    return out


def main() -> None:
    from deepinfer.llm import TINY_DSV4_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_DSV4_DIR, help="model dir (default: tiny-dsv4, the README's figures)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default="benchmarks/results/parallel.json")
    args = parser.parse_args()
    rows = {name: run(args.model, layout, args.batch, args.prompt_len, args.new_tokens)
            for name, layout in LAYOUTS.items()}
    base = rows["1 process"]
    print(f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, batch {args.batch}, "
          f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy")
    print("| layout | output tok/s | vs 1 process | same tokens | count exchange + wait ms/step | dispatch ms/step "
          "| experts ms/step | combine ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        same = r["tokens"] == base["tokens"]
        ms = [f"{r[k]:.2f}" if k in r else "-" for k in ("sync_ms_per_step", "dispatch_ms_per_step", "experts_ms_per_step",
                                                           "combine_ms_per_step")]
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | {same} | {' | '.join(ms)} |")
    paper = v4_flash_decode_volume()
    print(f"\nV4-Flash decode step at EP {paper['ep']}, {paper['tokens_per_rank']} tokens per rank, per rank sent "
          f"(received is the same on average), {paper['layers']} MoE layers, dispatch fp8 "
          f"{paper['dispatch_row_bytes']} B/row, combine bf16 {paper['combine_row_bytes']} B/row:")
    for name in ("per_expert", "per_rank_dedup"):
        print(f"  {name:15s} {paper[f'{name}_bytes_per_token'] / 2**20:7.2f} MiB/token  "
              f"{paper[f'{name}_bytes_per_step'] / 2**20:8.1f} MiB/step")
    for r in rows.values():
        r.pop("tokens")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "runs": rows, "v4_flash_ep64_decode": paper}, f, indent=2)


if __name__ == "__main__":
    main()
