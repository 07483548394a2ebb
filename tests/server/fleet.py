"""deepinfer workers behind a real router on 127.0.0.1: smg (the SGLang model gateway) and
vllm-router (its kv_aware policy fed by the workers' KV events), both from the test extra, started
on free ports and stopped by their context managers, and a multi-turn workload whose prefix-cache
hit rate the workers' /metrics report. Used by test_router.py, test_kv_aware_routing.py and
benchmarks/router.py."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from conftest import free_port, http, running_server, stop_process, wait_until


def smg_binary() -> str:
    """The smg launcher next to this Python (the test extra installs it), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "smg")
    found = here if os.path.exists(here) else shutil.which("smg")
    if found is None:
        raise RuntimeError("smg is not installed: pip install -e '.[test]' (the SGLang model gateway, PyPI `smg`)")
    return found


@contextmanager
def running_servers(n: int, *args: str, own_args=None):
    """n servers started at once (each still killed when the context ends); `own_args(i)`: flags for
    server i alone (e.g. its KV events' ports)."""
    managers = [running_server(*args, *(own_args(i) if own_args else ())) for i in range(n)]
    with ExitStack() as stack, ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        servers, failure = [], None
        for manager, future in zip(managers, futures):
            try:
                servers.append(future.result())
                stack.push(manager.__exit__)
            except BaseException as exc:  # noqa: BLE001 - the others are stopped, then it is raised
                failure = failure or exc
        if failure is not None:
            raise failure
        yield servers


@dataclass
class Router:
    url: str
    proc: subprocess.Popen
    log_path: str

    def workers(self) -> list[dict]:
        """smg's own worker list (GET /workers): url, runtime_type, labels, health, ..."""
        return json.loads(http(self.url + "/workers")[1])["workers"]

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read())  # vllm-router colours its log even without a tty


@contextmanager
def running_smg(worker_urls: list[str], policy: str, *extra: str, startup_timeout: float = 60,
                worker_flags: list[str] | None = None):
    """`smg launch` over these workers; ready once it lists every one of them healthy. `worker_flags`:
    how smg is told of them, if not `--worker-urls` (e.g. --pd-disaggregation --prefill URL PORT --decode URL)."""
    port, metrics_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="smg-", suffix=".log", delete=False)
    # health probes every second, one failure marks a worker down: a killed or draining worker leaves the
    # rotation within a second or two instead of smg's production defaults (tens of seconds)
    cmd = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port), *(worker_flags or ["--worker-urls", *worker_urls]),
           "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "info", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "NO_COLOR": "1"})
    router = Router(f"http://127.0.0.1:{port}", proc, log.name)
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"smg exited with {proc.returncode}:\n{router.log()}")
            try:
                workers = router.workers()
            except (OSError, ValueError, KeyError):
                return False
            # with --dp-aware smg lists a worker once per data-parallel rank, as URL@rank
            return {w["url"].split("@")[0] for w in workers if w.get("is_healthy")} == set(worker_urls)
        wait_until(ready, startup_timeout, "smg to list every worker healthy", interval=0.2)
        yield router
    finally:
        stop_process(proc, log, 15)


def vllm_router_binary() -> str:
    """vllm-router next to this Python (the test extra installs it)."""
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if not os.path.exists(here):
        raise RuntimeError("vllm-router is not installed: pip install -e '.[test]' (PyPI `vllm-router`)")
    return here


def events_config(port: int, replay_port: int) -> str:
    """A worker's --kv-events-config: vLLM's ZMQ publisher on these loopback ports."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": ""})


@contextmanager
def running_vllm_router(worker_urls: list[str], policy: str, model: str,
                        event_sources: list[tuple[int, int]] | None = None, startup_timeout: float = 60,
                        worker_flags: list[str] | None = None):
    """vllm-router over these workers; `event_sources`: per worker, the (event port, replay port) its
    --kv-events-config publishes on, which kv_aware subscribes to (block size: the prefix cache's page,
    model: the served name). `worker_flags`: how it is told of the workers, if not `--worker-urls`
    (e.g. --vllm-pd-disaggregation --prefill URL --decode URL). Ready once it subscribed to every
    source and answers /health."""
    from deepinfer.core.model_runner import PAGE_TOKENS

    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="vllm-router-", suffix=".log", delete=False)
    cmd = [vllm_router_binary(), *(worker_flags or ["--worker-urls", *worker_urls]), "--policy", policy,
           "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "debug"]
    if event_sources:
        cmd += ["--kv-event-block-size", str(PAGE_TOKENS), "--kv-event-model", model]
        for url, (ev, rp) in zip(worker_urls, event_sources):
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}",
                    "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{rp}"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"})
    router = Router(f"http://127.0.0.1:{port}", proc, log.name)
    try:
        def subscribed():
            if proc.poll() is not None:
                raise AssertionError(f"vllm-router exited with {proc.returncode}:\n{router.log()}")
            return all(f"kv_index subscriber for {url} rank0 on" in router.log()
                       for url in worker_urls[:len(event_sources or [])])

        def up():
            try:
                return subscribed() and http(router.url + "/health", timeout=2)[0] == 200
            except OSError:
                return False
        wait_until(up, startup_timeout, "vllm-router to subscribe to the workers' events and answer /health",
                   interval=0.2)
        yield router
    finally:
        stop_process(proc, log, 10)


# ------------------------------------------------------------------ the multi-turn workload
_WORDS = ("cache page router worker token prefix replica engine request stream latency batch decode prefill "
          "expert layer model server client policy health drain queue metric load rank").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Conversation:
    system: str
    users: list[str]  # one user message per turn
    replies: list[str]  # the assistant's replies so far (each turn's history includes them)

    def messages(self, turn: int) -> list[dict]:
        out = [{"role": "system", "content": self.system}]
        for i in range(turn + 1):
            out.append({"role": "user", "content": self.users[i]})
            if i < turn:
                out.append({"role": "assistant", "content": self.replies[i]})
        return out


def conversations(tag: str, num: int = 5, turns: int = 3, systems: int = 2, system_words: int = 300,
                  user_words: int = 40, seed: int = 0) -> list[Conversation]:
    """`num` conversations of `turns` turns; conversation i has system prompt i % `systems` (long,
    shared), its own user messages. `tag` makes the texts differ between runs, so one run's cache
    never serves another's."""
    rng = random.Random(f"{tag}/{seed}")
    prompts = [f"[{tag} system {s}] " + _text(rng, system_words) for s in range(systems)]
    return [Conversation(prompts[i % systems], [f"[{tag} {i}.{t}] " + _text(rng, user_words) for t in range(turns)],
                         []) for i in range(num)]


def prefix_counters(worker_urls: list[str]) -> tuple[float, float]:
    """(prompt tokens found in the prefix cache, prompt tokens looked up), summed over the workers."""
    hits = queries = 0.0
    for url in worker_urls:
        for line in http(url + "/metrics")[1].decode().splitlines():
            if line.startswith("deepinfer:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("deepinfer:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    queried = after[1] - before[1]
    return (after[0] - before[0]) / queried if queried else 0.0
