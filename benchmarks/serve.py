"""Serving benchmark, like `vllm bench serve`: Poisson arrivals at several request rates against
`deepinfer serve` (streamed /v1/completions through the openai client), then `LLM.generate` on
the same prompts in the same run: what the server path costs. Prints a table, writes JSON and,
when matplotlib is installed, a plot of latency against rate.

    python benchmarks/serve.py                              # starts a server on tiny-dsv4
    python benchmarks/serve.py --rates 2,8,inf --num-prompts 64
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --served-model-name tiny-dsv4
    python benchmarks/serve.py --peer llama-server          # against llama.cpp's server: benchmarks/serve_peer.py

Every request: a random-token prompt, greedy, `ignore_eos`, exactly --max-tokens new tokens.
TTFT is measured at the client (request sent -> first streamed text), TPOT over the rest of the
stream; the client runs in this process, on the same machine as the server. The offline row runs
after the server is stopped, so the two never share the CPU; its latencies are the engine's own
(all prompts submitted at once). Wall-clock figures move with whatever else the machine runs, so
CPU seconds per generated token are reported too: the server process's (engine thread + HTTP),
the client's, and LLM.generate's (Linux /proc; only for a server this script started).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from throughput import _prompts  # noqa: E402  (the same random-token prompts as the throughput benchmark)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _summary(ttft, tpot, e2e, tokens: int, seconds: float, n: int, itl=None) -> dict:
    out = dict(requests=n, output_tokens=tokens, seconds=seconds, tok_s=tokens / seconds, req_s=n / seconds,
               ttft_p50=_percentile(ttft, 0.5), ttft_p99=_percentile(ttft, 0.99),
               tpot_p50=_percentile(tpot, 0.5), tpot_p99=_percentile(tpot, 0.99), e2e_p50=_percentile(e2e, 0.5))
    if itl is not None:
        out.update(itl_p50=_percentile(itl, 0.5), itl_p99=_percentile(itl, 0.99))
    return out


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a process, all threads (Linux)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_server(model: str, port: int, max_num_seqs: int, env: dict | None = None) -> subprocess.Popen:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    return start_process([sys.executable, "-m", "deepinfer", "serve", "--model", model, "--port", str(port),
                          "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"], port, env)


def start_process(cmd: list[str], port: int, env: dict | None = None, log=None) -> subprocess.Popen:
    """Start a server process in its own session and wait until GET /health answers 200."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=log)
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                time.sleep(0.5)  # polling for the port to open (llama-server answers 503 while loading)
        raise SystemExit(f"{cmd[0]} did not start within 600 s")
    except BaseException:
        stop_process(proc)
        raise


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: when it was sent, when each piece of text arrived, and the
    completion tokens the final usage chunk counts."""
    sent = time.perf_counter()
    chunks: list[tuple[float, str]] = []
    n = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            chunks.append((time.perf_counter(), chunk.choices[0].text))
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return dict(sent=sent, done=time.perf_counter(), tokens=n, chunks=chunks)


async def drive(base_url: str, model: str, prompts, max_tokens: int, rate: float, seed: int,
                max_concurrency: int | None = None, warmup: list | None = None) -> tuple[list[dict], float]:
    """Send `prompts` with Poisson arrivals at `rate` (inf: all at once), at most `max_concurrency`
    in flight, after the `warmup` prompts (sent together, 4 tokens each); -> (each request's
    record, seconds from the first arrival to the last completion)."""
    import openai

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))

    async def limited(prompt):
        async with limit:
            return await _one(client, model, prompt, max_tokens)

    # the client's default retries: a server may close an idle kept-alive connection as it is reused
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=2, timeout=600) as client:
        await asyncio.gather(*(_one(client, model, p, 4) for p in (warmup or prompts[:1])))
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
    return results, max(r["done"] for r in results) - start


def summarize(results: list[dict], seconds: float) -> dict:
    """Throughput and latency percentiles of drive()'s records. TTFT: sent -> first text; TPOT: the
    rest of the stream over the tokens after the first; ITL: the gaps between consecutive pieces
    of streamed text (vLLM's definition: a piece carrying several tokens is one gap)."""
    streamed = [r for r in results if r["chunks"]]
    ttft = [r["chunks"][0][0] - r["sent"] for r in streamed]
    tpot = [(r["done"] - r["chunks"][0][0]) / (r["tokens"] - 1) for r in streamed if r["tokens"] > 1]
    itl = [b[0] - a[0] for r in streamed for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["done"] - r["sent"] for r in results]
    out = _summary(ttft, tpot, e2e, sum(r["tokens"] for r in results), seconds, len(results), itl)
    out["tokens_per_chunk"] = out["output_tokens"] / max(1, sum(len(r["chunks"]) for r in results))
    return out


async def _at_rate(base_url: str, model: str, prompts, max_tokens: int, rate: float, seed: int) -> dict:
    results, seconds = await drive(base_url, model, prompts, max_tokens, rate, seed)
    return summarize(results, seconds)


def _offline(model: str, prompts, max_tokens: int, max_num_seqs: int) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    llm.close()
    ttft = [o.time_to_first_token for o in outs]
    tpot = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
    e2e = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(_summary(ttft, tpot, e2e, tokens, seconds, len(outs)), cpu_ms_per_token=cpu * 1e3 / tokens,
                client_cpu_ms_per_token=None)


def _plot(rows: list[dict], offline: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot (pip install matplotlib to get {path})")
        return
    finite = [r for r in rows if r["rate"] != "inf"]
    xs = [r["rate"] for r in finite]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99")):
        a.plot(xs, [r[key] * 1e3 for r in finite], marker="o", label=label)
    for key, label in (("tpot_p50", "TPOT p50"), ("tpot_p99", "TPOT p99")):
        b.plot(xs, [r[key] * 1e3 for r in finite], marker="o", label=label)
    b.axhline(offline["tpot_p50"] * 1e3, color="gray", linestyle="--", label="LLM.generate TPOT p50")
    for ax, title in ((a, "time to first token"), (b, "time per output token")):
        ax.set_xscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def build_parser() -> argparse.ArgumentParser:
    import serve_peer  # --peer llama-server (it imports this module's client)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: tiny-dsv4, the README's figures)")
    parser.add_argument("--base-url", default=None, help="a running server (default: start one for the run)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--rates", default="1,4,16,inf", help="requests per second; inf = all at once")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="requests per rate (--peer: per concurrency level C, at least 2C)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="default: benchmarks/results/serve.json "
                                                     "(--peer: serve_vs_llama_server.json)")
    parser.add_argument("--plot", default=None, help="default: the JSON's path with .png; '' for none")
    serve_peer.add_arguments(parser)
    return parser


def main() -> None:
    import serve_peer

    parser = build_parser()
    args = parser.parse_args()
    if args.peer:
        serve_peer.check_arguments(parser, args)
        return serve_peer.main(args)
    args.json = args.json or "benchmarks/results/serve.json"
    args.plot = "benchmarks/results/serve.png" if args.plot is None else args.plot
    from deepinfer.llm import TINY_DSV4_DIR

    model = args.model or TINY_DSV4_DIR
    shown = model if os.path.relpath(model).startswith("..") else os.path.relpath(model)  # for the table and JSON
    name = args.served_model_name or os.path.basename(os.path.normpath(model))
    from deepinfer.models.registry import load_config

    vocab = load_config(model)[0].vocab_size  # the family's parser: V4.1 nests its text config
    prompts = _prompts(vocab, args.num_prompts, args.prompt_len)
    proc = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        proc = _start_server(model, port, args.max_num_seqs)
        base_url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for rate in [float(r) for r in args.rates.split(",")]:
            server_cpu, client_cpu = _cpu_seconds(proc.pid) if proc else None, time.process_time()
            row = asyncio.run(_at_rate(base_url, name, prompts, args.max_tokens, rate, args.seed))
            row["client_cpu_ms_per_token"] = (time.process_time() - client_cpu) * 1e3 / row["output_tokens"]
            row["cpu_ms_per_token"] = None if server_cpu is None else \
                (_cpu_seconds(proc.pid) - server_cpu) * 1e3 / row["output_tokens"]  # includes the warm-up request
            rows.append(dict(rate="inf" if rate == float("inf") else rate, **row))
    finally:
        if proc is not None:
            stop_process(proc)
    offline = _offline(model, prompts, args.max_tokens, args.max_num_seqs)
    load = os.getloadavg()[0]  # this benchmark's numbers move with whatever else the machine runs
    print(f"model: {shown}  {args.num_prompts} requests per rate, prompt {args.prompt_len} random tokens, "
          f"{args.max_tokens} new tokens, greedy, ignore_eos; client and server on this machine "
          f"({os.cpu_count()} cpus, 1-min load average {load:.1f} at the end)")
    print("| rate (req/s) | engine | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | "
          "e2e p50 (s) | CPU ms/token | client CPU ms/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def ms(value) -> str:
        return "" if value is None else f"{value:.2f}"

    for rate, engine, r in [(r["rate"], "server", r) for r in rows] + [("all at once", "LLM.generate", offline)]:
        print(f"| {rate} | {engine} | {r['tok_s']:.1f} | {r['ttft_p50'] * 1e3:.1f} | {r['ttft_p99'] * 1e3:.1f} | "
              f"{r['tpot_p50'] * 1e3:.2f} | {r['tpot_p99'] * 1e3:.2f} | {r['e2e_p50']:.2f} | "
              f"{ms(r['cpu_ms_per_token'])} | {ms(r['client_cpu_ms_per_token'])} |")
    burst = next((r for r in rows if r["rate"] == "inf"), None)
    if burst is not None:
        print(f"server at rate inf / LLM.generate: {burst['tok_s'] / offline['tok_s']:.2f}x output throughput"
              + ("" if burst["cpu_ms_per_token"] is None else
                 f", {burst['cpu_ms_per_token'] / offline['cpu_ms_per_token']:.2f}x CPU per token"))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(model=shown, cpus=os.cpu_count(), load_average=load, num_prompts=args.num_prompts,
                       prompt_len=args.prompt_len,
                       max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs, server=rows, offline=offline),
                  f, indent=2)
    if args.plot:
        _plot(rows, offline, args.plot)


if __name__ == "__main__":
    main()
