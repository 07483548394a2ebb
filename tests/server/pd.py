"""A prefill worker, a decode worker and smg in --pd-disaggregation mode on 127.0.0.1 (each a
subprocess, stopped by the context managers), and what tests and benchmarks/disagg.py read of them."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass

from conftest import Server, free_port, http, running_server, wait_until
from fleet import running_smg

# short timeouts, so that a fault test ends in seconds (the default is 30 s)
TRANSFER_TIMEOUT_S = 6


def pd_args(mode: str, *, bootstrap_port: int | None = None, timeout: float = TRANSFER_TIMEOUT_S,
            backend: str = "mooncake") -> tuple[str, ...]:
    args = ("--disaggregation-mode", mode, "--disaggregation-transfer-timeout", str(timeout),
            "--disaggregation-transfer-backend", backend)
    return args + (("--disaggregation-bootstrap-port", str(bootstrap_port)) if bootstrap_port else ())


@dataclass
class Prefill:
    server: Server
    bootstrap_port: int

    @property
    def url(self) -> str:
        return self.server.url


@contextmanager
def running_prefill(*args: str, timeout: float = TRANSFER_TIMEOUT_S, backend: str = "mooncake", env: dict | None = None):
    """A prefill worker and its bootstrap port."""
    port = free_port()
    with running_server(*args, *pd_args("prefill", bootstrap_port=port, timeout=timeout, backend=backend),
                        env=env) as server:
        yield Prefill(server, port)


def disagg_stats(server: Server | Prefill) -> dict:
    """The worker's role and transfer counters (/server_info's `disaggregation`)."""
    return json.loads(http(server.url + "/server_info")[1])["disaggregation"]


def used_tokens(server: Server | Prefill) -> int:
    """Cache tokens held by requests (pages x page size; idle prefix-cache pages are free)."""
    return json.loads(http(server.url + "/v1/loads")[1])["loads"][0]["num_used_tokens"]


def settled(prefill: Prefill, decode: Server) -> None:
    """Nothing held on either side once every request has ended (pages, slots, rooms)."""
    def clean():
        p, d = disagg_stats(prefill), disagg_stats(decode)
        return p["held_requests"] == 0 and d["receiving"] == 0 and used_tokens(prefill) == 0 and used_tokens(decode) == 0
    wait_until(clean, TRANSFER_TIMEOUT_S * 3, "prefill and decode to hold no pages, slots or rooms", interval=0.2)


def running_pd_smg(prefill: Prefill, decode: Server):
    """smg launch --pd-disaggregation over one prefill (with its bootstrap port) and one decode."""
    return running_smg([prefill.url, decode.url], "round_robin", worker_flags=[
        "--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url])


@dataclass
class Generated:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish: dict | None


def generate(url: str, text: str, sampling: dict, stream: bool = False, **extra) -> Generated:
    """POST /generate (SGLang's route, what smg's PD mode forwards), whole or streamed."""
    body = json.dumps({"text": text, "sampling_params": sampling, "stream": stream, **extra}).encode()
    status, raw = http(url + "/generate", body, {"content-type": "application/json"}, timeout=120)
    assert status == 200, raw
    if not stream:
        out = json.loads(raw)
    else:  # each event carries the output so far
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        out = events[-1]
        assert len(events) > 1
    meta = out["meta_info"]
    return Generated(out["text"], out["output_ids"], meta["prompt_tokens"], meta["finish_reason"])
