"""Routing benchmark: a multi-turn chat workload (conversations sharing long system prompts, each
turn extending its history) at several arrival rates, through smg (the SGLang model gateway) with
round_robin and cache_aware and through vllm-router with kv_aware (routing on the KV events the
workers publish, --kv-events-config) and round_robin, over two deepinfer workers, and against one
replica alone, in one run. Per leg and rate: the workers' prefix-cache hit rate (cached prompt
tokens / prompt tokens, from their /metrics), TTFT and TPOT p50/p99 at the client, output
throughput. Writes JSON (and a plot when matplotlib is installed).

    python benchmarks/router.py                                   # tiny-dsv4, rates 0.25,0.5,1
    python benchmarks/router.py --rates 0.5,1,2 --conversations 12 --legs one_replica,vllm_kv_aware

A rate is conversation arrivals per second (Poisson); a conversation's turns follow one another
(the next is sent when the reply is in), so requests arrive at up to rate x turns per second.
Every reply is greedy with `ignore_eos` and exactly --max-tokens tokens. Each leg and rate gets
texts of its own (a tag in every message), so no run is served from another's cache; each worker
first serves a warm-up of its own texts, outside every leg. Every worker publishes KV events for
the whole run (the same workers serve every leg); each vllm-router leg starts its own router, which
learns what is cached only from events published after it subscribed, that is from its own leg's
texts.

Legs are entries of LEGS: a context manager from the workers (URL, event ports) to a base URL.

Everything runs on this machine: on a few shared cores two replicas compete with each other, the
router and the client for the same CPUs, so their throughput cannot approach twice one replica's
(the JSON records the core count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "server")]  # fleet.py and the conftest it imports
from conftest import free_port  # noqa: E402
from fleet import (conversations, events_config, hit_rate, prefix_counters, running_servers,  # noqa: E402
                   running_smg, running_vllm_router)

from deepinfer.llm import TINY_DSV4_DIR  # noqa: E402


@dataclass
class Worker:
    url: str
    events: tuple[int, int]  # the loopback ports its KV events are published on: (PUB, replay)


@contextmanager
def _one_replica(workers: list[Worker], model: str):
    yield workers[0].url


@contextmanager
def _smg(policy: str, workers: list[Worker], model: str):
    with running_smg([w.url for w in workers], policy) as router:
        yield router.url


@contextmanager
def _vllm_router(policy: str, workers: list[Worker], model: str):
    sources = [w.events for w in workers] if policy == "kv_aware" else None
    with running_vllm_router([w.url for w in workers], policy, model, sources) as router:
        yield router.url


# leg name -> (workers it routes over, context manager: (workers, served model name) -> the base URL to send to)
LEGS = {
    "one_replica": (1, _one_replica),
    "smg_round_robin": (2, lambda workers, model: _smg("round_robin", workers, model)),
    "smg_cache_aware": (2, lambda workers, model: _smg("cache_aware", workers, model)),
    "vllm_round_robin": (2, lambda workers, model: _vllm_router("round_robin", workers, model)),
    "vllm_kv_aware": (2, lambda workers, model: _vllm_router("kv_aware", workers, model)),
}
# (numerator leg, denominator leg) of the TTFT p50 ratios the JSON compares at each rate: > 1 = the second is faster
TTFT_COMPARISONS = [("smg_round_robin", "smg_cache_aware"), ("vllm_round_robin", "vllm_kv_aware"),
                    ("smg_round_robin", "vllm_kv_aware")]


def _percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def _turn(client, model: str, messages: list[dict], max_tokens: int, samples: list) -> str:
    sent = time.perf_counter()
    first = None
    text, tokens = "", 0
    stream = await client.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                                  max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                text += choice.delta.content
    end = time.perf_counter()
    first = first or end
    samples.append({"ttft": first - sent, "tpot": (end - first) / (tokens - 1) if tokens > 1 else None,
                    "tokens": tokens})
    return text


async def _conversation(client, model: str, conv, start: float, max_tokens: int, samples: list) -> None:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    for turn in range(len(conv.users)):
        conv.replies.append(await _turn(client, model, conv.messages(turn), max_tokens, samples))


async def _drive(base_url: str, model: str, convs, rate: float, max_tokens: int, seed: int) -> dict:
    import openai

    rng = random.Random(seed)
    t0 = time.perf_counter() + 0.1
    starts, t = [], t0
    for _ in convs:
        starts.append(t)
        t += rng.expovariate(rate)
    samples: list[dict] = []
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        began = time.perf_counter()
        await asyncio.gather(*(_conversation(client, model, c, s, max_tokens, samples) for c, s in zip(convs, starts)))
        seconds = time.perf_counter() - began
    ttft = [s["ttft"] for s in samples]
    tpot = [s["tpot"] for s in samples if s["tpot"] is not None]
    tokens = sum(s["tokens"] for s in samples)
    return {"requests": len(samples), "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "req_s": len(samples) / seconds, "ttft_p50": _percentile(ttft, 0.5), "ttft_p99": _percentile(ttft, 0.99),
            "tpot_p50": _percentile(tpot, 0.5), "tpot_p99": _percentile(tpot, 0.99)}


def _plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for leg, rows in results.items():
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["hit_rate"] for r in rows], marker="o", label=leg)
        axes[1].plot(rates, [r["ttft_p50"] for r in rows], marker="o", label=leg)
        axes[2].plot(rates, [r["tok_s"] for r in rows], marker="o", label=leg)
    for ax, title in zip(axes, ("prefix-cache hit rate", "TTFT p50 (s)", "output tokens / s")):
        ax.set_title(title)
        ax.set_xlabel("conversations / s")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _shown(path: str) -> str:
    """A path as the JSON records it: relative to the repository when inside it (no machine's paths)."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else path


def _router_versions(legs: list[str]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package, prefix in (("smg", "smg_"), ("vllm-router", "vllm_")):
        if any(leg.startswith(prefix) for leg in legs):
            try:
                out[package] = version(package)
            except PackageNotFoundError:
                out[package] = None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=TINY_DSV4_DIR)
    parser.add_argument("--served-model-name", default=None, help="default: the model directory's name")
    parser.add_argument("--rates", default="0.25,0.5,1", help="conversation arrivals per second, comma-separated")
    parser.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated, of {list(LEGS)}")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=2, help="distinct system prompts the conversations share")
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "router.json"))
    args = parser.parse_args(argv)
    legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    unknown = [leg for leg in legs if leg not in LEGS]
    if unknown:
        parser.error(f"--legs: unknown {unknown}; known: {list(LEGS)}")
    rates = [float(r) for r in args.rates.split(",")]
    model = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    num_workers = max(LEGS[leg][0] for leg in legs)
    worker_args = ("--model", args.model, "--served-model-name", model, "--max-num-seqs", str(args.max_num_seqs))
    event_ports = [(free_port(), free_port()) for _ in range(num_workers)]
    results: dict[str, list[dict]] = {}
    with running_servers(num_workers, *worker_args,
                         own_args=lambda i: ("--kv-events-config", events_config(*event_ports[i]))) as servers:
        workers = [Worker(s.url, ports) for s, ports in zip(servers, event_ports)]
        for w in workers:  # a worker's first steps build its kernels and step graphs: not part of any leg
            warm = conversations(f"warm-up {w.url}", 2, 1, 1, args.system_words)
            asyncio.run(_drive(w.url, model, warm, 100.0, args.max_tokens, args.seed))
        for leg in legs:
            used = workers[:LEGS[leg][0]]
            urls = [w.url for w in used]
            with LEGS[leg][1](used, model) as base_url:
                for rate in rates:
                    convs = conversations(f"{leg}@{rate}", args.conversations, args.turns, args.system_prompts,
                                          args.system_words, seed=args.seed)
                    before = prefix_counters(urls)
                    row = asyncio.run(_drive(base_url, model, convs, rate, args.max_tokens, args.seed))
                    row.update(rate=rate, hit_rate=hit_rate(before, prefix_counters(urls)))
                    results.setdefault(leg, []).append(row)
                    print(f"{leg:16s} rate {rate:5.2f}/s  hit {row['hit_rate']:.2f}  TTFT p50 {row['ttft_p50']:.3f}s "
                          f"p99 {row['ttft_p99']:.3f}s  TPOT p50 {row['tpot_p50']:.4f}s  {row['tok_s']:.1f} tok/s",
                          flush=True)
    compare = {}
    for slow, fast in TTFT_COMPARISONS:
        if slow in results and fast in results:
            compare[f"ttft_p50_{slow}_over_{fast}"] = [
                a["ttft_p50"] / b["ttft_p50"] for a, b in zip(results[slow], results[fast])]
    for two_legs in ("smg_cache_aware", "vllm_kv_aware"):
        if "one_replica" in results and two_legs in results:
            compare[f"tok_s_{two_legs}_over_one_replica"] = [
                two["tok_s"] / one["tok_s"] for two, one in zip(results[two_legs], results["one_replica"])]
    report = {"config": {**vars(args), "model": _shown(args.model), "out": _shown(args.out), "legs": legs,
                         "rates": rates, "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
                         "routers": _router_versions(legs)},
              "results": results, "compare": compare}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    plot = _plot(results, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(compare, indent=2))
    print(f"wrote {args.out}" + (f" and {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
