"""`benchmarks/serve.py --peer llama-server`: deepinfer's server against llama.cpp's llama-server on
the same checkpoint, the same prompts and the same arrival process, in one run, one server at a
time; prints a table, writes JSON (+ a plot when matplotlib is installed).

    pip install -e '.[test,bench]'
    python benchmarks/serve.py --peer llama-server                  # tiny V4 (8,192 tokens), concurrency 1, 8, 32
    python benchmarks/serve.py --peer llama-server --peer-model v4_vocab --concurrency 1,32

The model is benchmarks/peers.py's (`--peer-model`: v4, or v4_vocab with DeepSeek's 129,280-token
vocabulary): a seeded random tiny DeepSeek-V4 with what llama.cpp's `deepseek4` loads, written in
DeepSeek's own layout (routed experts FP4), which deepinfer serves as is and llama.cpp's own
converter turns into an f32 GGUF (routed experts MXFP4, the same values). llama.cpp is built once
by peers.py from the llama-cpp-python sdist, llama-server included, and cached there.

Each concurrency level C gets its own requests (max(--num-prompts, 2C) random-token prompts,
never reused, so no prompt cache hits on either side) and, for each engine in turn, a fresh
server sized for C: llama-server `--parallel C` slots with continuous batching and a context of
C x (prompt + max tokens + 16), f32 KV cache and no flash attention as in peers.py;
deepinfer `serve --max-num-seqs C`. Both get --threads compute threads (llama-server
`--threads/--threads-batch`, deepinfer `DEEPINFER_CPU_THREADS`); `llama-server-1-thread` is
llama-server with one thread, its better setting on a loaded 2-core machine, where its threads
wait for each other at every graph node (the goal is judged against the better of the two).
deepinfer runs up to 8
greedy steps per engine call and streams each step's tokens as the step ends;
`deepinfer-stream-interval-8` streams a call's tokens together (`--stream-interval 8`), and
`deepinfer-single-step` runs one step per call (DEEPINFER_MULTI_STEP_DECODE=1).

The client (serve.py's, the openai client, streamed /v1/completions, temperature 0,
`ignore_eos`, exactly --max-tokens new tokens) first sends C warm-up requests together, then the
level's requests with Poisson arrivals at --request-rate (inf: all at once), at most C in flight.
Figures: output tok/s (completion tokens / first arrival to last completion), TTFT (sent -> first
text), ITL (gaps between consecutive streamed pieces of text, vLLM's definition: a piece carrying
several tokens is one gap), TPOT (the rest of a stream over its tokens after the first), the
server process's CPU ms per output token. Greedy text is compared with the first engine's on
each prompt (streamed texts joined): how many completions are equal, and for the others the first
differing character and token (the token counted by the first engine's stream pieces, exact when
it streamed one piece per token, as llama-server does).

Roofline: the weight bytes a decode step of C sequences reads (everything but the embedding
table; routed experts: the expected number of distinct experts C tokens pick at uniform routing)
over the copy bandwidth measured in the same run (real_shapes.copy_bandwidth, 1 GiB: DRAM). This
tiny model (~25 MB read per step) fits in the last-level cache of most servers, so the bound is
loose at C=1 and far away at C=32, where the steps are compute-bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from serve import _cpu_seconds, drive, free_port, start_process, stop_process, summarize  # noqa: E402
from throughput import _prompts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ENGINES = ("llama-server", "llama-server-1-thread", "deepinfer", "deepinfer-stream-interval-8", "deepinfer-single-step")
LLAMA_THREADS = {"llama-server": None, "llama-server-1-thread": 1}  # None: --threads
# what each deepinfer engine sets on top of DEEPINFER_CPU_THREADS, and its own serve flags
DEEPINFER_ENV = {"deepinfer": {}, "deepinfer-stream-interval-8": {},
                 "deepinfer-single-step": {"DEEPINFER_MULTI_STEP_DECODE": "1"}}
DEEPINFER_FLAGS = {"deepinfer-stream-interval-8": ["--stream-interval", "8"]}
SERVED_NAME = "tiny-v4"


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--peer llama-server")
    group.add_argument("--peer", choices=["llama-server"], default=None,
                       help="run the peer benchmark (this module) instead of the rate sweep")
    group.add_argument("--peer-model", choices=["v4", "v4_vocab"], default="v4")
    group.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    group.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    group.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}")
    group.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    group.add_argument("--llama-cpp-version", default="0.3.36")
    group.add_argument("--cache-dir", default="~/.cache/deepinfer-peers", help="where peers.py builds llama.cpp")
    group.add_argument("--work-dir", default=None, help="keep the model and GGUF here (default: a temporary dir)")


def check_arguments(parser, args) -> None:
    engines = args.engines.split(",")
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}; choose from {','.join(ENGINES)}")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: {args.concurrency!r} is not a comma-separated list of integers")
    if not levels or min(levels) < 1:
        parser.error("--concurrency: every level must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    args.engine_list, args.levels = engines, levels


def level_prompts(vocab: int, levels: list[int], num_prompts: int, prompt_len: int) -> tuple[list, dict]:
    """Distinct prompts for every level's warm-up and requests: (warm-up prompts, {level: prompts})."""
    counts = {c: max(num_prompts, 2 * c) for c in levels}
    pool = _prompts(vocab, max(levels) + sum(counts.values()), prompt_len)
    warmup, at = pool[:max(levels)], max(levels)
    out = {}
    for c in levels:
        out[c], at = pool[at:at + counts[c]], at + counts[c]
    return warmup, out


def llama_server_command(llama: dict, gguf: Path, port: int, slots: int, threads: int, ctx_per_slot: int) -> list[str]:
    from peers import LLAMA_FLOAT32

    return [str(llama["server"]), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME,
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots), "--cont-batching",
            "--ctx-size", str(slots * ctx_per_slot), *LLAMA_FLOAT32, "--no-webui"]


def deepinfer_command(model: Path, port: int, slots: int) -> list[str]:
    return [sys.executable, "-m", "deepinfer", "serve", "--model", str(model), "--port", str(port),
            "--served-model-name", SERVED_NAME, "--max-num-seqs", str(slots), "--log-level", "warning"]


def first_difference(ref_chunks: list[str], other: str) -> dict:
    """Where `other` first departs from the text streamed as `ref_chunks`: the character, and the
    stream piece of the reference it falls in (its token when the reference streamed one piece per
    token); None when equal."""
    ref = "".join(ref_chunks)
    if ref == other:
        return None
    char = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
    piece, end = 0, 0
    for piece, text in enumerate(ref_chunks):
        end += len(text)
        if char < end:
            break
    else:
        piece = len(ref_chunks)
    return dict(char=char, piece=piece)


def compare_greedy(ref: list[dict], other: list[dict]) -> dict:
    """Completions of the same prompts (drive() records, in order) from two engines."""
    diffs = []
    for i, (a, b) in enumerate(zip(ref, other)):
        d = first_difference([t for _, t in a["chunks"]], "".join(t for _, t in b["chunks"]))
        if d is not None:
            diffs.append(dict(prompt=i, **d, token_exact=len(a["chunks"]) == a["tokens"]))
    return dict(completions=len(ref), equal=len(ref) - len(diffs), first_differences=diffs,
                median_first_diff_piece=statistics.median(d["piece"] for d in diffs) if diffs else None)


def step_bytes(model_dir: Path, batch: int) -> float:
    """Weight bytes one decode step of `batch` sequences reads: every tensor but the embedding
    table, the routed experts by the expected number of distinct ones `batch` tokens pick."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    n, k = config["n_routed_experts"], config["num_experts_per_tok"]
    routed = other = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.startswith("embed"):  # a gather of one row per token
                    continue
                t = f.get_tensor(name)
                if ".experts." in name:
                    routed += t.numel() * t.element_size()
                else:
                    other += t.numel() * t.element_size()
    distinct = n * (1 - (1 - k / n) ** batch)
    return other + routed * distinct / n


def run_level(engine: str, level: int, prompts, warmup, args, work: Path, model_dir: Path, llama,
              gguf) -> tuple[dict, list]:
    """One engine at one concurrency level: a fresh server, the warm-up, the requests, the server
    stopped. -> (summary, drive()'s records)."""
    port = free_port()
    env = {**os.environ, "DEEPINFER_CPU_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if engine in LLAMA_THREADS:
        cmd = llama_server_command(llama, gguf, port, level, LLAMA_THREADS[engine] or args.threads,
                                   args.prompt_len + args.max_tokens + 16)
    else:
        env.update(DEEPINFER_ENV[engine])
        cmd = deepinfer_command(model_dir, port, level) + DEEPINFER_FLAGS.get(engine, [])
    with open(work / f"{engine}-c{level}.log", "w") as log:  # the server's own log, kept with the model
        started = time.perf_counter()
        proc = start_process(cmd, port, env, log)
        try:
            startup = time.perf_counter() - started
            cpu = _cpu_seconds(proc.pid)
            load_before = os.getloadavg()
            records, seconds = asyncio.run(drive(f"http://127.0.0.1:{port}", SERVED_NAME, prompts, args.max_tokens,
                                                 args.request_rate, args.seed, level, warmup[:level]))
            cpu = _cpu_seconds(proc.pid) - cpu
        finally:
            stop_process(proc)
    summary = summarize(records, seconds)
    summary.update(cpu_ms_per_token=cpu * 1e3 / summary["output_tokens"], startup_s=startup, load_before=load_before,
                   load_after=os.getloadavg(),
                   command=" ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd)),
                   env={k: env[k] for k in ["DEEPINFER_CPU_THREADS", *DEEPINFER_ENV.get(engine, {})]}
                   if engine not in LLAMA_THREADS else {})
    if any(r["tokens"] != args.max_tokens for r in records):
        summary["short_completions"] = sum(r["tokens"] != args.max_tokens for r in records)
    return summary, records


def measure(args, prompts: dict, run_one) -> list[dict]:
    """Every level, every engine in turn (`run_one(engine, level)` -> (summary, records)), the
    engines alternating within a level so that a drift of the machine's load hits all of them;
    then each engine's throughput, ITL and greedy text against the first engine's."""
    rows = []
    for level in args.levels:
        row = dict(concurrency=level, requests=len(prompts[level]))
        records = {}
        for engine in args.engine_list:
            print(f"concurrency {level}: {engine} ...", flush=True)
            row[engine], records[engine] = run_one(engine, level)
        ref = args.engine_list[0]
        for engine in args.engine_list[1:]:
            row[engine]["greedy_vs_" + ref] = compare_greedy(records[ref], records[engine])
            row[engine]["tok_s_vs_" + ref] = row[engine]["tok_s"] / row[ref]["tok_s"]
            row[engine]["itl_p50_vs_" + ref] = row[engine]["itl_p50"] / row[ref]["itl_p50"]
        rows.append(row)
    return rows


def run(args, work: Path) -> dict:
    from peers import MODELS, build_llama_cpp, convert_gguf, write_model
    from real_shapes import copy_bandwidth

    config, _, pre, _ = MODELS[args.peer_model]
    llama = gguf = None
    if any(e in LLAMA_THREADS for e in args.engine_list):  # either llama-server configuration
        llama = build_llama_cpp(args.llama_cpp_version, Path(args.cache_dir).expanduser(), server=True)
    dirs = write_model(args.peer_model, work)  # checks deepinfer against transformers on it
    model_dir = dirs["deepinfer"]
    if llama is not None:
        gguf = convert_gguf(llama, dirs["llama.cpp"], work / "model-f32.gguf", pre)
    warmup, prompts = level_prompts(config["vocab_size"], args.levels, args.num_prompts, args.prompt_len)
    bandwidth = copy_bandwidth()
    rows = measure(args, prompts, lambda engine, level: run_level(engine, level, prompts[level], warmup, args,
                                                                   work, model_dir, llama, gguf))
    for row in rows:
        step = step_bytes(model_dir, row["concurrency"])
        row["roofline"] = dict(weight_bytes_per_step=step, step_floor_ms=step / bandwidth * 1e3,
                               tok_s=row["concurrency"] * bandwidth / step)
    return dict(peer="llama-server", model=args.peer_model, config=config, engines=args.engine_list,
                threads=args.threads, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                request_rate="inf" if args.request_rate == float("inf") else args.request_rate,
                num_prompts=args.num_prompts, seed=args.seed, copy_bandwidth_GBps=bandwidth / 1e9,
                llama_cpp=dict(version=args.llama_cpp_version, gguf="f32 (routed V4 experts MXFP4)") if llama else None,
                machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count()),
                rows=rows, goal=goal(rows, args.engine_list))


def goal(rows: list[dict], engines: list[str]) -> dict | None:
    """Issue 41's goal: >= 2x llama-server's throughput at concurrency 32, ITL p50 no worse at 1;
    against the better of the llama-server configurations run."""
    peers = [e for e in engines if e in LLAMA_THREADS]
    if not peers or "deepinfer" not in engines:
        return None
    by = {r["concurrency"]: r for r in rows}
    out = {}
    if 32 in by:
        best = max(peers, key=lambda e: by[32][e]["tok_s"])
        ratio = by[32]["deepinfer"]["tok_s"] / by[32][best]["tok_s"]
        out["throughput_c32"] = dict(ratio=ratio, met=ratio >= 2, against=best)
    if 1 in by:
        best = min(peers, key=lambda e: by[1][e]["itl_p50"])
        for engine in [e for e in engines if e.startswith("deepinfer")]:
            ratio = by[1][engine]["itl_p50"] / by[1][best]["itl_p50"]
            out[f"itl_p50_c1_{engine}"] = dict(ratio=ratio, met=ratio <= 1, against=best)
    return out


def print_table(result: dict) -> None:
    print(f"model {result['model']}: {result['prompt_len']}-token random prompts -> {result['max_tokens']} greedy "
          f"tokens (ignore_eos), streamed /v1/completions, rate {result['request_rate']}, {result['threads']} threads "
          f"per server, one server at a time; copy bandwidth {result['copy_bandwidth_GBps']:.1f} GB/s")
    ref = result["engines"][0]
    print(f"| concurrency | engine | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 (ms) | "
          f"tokens per piece | CPU ms/token | vs {ref} tok/s | greedy = {ref} | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        for engine in result["engines"]:
            m = row[engine]
            greedy = m.get(f"greedy_vs_{ref}")
            same = ""
            if greedy is not None:
                same = f"{greedy['equal']}/{greedy['completions']}"
                if greedy["first_differences"]:
                    same += f" (first differ at piece {greedy['median_first_diff_piece']:g}, median)"
            ratio = f"{m[f'tok_s_vs_{ref}']:.2f}x" if f"tok_s_vs_{ref}" in m else ""
            print(f"| {row['concurrency']} | {engine} | {m['tok_s']:.1f} | {m['ttft_p50'] * 1e3:.1f} / "
                  f"{m['ttft_p99'] * 1e3:.1f} | {m['itl_p50'] * 1e3:.2f} / {m['itl_p99'] * 1e3:.2f} | "
                  f"{m['tpot_p50'] * 1e3:.2f} | {m['tokens_per_chunk']:.2f} | {m['cpu_ms_per_token']:.2f} | {ratio} | "
                  f"{same} | {m['load_after'][0]:.1f} |")
        r = row.get("roofline")
        if r is not None:
                print(f"| {row['concurrency']} | roofline | {r['tok_s']:.0f} | | {r['step_floor_ms']:.2f} (a step) "
                      "| | | | | | |")
    for key, g in (result["goal"] or {}).items():
        print(f"goal {key}: {g['ratio']:.2f}x {g['against']} -> {'met' if g['met'] else 'NOT met'}")


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot (pip install matplotlib to get {path})")
        return
    levels = [r["concurrency"] for r in result["rows"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for engine in result["engines"]:
        for ax, key, scale in ((axes[0], "tok_s", 1), (axes[1], "ttft_p50", 1e3), (axes[2], "itl_p50", 1e3)):
            ax.plot(levels, [r[engine][key] * scale for r in result["rows"]], marker="o", label=engine)
    for ax, title in zip(axes, ("output tok/s", "TTFT p50 (ms)", "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"deepinfer serve vs llama-server, {result['model']}, {result['threads']} threads each "
                 "(llama-server-1-thread: 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(args) -> None:
    from peers import in_work_dir

    result = in_work_dir(run, args, "deepinfer_serve_peer_")
    print_table(result)
    path = Path(args.json or REPO / "benchmarks" / "results" / "serve_vs_llama_server.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"json: {path}")
    if args.plot != "":
        plot(result, args.plot or str(path.with_suffix(".png")))
