"""Prefill/decode disaggregation benchmark: a mixed workload (chats, short prompts with long replies,
arriving all along while long prompts arrive; both Poisson, the same times in every leg) through smg, 1 prefill + 1 decode worker (--pd-disaggregation,
on 127.0.0.1 with --transfer-backend's engine: Mooncake over TCP, or NIXL's UCX) against two colocated replicas (round_robin), in one run, at each rate.
Per leg and rate: TTFT and inter-token latency (ITL: the gap between streamed events, shared among
the tokens an event brings) p50/p99 at the client, output throughput; for
the P/D leg also the decode state moved per request and its transfer time against the raw bandwidth
of the same transfer engine (one write of the same size between two engines in this process).
Writes JSON (and a plot when matplotlib is installed).

    python benchmarks/disagg.py                       # tiny-dsv4, rates 0.5,1,2
    python benchmarks/disagg.py --rates 0.25,0.5,1,2 --long-words 900
    python benchmarks/disagg.py --transfer-backend nixl --out benchmarks/results/disagg_nixl.json

Each worker runs on a core of its own (prefill on core 0 and decode on core 1; replica i on core i;
--no-pin: anywhere), as the issue's set-up has it; smg and the client share both cores with them,
so the gain disaggregation brings on separate machines (decode never waits behind a long prefill) is
only partly visible, and the transfer runs over loopback TCP, not RDMA. The JSON records the core
count and load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "server")]  # pd.py, fleet.py and the conftest they import
from conftest import running_server  # noqa: E402
from fleet import running_servers, running_smg  # noqa: E402
from pd import disagg_stats, pd_args, running_pd_smg, running_prefill  # noqa: E402

from deepinfer.llm import TINY_DSV4_DIR  # noqa: E402

TRANSPORTS = {"mooncake": "mooncake tcp 127.0.0.1", "nixl": "nixl ucx 127.0.0.1 (shared memory / tcp)"}
WORDS = "cache page router worker token prefix replica engine request stream latency batch decode prefill".split()
CHAT_SECONDS_PER_TOKEN = 0.003  # about a decode step of tiny-dsv4 here: sets the default chat arrival rate


def _percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q * 100)) if values else None


async def _request(session, url: str, text: str, max_tokens: int, start: float, samples: list, kind: str) -> None:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    body = {"text": text, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}}
    sent = time.perf_counter()
    first, last, seen, itl = None, None, 0, []
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            n = len(json.loads(line[6:])["output_ids"])
            now = time.perf_counter()
            if first is None:
                first = now
            elif n > seen:  # an event with several tokens (multi-step decoding): the gap is shared among them
                itl += [(now - last) / (n - seen)] * (n - seen)
            last, seen = now, n
    samples.append({"kind": kind, "ttft": first - sent, "itl": itl, "tokens": seen})


async def _drive(url: str, rate: float, args, tag: str) -> dict:
    import aiohttp

    rng = random.Random(f"{tag}/{args.seed}")  # texts of this leg's own (no leg is served from another's cache)
    arrivals = random.Random(f"{rate}/{args.seed}")  # the same arrival times in every leg
    t0 = time.perf_counter() + 0.2
    jobs = []
    t = t0
    for i in range(args.long_prompts):  # long prompts, Poisson arrivals while the chats decode
        t += arrivals.expovariate(rate)
        jobs.append((f"[{tag} long {i}] " + " ".join(rng.choice(WORDS) for _ in range(args.long_words)),
                     args.long_tokens, t, "long"))
    # chats (short prompt, long reply) arrive from the start until the last long prompt is in, at a
    # rate that keeps about --decoders of them decoding: the same open-loop load (and so the same
    # throughput, while a leg keeps up) in every leg
    chat_rate = args.chat_rate or args.decoders / (args.decode_tokens * CHAT_SECONDS_PER_TOKEN)
    last_long, t, i = t, t0, 0
    while t < last_long + 0.3:
        jobs.append((f"[{tag} chat {i}] " + " ".join(rng.choice(WORDS) for _ in range(20)), args.decode_tokens, t,
                     "chat"))
        t += arrivals.expovariate(chat_rate)
        i += 1
    samples: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        began = time.perf_counter()
        await asyncio.gather(*(_request(session, url, text, n, start, samples, kind) for text, n, start, kind in jobs))
        seconds = time.perf_counter() - began
    itl = [x for s in samples if s["kind"] == "chat" for x in s["itl"]]
    ttft = [s["ttft"] for s in samples if s["kind"] == "long"]
    tokens = sum(s["tokens"] for s in samples)
    return {"rate": rate, "requests": len(samples), "output_tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds, "ttft_long_p50": _percentile(ttft, 0.5),
            "ttft_long_p99": _percentile(ttft, 0.99),
            "itl_chat_p50": _percentile(itl, 0.5), "itl_chat_p99": _percentile(itl, 0.99)}


def _raw_destination(nbytes: int, conn, backend: str) -> None:
    """The receiving side of raw_bandwidth, in its own process (as a decode worker is)."""
    import torch

    from deepinfer.kv.transfer import make_transport

    engine = make_transport(backend, "127.0.0.1", receives=True)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    engine.register(buf.data_ptr(), nbytes)
    conn.send((engine.session_id, buf.data_ptr()))
    conn.recv()  # the writer is done
    conn.send(bool(buf.all()))


def raw_bandwidth(nbytes: int, segments: int = 1, repeats: int = 7, gap: float = 0.0, busy_python: bool = False,
                  switch_interval: float | None = None, backend: str = "mooncake") -> dict:
    """The transfer engine's own write bandwidth over loopback between two processes: `nbytes` in
    `segments` equal writes of one batch (the per-request transfers are batches of several segments).
    `gap`: seconds of idle before each write, as between requests (back to back, the engine's threads
    and the socket stay warm; disagg.json has both). `busy_python`: a thread running Python beside the
    writer, as a worker's engine thread does: the write gives up the GIL and waits to take it back
    (up to `switch_interval`, Python's default 5 ms, when given none)."""
    import multiprocessing

    import torch

    from deepinfer.kv.transfer import make_transport

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_raw_destination, args=(nbytes, there, backend), daemon=True)
    proc.start()
    try:
        session, address = here.recv()
        engine = make_transport(backend, "127.0.0.1")
        buf = torch.ones(nbytes, dtype=torch.uint8)
        engine.register(buf.data_ptr(), nbytes)
        size = nbytes // segments
        src = [buf.data_ptr() + i * size for i in range(segments)]
        dst = [address + i * size for i in range(segments)]
        times, spinning = [], threading.Event()
        if busy_python:
            spinning.set()
            threading.Thread(target=_spin, args=(spinning,), daemon=True).start()
        interval = sys.getswitchinterval()
        if switch_interval is not None:
            sys.setswitchinterval(switch_interval)
        try:
            for _ in range(repeats):
                time.sleep(gap)
                t0 = time.perf_counter()
                engine.write(session, src, dst, [size] * segments)
                times.append(time.perf_counter() - t0)
        finally:
            spinning.clear()
            sys.setswitchinterval(interval)
        here.send("done")
        assert here.recv() or segments * size < nbytes, "the raw write did not arrive"
    finally:
        proc.join(30)
    best, median = min(times), sorted(times)[len(times) // 2]
    return {"bytes": size * segments, "segments": segments, "seconds_best": best, "seconds_median": median,
            "gib_s_best": size * segments / best / (1 << 30), "gib_s_median": size * segments / median / (1 << 30)}


def _spin(running: threading.Event) -> None:
    while running.is_set():
        pass


def gil_probe(nbytes: int, segments: int, repeats: int = 21) -> dict:
    """The same write (a P/D run's mean request) from an idle writer process, beside a thread
    running Python, and beside it with a 0.5 ms switch interval."""
    return {"idle": raw_bandwidth(nbytes, segments, repeats),
            "beside_busy_python": raw_bandwidth(nbytes, segments, repeats, busy_python=True),
            "beside_busy_python_switch_0.5ms": raw_bandwidth(nbytes, segments, repeats, busy_python=True,
                                                            switch_interval=0.0005)}


def _pin(servers, pin: bool) -> None:
    """Worker i's every thread on core i (the threads it starts later inherit it): one core per worker,
    as the issue's set-up has it; smg and the client run on either core."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < len(servers):
        return
    for core, server in zip(cores, servers):
        for tid in os.listdir(f"/proc/{server.proc.pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except ProcessLookupError:  # a thread that ended meanwhile
                pass


@contextmanager
def _pd_leg(worker_args, backend: str, pin: bool):
    with running_prefill(*worker_args, timeout=60, backend=backend) as prefill, \
            running_server(*worker_args, *pd_args("decode", timeout=60, backend=backend)) as decode, \
            running_pd_smg(prefill, decode) as router:
        _pin([prefill.server, decode], pin)
        yield router.url, prefill, decode


@contextmanager
def _colocated_leg(worker_args, backend: str, pin: bool):
    with running_servers(2, *worker_args) as workers, running_smg([w.url for w in workers], "round_robin") as router:
        _pin(workers, pin)
        yield router.url, None, None


def _plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for leg, rows in results.items():
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["itl_chat_p99"] * 1e3 for r in rows], marker="o", label=leg)
        axes[1].plot(rates, [r["ttft_long_p50"] for r in rows], marker="o", label=leg)
        axes[2].plot(rates, [r["tok_s"] for r in rows], marker="o", label=leg)
    for ax, title in zip(axes, ("chat ITL p99 (ms)", "long-prompt TTFT p50 (s)", "output tok/s")):
        ax.set_title(title)
        ax.set_xlabel("long prompts / s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=TINY_DSV4_DIR)
    parser.add_argument("--rates", default="0.5,1,2", help="long-prompt arrivals per second, comma-separated")
    parser.add_argument("--decoders", type=int, default=4,
                        help="chats (short prompt, long reply) decoding at a time, on average: sets their arrival "
                             "rate unless --chat-rate does")
    parser.add_argument("--chat-rate", type=float, default=0.0, help="chat arrivals per second (Poisson)")
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-words", type=int, default=600)
    parser.add_argument("--long-tokens", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transfer-backend", choices=sorted(TRANSPORTS), default="mooncake",
                        help="the P/D pair's --disaggregation-transfer-backend (and the raw transfer's engine)")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave the workers' threads on every core (default: worker i on core i)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "disagg.json"))
    parser.add_argument("--gil-probe", action="store_true",
                        help="only time one write (--probe-bytes in --probe-segments) idle and beside a thread running "
                             "Python, to --out (e.g. benchmarks/results/transfer_gil.json)")
    parser.add_argument("--probe-bytes", type=int, default=508359, help="default: disagg.json's mean request")
    parser.add_argument("--probe-segments", type=int, default=21)
    args = parser.parse_args(argv)
    if args.gil_probe:
        probe = {"config": {"bytes": args.probe_bytes, "segments": args.probe_segments, "cpu_count": os.cpu_count(),
                            "load_average_at_start": os.getloadavg(), "transport": "mooncake tcp 127.0.0.1"},
                 "results": gil_probe(args.probe_bytes, args.probe_segments)}
        with open(args.out, "w") as f:
            json.dump(probe, f, indent=2)
        print(json.dumps(probe, indent=2))
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    load_at_start = os.getloadavg()  # the machine's other work: this benchmark's figures move with it
    worker_args = ("--model", args.model, "--max-num-seqs", str(args.max_num_seqs))
    results: dict[str, list[dict]] = {}
    transfer: dict = {}
    for leg, make in (("pd_1p1d", _pd_leg), ("colocated_2x", _colocated_leg)):
        with make(worker_args, args.transfer_backend, not args.no_pin) as (url, prefill, decode):
            asyncio.run(_drive(url, 100.0, argparse.Namespace(**{**vars(args), "long_prompts": 2, "decoders": 2}),
                               f"warm-up {leg}"))  # kernels and step graphs are built outside the measurement
            before = disagg_stats(decode) if decode is not None else None
            prefill_before = disagg_stats(prefill) if prefill is not None else None
            for rate in rates:
                row = asyncio.run(_drive(url, rate, args, f"{leg}@{rate}"))
                results.setdefault(leg, []).append(row)
                print(f"{leg:13s} rate {rate:4.2f}/s  chat ITL p50 {row['itl_chat_p50'] * 1e3:7.1f} ms "
                      f"p99 {row['itl_chat_p99'] * 1e3:7.1f} ms  long TTFT p50 {row['ttft_long_p50']:.3f} s  "
                      f"{row['tok_s']:.1f} tok/s", flush=True)
            if decode is not None:
                after, prefill_after = disagg_stats(decode), disagg_stats(prefill)
                n = after["transfers"] - before["transfers"]
                moved = after["bytes"] - before["bytes"]
                secs = after["seconds"] - before["seconds"]
                transfer = {"transfers": n, "bytes_per_request": moved / n, "seconds_per_request": secs / n,
                            "segments_per_request": (after["segments"] - before["segments"]) / n,
                            # of which inside the transfer engine's write call (the rest: thread hand-off on a
                            # busy prefill process, segment planning)
                            "write_seconds_per_request":
                                (prefill_after["write_seconds"] - prefill_before["write_seconds"]) / n,
                            "gib_s": moved / secs / (1 << 30) if secs else None,
                            # written by the prefill's engine thread itself (NIXL; the rest on a thread)
                            "inline_share": (prefill_after.get("inline_writes", 0)
                                             - prefill_before.get("inline_writes", 0)) / n}
    same = max(int(transfer["bytes_per_request"]), 1)
    backend = args.transfer_backend
    transfer["raw_same_size_one_segment"] = raw_bandwidth(same, backend=backend)
    transfer["raw_same_size_same_segments"] = raw_bandwidth(same, max(round(transfer["segments_per_request"]), 1),
                                                            backend=backend)
    transfer["raw_same_size_same_segments_spaced"] = raw_bandwidth(
        same, max(round(transfer["segments_per_request"]), 1), gap=1.0 / max(rates), backend=backend)
    transfer["raw_64mib"] = raw_bandwidth(64 << 20, backend=backend)
    transfer["share_of_raw_same_size_same_segments"] = \
        transfer["gib_s"] / transfer["raw_same_size_same_segments"]["gib_s_median"]
    transfer["share_of_raw_same_size_same_segments_spaced"] = \
        transfer["gib_s"] / transfer["raw_same_size_same_segments_spaced"]["gib_s_median"]
    compare = {"itl_p99_colocated_over_pd": [c["itl_chat_p99"] / p["itl_chat_p99"] for p, c in
                                             zip(results["pd_1p1d"], results["colocated_2x"])],
               "tok_s_pd_over_colocated": [p["tok_s"] / c["tok_s"] for p, c in
                                           zip(results["pd_1p1d"], results["colocated_2x"])]}
    shown = {**vars(args), "model": os.path.relpath(args.model, REPO), "out": os.path.relpath(args.out, REPO)}
    report = {"config": {**shown, "rates": rates, "cpu_count": os.cpu_count(), "load_average_at_start": load_at_start,
                         "load_average_at_end": os.getloadavg(), "transport": TRANSPORTS[args.transfer_backend]},
              "results": results, "transfer": transfer, "compare": compare}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    plot = _plot(results, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({"transfer": transfer, "compare": compare}, indent=2))
    print(f"wrote {args.out}" + (f" and {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
