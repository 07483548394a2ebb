"""Encoder-worker benchmark (E/P/D's encode leg): what sending a worker's images to an encoder worker
costs and what it buys, against the same worker encoding its images itself, in one run.

Legs, on DeepSeek-V4.1 with a vision tower (default: tests/goldens/v41/mini6vl, a 2-layer tower):
- colocated: one worker, 2 compute threads, encoding its own images;
- encoder+worker/<engine>: one encoder worker (--disaggregation-mode encode, 1 thread) and one worker
  with --encoder-urls (1 thread), per transfer engine (Mooncake over TCP, NIXL's UCX).
Workload: --streams text chats decode, each followed by the next, while image chats (--images fresh
random images each, never cached) arrive, Poisson at --rate per second. Per leg: the image chats' TTFT p50/p99, the
text streams' inter-token latency p50/p99 and throughput; for the encoder legs the encoder's time per
call (its tower pass, its write) and bytes, and the write against the same transfer engine's raw
write of the same bytes in the same segments (benchmarks/disagg.py raw_bandwidth, spaced like the
calls); and the same image chats one at a time on the idle leg (TTFT, and the encoder's times without
contention). Writes JSON.

    python benchmarks/epd.py
    python benchmarks/epd.py --rate 4 --images 2 --transfer-backends mooncake

On 2 shared cores with a 2-layer tower the encoder's pass is short, so what this shows is the cost of
the indirection (HTTP call, write, arena copy) more than the benefit a real tower's seconds of
compute would bring off the worker's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import sys
import time
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "server"), os.path.join(REPO, "tests"), os.path.dirname(__file__)]
from conftest import running_server  # noqa: E402
from disagg import _percentile, raw_bandwidth  # noqa: E402
from pd import disagg_stats  # noqa: E402
from v41_goldens import VL_CONFIG, checkpoint_dir  # noqa: E402

WORDS = "cache page router worker token prefix replica engine request stream latency batch decode prefill".split()


def _png(rng: random.Random, size: int) -> bytes:
    from PIL import Image

    image = Image.frombytes("RGB", (size, size), bytes(rng.getrandbits(8) for _ in range(size * size * 3)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def _stream(session, url: str, body: dict, route: str, start: float) -> dict:
    """One streamed request at `start`: its TTFT and the gaps between its tokens."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    sent = time.perf_counter()
    first, last, seen, itl = None, None, 0, []
    async with session.post(url + route, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("delta", {}).get("role"):
                continue  # the chat stream's opening chunk: sent before any token
            n = len(event["output_ids"]) if "output_ids" in event else seen + 1
            now = time.perf_counter()
            if first is None:
                first = now
            elif n > seen:  # several tokens in one event: the gap is shared among them
                itl += [(now - last) / (n - seen)] * (n - seen)
            last, seen = now, n
    return {"ttft": first - sent, "itl": itl, "tokens": seen}


async def _text_loop(session, url: str, rng: random.Random, tag: str, args, until: float, out: list) -> None:
    """One text chat after another, each decoding --decode-tokens, until `until`."""
    while time.perf_counter() < until:
        text = f"[{tag} chat] " + " ".join(rng.choice(WORDS) for _ in range(20))
        body = {"text": text, "stream": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": args.decode_tokens, "ignore_eos": True}}
        out.append(await _stream(session, url, body, "/generate", 0.0))


async def _drive(url: str, args, tag: str, requests: int) -> dict:
    import aiohttp

    rng = random.Random(f"{tag}/{args.seed}")  # this leg's own images and texts: nothing is cached across legs
    arrivals = random.Random(args.seed)  # the same arrival times in every leg
    t0 = time.perf_counter() + 0.5  # the text streams run from the start, the image chats arrive from t0
    jobs, at = [], t0
    for i in range(requests):
        at += arrivals.expovariate(args.rate)
        parts = [{"type": "text", "text": f"[{tag} image chat {i}] compare"}]
        for _ in range(args.images):
            data = base64.b64encode(_png(rng, args.image_size)).decode()
            parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}})
        jobs.append(({"model": "m", "messages": [{"role": "user", "content": parts}], "stream": True,
                      "max_tokens": 2, "temperature": 0.0}, at))
    until = at + 0.2  # the text streams cover every arrival
    text: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        began = time.perf_counter()
        loops = [_text_loop(session, url, random.Random(f"{tag}/{k}"), f"{tag} {k}", args, until, text)
                 for k in range(args.streams)]
        image = await asyncio.gather(*(_stream(session, url, body, "/v1/chat/completions", start)
                                       for body, start in jobs), *loops)
        wall = time.perf_counter() - began
    image = image[:len(jobs)]
    itl = [g for d in text for g in d["itl"]]
    ttft = [d["ttft"] for d in image]
    return {"image_requests": len(image), "ttft_image_p50": _percentile(ttft, 0.5),
            "ttft_image_p99": _percentile(ttft, 0.99), "itl_text_p50": _percentile(itl, 0.5),
            "itl_text_p99": _percentile(itl, 0.99), "text_requests": len(text),
            "text_tok_s": sum(d["tokens"] for d in text) / wall, "wall_s": wall}


def _idle_calls(worker, encoder, args, tag: str, n: int = 12) -> dict:
    """n image chats one after another on an otherwise idle leg: TTFT without contention and, with an
    encoder, its per-call tower, write and round-trip times."""
    before = disagg_stats(encoder) if encoder is not None else None
    worker_before = disagg_stats(worker).get("encoders")
    ttft = []
    for i in range(n):
        one = argparse.Namespace(**{**vars(args), "streams": 0, "rate": 1000.0})
        ttft.append(asyncio.run(_drive(worker.url, one, f"{tag} idle {i}", 1))["ttft_image_p50"])
    out = {"ttft_p50": _percentile(ttft, 0.5), "calls": 0}
    if encoder is not None:
        after, worker_after = disagg_stats(encoder), disagg_stats(worker)["encoders"]
        calls = after["calls"] - before["calls"]
        totals = {k: after[k] - before[k] for k in ("items", "bytes", "encode_seconds", "write_seconds")}
        totals["round_trip_seconds"] = worker_after["seconds"] - worker_before["seconds"]
        out.update(calls=calls, per_call={k: v / calls for k, v in totals.items()})
    return out


@contextmanager
def _colocated(args):
    with running_server(*_worker_args(args), env={"DEEPINFER_CPU_THREADS": "2"}) as worker:
        yield worker, None


@contextmanager
def _with_encoder(args, backend: str):
    encoder_args = ("--model", args.model, "--disaggregation-mode", "encode", "--disaggregation-transfer-backend",
                    backend)
    with running_server(*encoder_args, env={"DEEPINFER_CPU_THREADS": "1"}) as encoder, \
            running_server(*_worker_args(args), "--encoder-urls", encoder.url, "--disaggregation-transfer-backend",
                           backend, env={"DEEPINFER_CPU_THREADS": "1"}) as worker:
        yield worker, encoder


def _worker_args(args) -> tuple[str, ...]:
    return ("--model", args.model, "--served-model-name", "m", "--max-num-seqs", str(args.streams + 4),
            "--max-model-len", "512")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(checkpoint_dir(VL_CONFIG)))
    parser.add_argument("--rate", type=float, default=4.0, help="image chats per second")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of image arrivals")
    parser.add_argument("--images", type=int, default=2, help="images per image chat")
    parser.add_argument("--image-size", type=int, default=64, help="pixels per side of the random images")
    parser.add_argument("--streams", type=int, default=4, help="text chats decoding meanwhile")
    parser.add_argument("--decode-tokens", type=int, default=256, help="tokens per text chat (one after another)")
    parser.add_argument("--transfer-backends", default="mooncake,nixl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "epd.json"))
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()
    requests = max(1, round(args.rate * args.duration))
    legs = [("colocated", lambda: _colocated(args), None)]
    legs += [(f"encoder+worker/{b}", (lambda b=b: _with_encoder(args, b)), b) for b in args.transfer_backends.split(",")]
    results, encode = {}, {}
    for name, make, backend in legs:
        with make() as (worker, encoder):
            asyncio.run(_drive(worker.url, argparse.Namespace(**{**vars(args), "streams": 1, "decode_tokens": 8}),
                               f"warm-up {name}", 2))
            before = disagg_stats(encoder) if encoder is not None else None
            worker_before = disagg_stats(worker).get("encoders")
            row = asyncio.run(_drive(worker.url, args, name, requests))
            results[name] = row
            print(f"{name:26s} image TTFT p50 {row['ttft_image_p50'] * 1e3:7.1f} ms p99 "
                  f"{row['ttft_image_p99'] * 1e3:7.1f} ms  text ITL p50 {row['itl_text_p50'] * 1e3:6.2f} ms p99 "
                  f"{row['itl_text_p99'] * 1e3:6.2f} ms  {row['text_tok_s']:.1f} tok/s", flush=True)
            if encoder is not None:
                after, worker_after = disagg_stats(encoder), disagg_stats(worker)["encoders"]
            idle = _idle_calls(worker, encoder, args, name)  # then the same image chats one at a time, alone
            row["ttft_image_idle_p50"] = idle["ttft_p50"]
            if encoder is not None:
                calls = after["calls"] - before["calls"]
                per_call = {k: (after[k] - before[k]) / calls for k in ("items", "bytes", "encode_seconds",
                                                                         "write_seconds")}
                per_call["round_trip_seconds"] = (worker_after["seconds"] - worker_before["seconds"]) / calls
                raw = raw_bandwidth(max(int(per_call["bytes"]), 1), max(round(per_call["items"]), 1), repeats=9,
                                    gap=1.0 / args.rate, backend=backend)
                encode[name] = {"calls": calls, "per_call": per_call, "idle_per_call": idle["per_call"],
                                "raw_same_bytes_spaced": raw,
                                "write_share_of_raw": raw["seconds_median"] / per_call["write_seconds"],
                                "encoded_locally": worker_after["encoded_locally"]}
                print(f"{'':26s} per call: {per_call['items']:.1f} images, {per_call['bytes']:.0f} bytes, tower "
                      f"{per_call['encode_seconds'] * 1e3:.2f} ms, write {per_call['write_seconds'] * 1e3:.2f} ms "
                      f"(raw {raw['seconds_median'] * 1e3:.2f} ms), round trip "
                      f"{per_call['round_trip_seconds'] * 1e3:.2f} ms; alone: round trip "
                      f"{idle['per_call']['round_trip_seconds'] * 1e3:.2f} ms, tower "
                      f"{idle['per_call']['encode_seconds'] * 1e3:.2f} ms", flush=True)
    base = results["colocated"]
    compare = {name: {"ttft_image_p50_over_colocated": r["ttft_image_p50"] / base["ttft_image_p50"],
                      "ttft_image_idle_p50_over_colocated": r["ttft_image_idle_p50"] / base["ttft_image_idle_p50"],
                      "itl_text_p99_colocated_over_this": base["itl_text_p99"] / r["itl_text_p99"],
                      "text_tok_s_over_colocated": r["text_tok_s"] / base["text_tok_s"]}
               for name, r in results.items() if name != "colocated"}
    shown = {**vars(args), "model": os.path.relpath(args.model, REPO), "out": os.path.relpath(args.out, REPO)}
    report = {"config": {**shown, "image_requests": requests, "cpu_count": os.cpu_count(),
                         "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
              "results": results, "encode": encode, "compare": compare}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({"encode": encode, "compare": compare}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
