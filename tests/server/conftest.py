"""Real server processes (`python -m deepinfer serve`) on free ports, talked to with the official
openai client. A server is killed when its fixture ends, also when a test failed; its log is
printed when it does not come up."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = "tiny-dsv41"  # the served name of the default model (deepinfer.llm.DEFAULT_MODEL_DIR)


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: str
    starting: set = field(default_factory=set)  # (status, error code) /health answered before it was ready

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, api_key: str = "unused", **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=120, **kw)

    def async_client(self, api_key: str = "unused", **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=120, **kw)

    def get(self, path: str) -> tuple[int, bytes]:
        return http(self.url + path)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, raw = http(self.url + path, data, {"content-type": "application/json", **(headers or {})})
        return status, json.loads(raw) if raw else {}

    def metrics(self) -> dict[str, float]:
        """Sample values by series name with labels, e.g. 'deepinfer:cache_pages{...state="used"}'."""
        _, raw = self.get("/metrics")
        out = {}
        for line in raw.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = re.sub(r'model_name="[^"]*"', "", name)
                name = re.sub(r"\{,|,\}|\{\}", lambda m: {"{,": "{", ",}": "}", "{}": ""}[m.group()], name)
                out[name.replace(",,", ",")] = float(value)
        return out

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def http(url: str, data: bytes | None = None, headers: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll an observable condition (not a sleep standing in for synchronization)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextmanager
def running_server(*args: str, env: dict | None = None, startup_timeout: float = 300):
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="deepinfer-serve-", suffix=".log", delete=False)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=REPO, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log.name)
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}:\n{server.log()}")
            try:
                status, raw = http(server.url + "/health", timeout=2)
            except OSError:
                return False
            if status != 200:
                server.starting.add((status, json.loads(raw).get("error", {}).get("code")))
            return status == 200
        wait_until(up, startup_timeout, "the server to answer /health", interval=0.2)
        yield server
    finally:
        stop_process(proc, log, 30)


def stop_process(proc: subprocess.Popen, log, grace: float) -> None:
    """stop(), then remove the child's log file."""
    stop(proc, grace)
    log.close()
    os.unlink(log.name)


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM, then after `grace` seconds SIGKILL to its whole session (started with start_new_session)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def server():
    """The shipped model with default engine settings."""
    with running_server() as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def colocated():
    """tiny-dsv4 in this process: what text through a prefill/decode pair must equal."""
    from deepinfer import LLM
    from deepinfer.llm import TINY_DSV4_DIR

    llm = LLM(TINY_DSV4_DIR, max_num_seqs=1)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def tokenizer():
    from deepinfer.core.tokenizer import Tokenizer
    from deepinfer.llm import DEFAULT_MODEL_DIR

    return Tokenizer(DEFAULT_MODEL_DIR, bos_token_id=0)


def stream_text(stream) -> tuple[str, str | None]:
    """(joined text, finish_reason) of a streamed completion."""
    text, reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason
