"""The tiered prefix KV store (docs/kv-store.md) on a shipped tiny model, in one run:

(a) a long cached prompt (--long tokens of a held-out CPython file): TTFT of a cold prefill, of a hit
    in the engine's own pool (L1), and of a fresh engine on the same file store (L3: fetch, load,
    replay). Each engine first serves a warm-up prompt of the same length (other tokens), then the
    --reps prompts (other offsets of one file, sharing no page).
(b) a multi-turn workload whose prefix working set is ~10x the cache pool (L1 = --pool-pages pages):
    --conversations conversations of --turns turns (a held-out file's first --context tokens, then
    --turn-tokens more of it per turn, plus --reply greedy tokens), served one request at a time,
    round-robin over the conversations, so a conversation's history has left the pool when it comes
    back. Configurations: no store (every turn recomputes its history), L2 (host memory holding the
    working set), L3 file store, L3 Mooncake Store (a real mooncake_master on 127.0.0.1), and
    (c) a restart: a new engine on the L3 run's file store serves the workload again.
    TTFT p50 / p99 over all turns and throughput (requests per second; the workload is the same).

    python benchmarks/kv_store.py [--model deepinfer/assets/tiny-dsv41]
    python benchmarks/kv_store.py --context 384 --pool-pages 10 \
        --json benchmarks/results/kv_store_short_context.json     # shorter histories: replay weighs more

Writes benchmarks/results/kv_store.json (and kv_store.png when matplotlib is installed). Compact
replay (the default), drafting off (DEEPINFER_USE_NEXTN_DECODE=0: the drafter's acceptance would
change decode time, not what a store changes). cpu: the store's reads are file reads and a TCP
Mooncake client; no pinned memory or RDMA.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def held_out_docs(tokenizer) -> list[list[int]]:
    """The held-out CPython files of tools/train_tiny.py's corpus as token ids, longest first."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        from train_tiny import collect_corpus
    finally:
        sys.path.pop(0)
    _, _, held = collect_corpus()
    return sorted((tokenizer.encode(text) for _, text in held), key=len, reverse=True)


def serve_one(engine, prompt: list[int], params) -> tuple[float, list[int]]:
    """Serve `prompt` alone: (TTFT in seconds, output token ids)."""
    req = engine.add_request(list(prompt), params)
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished()
    return req.metrics.time_to_first_token, list(req.output_token_ids)


def kv_stats(llm) -> dict:
    if llm.engine.kv_store is not None:
        llm.engine.kv_store.flush()
    return {k: v for k, v in llm.stats().items() if k.startswith(("kv_store_", "prefix_cache_"))}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# ------------------------------------------------------------------ (a) one long prompt
def long_prompt(args) -> dict:
    from deepinfer import LLM, SamplingParams

    store = tempfile.mkdtemp(prefix="kv-store-bench-")
    params = SamplingParams(max_tokens=1)
    kw = dict(max_num_seqs=1, max_num_batched_tokens=2048)
    try:
        writer = LLM(args.model, kv_store=f"file://{store}", **kw)
        docs = held_out_docs(writer.tokenizer)
        source, other = docs[0], docs[1]
        prompts = [source[i * args.long // 2: i * args.long // 2 + args.long] for i in range(args.reps)]
        assert all(len(p) == args.long for p in prompts), "a held-out file too short for --long / --reps"
        serve_one(writer.engine, other[:args.long], params)  # warm-up
        cold = [serve_one(writer.engine, p, params)[0] for p in prompts]
        l1 = [serve_one(writer.engine, p, params)[0] for p in prompts]
        l1_stats = kv_stats(writer)
        page = writer.engine.cache.page_tokens
        writer.close()

        reader = LLM(args.model, kv_store=f"file://{store}", **kw)  # a fresh engine on the same store
        serve_one(reader.engine, other[args.long // 2: args.long // 2 + args.long], params)  # warm-up
        before = kv_stats(reader)
        l3 = [serve_one(reader.engine, p, params)[0] for p in prompts]
        after = kv_stats(reader)
        reader.close()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    row = dict(prompt_tokens=args.long, reps=args.reps,
               ttft_cold_ms=[1e3 * t for t in cold], ttft_l1_ms=[1e3 * t for t in l1],
               ttft_l3_ms=[1e3 * t for t in l3],
               l1_hit_tokens=l1_stats["prefix_cache_hit_tokens"],
               l3_hit_tokens=after["kv_store_l3_hit_tokens"] - before["kv_store_l3_hit_tokens"],
               l3_hit_bytes=after["kv_store_l3_hit_bytes"] - before["kv_store_l3_hit_bytes"],
               l3_fetch_ms=1e3 * (after["kv_store_fetch_seconds"] - before["kv_store_fetch_seconds"]) / args.reps,
               l3_replayed_tokens=after["prefix_cache_replayed_tokens"] - before["prefix_cache_replayed_tokens"],
               page_tokens=page)
    med = {k: statistics.median(row[f"ttft_{k}_ms"]) for k in ("cold", "l1", "l3")}
    row.update({f"ttft_{k}_median_ms": v for k, v in med.items()})
    row["l3_over_cold"] = med["l3"] / med["cold"]
    row["l1_over_cold"] = med["l1"] / med["cold"]
    return row


# ------------------------------------------------------------------ (b), (c) multi-turn
def workload(tokenizer, args) -> list[list[int]]:
    need = args.context + args.turns * args.turn_tokens
    docs = [d for d in held_out_docs(tokenizer) if len(d) >= need]
    if len(docs) < args.conversations:
        # fewer long files than conversations: later conversations start further into a file
        docs = [d[i * need:(i + 1) * need] for d in docs for i in range(len(d) // need)]
    if len(docs) < args.conversations:
        raise SystemExit(f"the held-out files hold only {len(docs)} conversations of {need} tokens")
    return docs[:args.conversations]


def multi_turn(args, name: str, **store) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=1, max_num_batched_tokens=2048, num_cache_pages=args.pool_pages, **store)
    engine = llm.engine
    docs = workload(llm.tokenizer, args)
    params = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True)
    # warm-up, prefill and decode (the process's first decode steps are slow), under a page: not cached
    serve_one(engine, [1 + (i % 500) for i in range(100)], params)
    before = kv_stats(llm)
    histories = [d[:args.context] for d in docs]
    ttft = []
    start = time.perf_counter()
    for turn in range(args.turns):
        for c, doc in enumerate(docs):
            if turn:
                cut = args.context + turn * args.turn_tokens
                histories[c] += doc[cut - args.turn_tokens:cut]
            t, out = serve_one(engine, histories[c], params)
            ttft.append(t)
            histories[c] += out
    wall = time.perf_counter() - start
    stats = kv_stats(llm)
    page = engine.cache.page_tokens
    working_set = sum(len(h) // page for h in histories)
    llm.close()
    delta = {k: stats[k] - before.get(k, 0) for k in stats if isinstance(stats[k], (int, float))}
    requests = args.turns * args.conversations
    return dict(config=name, requests=requests, wall_s=wall, requests_per_s=requests / wall,
                ttft_p50_ms=1e3 * percentile(ttft, 0.5), ttft_p99_ms=1e3 * percentile(ttft, 0.99),
                ttft_mean_ms=1e3 * statistics.mean(ttft),
                pool_pages=args.pool_pages, working_set_pages=working_set,
                hit_tokens={"pool": delta.get("prefix_cache_hit_tokens", 0),
                            "L2": delta.get("kv_store_l2_hit_tokens", 0), "L3": delta.get("kv_store_l3_hit_tokens", 0)},
                replayed_tokens=delta.get("prefix_cache_replayed_tokens", 0),
                l3_fetch_s=delta.get("kv_store_fetch_seconds", 0.0), written_pages=delta.get("kv_store_written_pages", 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def mooncake_master():
    """A real mooncake_master (the [kv] extra's binary) on 127.0.0.1; yields its mooncake:// URL."""
    binary = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
    if binary is None:
        raise SystemExit("mooncake_master is missing: pip install -e '.[kv]'")
    port = free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                             f"--metrics_port={free_port()}", f"--http_metadata_server_port={free_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # the master listens once it is up
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("mooncake_master did not start")
            time.sleep(0.1)
        yield f"mooncake://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib to get benchmarks/results/kv_store.png)")
        return
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    lp = result["long_prompt"]
    names = ["cold", "L1 hit", "L3 hit\n(fresh engine)"]
    a.bar(names, [lp[f"ttft_{k}_median_ms"] for k in ("cold", "l1", "l3")], color=["gray", "tab:blue", "tab:orange"])
    a.set_ylabel("TTFT, ms (median)")
    a.set_title(f"{lp['prompt_tokens']}-token cached prompt")
    rows = result["multi_turn"]
    labels = [r["config"] for r in rows]
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], width=0.4, label="p50")
    b.bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], width=0.4, label="p99")
    b.set_xticks(list(x), labels, rotation=20)
    b.set_ylabel("TTFT, ms")
    b.set_title(f"multi-turn, working set ~{rows[0]['working_set_pages'] / rows[0]['pool_pages']:.0f}x the pool")
    b.legend()
    c.bar(labels, [r["requests_per_s"] for r in rows], color="tab:green")
    c.set_xticks(list(x), labels, rotation=20)
    c.set_ylabel("requests / s")
    c.set_title("multi-turn throughput")
    fig.suptitle(f"{result['model']} on {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join("deepinfer", "assets", "tiny-dsv41"))
    parser.add_argument("--long", type=int, default=4000, help="(a) the cached prompt's tokens")
    parser.add_argument("--reps", type=int, default=3, help="(a) prompts measured per way")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--context", type=int, default=1024, help="a conversation's first prompt")
    parser.add_argument("--turn-tokens", type=int, default=128, help="prompt tokens each later turn adds")
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--pool-pages", type=int, default=14,
                        help="the cache pool (L1), in pages: one conversation's longest history fits")
    parser.add_argument("--host-bytes", type=int, default=256 << 20, help="L2's budget (holds the working set)")
    parser.add_argument("--skip-mooncake", action="store_true")
    parser.add_argument("--json", default=os.path.join("benchmarks", "results", "kv_store.json"))
    args = parser.parse_args()
    os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", "0")
    import torch

    from deepinfer.backends import get_accelerator

    accel = get_accelerator(None)
    device = (torch.cuda.get_device_name() if accel.name == "nvidia" else f"{accel.name}, {torch.get_num_threads()} threads")
    result = dict(model=args.model, device=device, args=vars(args), load_average_before=os.getloadavg())
    result["long_prompt"] = long_prompt(args)
    print(json.dumps(result["long_prompt"], indent=1))
    rows = [multi_turn(args, "no store"), multi_turn(args, "L2", kv_host_cache_bytes=args.host_bytes)]
    store = tempfile.mkdtemp(prefix="kv-store-bench-")
    try:
        rows.append(multi_turn(args, "L3 file", kv_store=f"file://{store}"))
        rows.append(multi_turn(args, "restart, L3 file", kv_store=f"file://{store}"))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    if not args.skip_mooncake:
        with mooncake_master() as url:
            rows.append(multi_turn(args, "L3 Mooncake", kv_store=url))
    base = rows[0]["requests_per_s"]
    for r in rows:
        r["throughput_vs_no_store"] = r["requests_per_s"] / base
        print(json.dumps(r))
    result["multi_turn"] = rows
    result["load_average_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    plot(result, os.path.splitext(args.json)[0] + ".png")


if __name__ == "__main__":
    main()
