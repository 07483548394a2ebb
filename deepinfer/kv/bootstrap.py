"""The bootstrap protocol between a decode worker and a prefill worker (SGLang's, over HTTP).

A router (smg --pd-disaggregation) sends the same request to a prefill and a decode worker with
`bootstrap_host`, `bootstrap_port` (the prefill's bootstrap server) and a random `bootstrap_room`
naming the request on both. Then:

    decode  GET  /route                 the prefill's transfer session and cache description
                                        (refused here when the caches cannot exchange state)
    decode  POST /rooms/<room>          where to write: its session, pool addresses, slot and pages
                                        (409 with the reason when prefill refuses them)
    prefill (runs the prompt, samples the first token, writes the state through the transfer engine)
    decode  GET  /rooms/<room>?wait=S   long poll: {"status": "done", "first_token", "logprobs",
                                        "bytes", ...} or {"status": "failed", "error"} or pending
    decode  DELETE /rooms/<room>        the request was cancelled: prefill frees its side, and answers
                                        only once no write into decode's pages can still happen

The server runs on its own threads and calls a `Rooms` object (kv/disagg_prefill.py); the client
functions below are what the decode side calls."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger("deepinfer.kv")


class Rooms(Protocol):
    def route(self) -> dict: ...
    def offer(self, room: int, body: dict) -> str | None: ...  # the refusal, or None
    def wait(self, room: int, timeout: float) -> dict: ...
    def cancel(self, room: int) -> dict: ...


class BootstrapServer:
    """Prefill's bootstrap server on host:port, answering from `rooms`."""

    def __init__(self, host: str, port: int, rooms: Rooms):
        class Handler(_Handler):
            pass
        Handler.rooms = rooms
        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise RuntimeError(f"--disaggregation-bootstrap-port {port}: cannot listen on {host}:{port} ({exc}); "
                               "choose a free port") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="deepinfer-bootstrap", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    rooms: Rooms
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # the access log goes to debug, not stderr
        logger.debug("bootstrap: " + fmt, *args)

    def _room(self) -> int | None:
        parts = urlparse(self.path).path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "rooms":
            try:
                return int(parts[1])
            except ValueError:
                return None
        return None

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        if url.path == "/route":
            return self._send(200, self.rooms.route())
        room = self._room()
        if room is None:
            return self._send(404, {"error": f"no route {url.path}"})
        wait = float(parse_qs(url.query).get("wait", ["0"])[0])
        return self._send(200, self.rooms.wait(room, min(max(wait, 0.0), 30.0)))

    def do_POST(self):
        room = self._room()
        if room is None:
            return self._send(404, {"error": f"no route {self.path}"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        except ValueError as exc:
            return self._send(400, {"error": f"body is not JSON: {exc}"})
        refusal = self.rooms.offer(room, body)
        return self._send(409 if refusal else 200, {"error": refusal} if refusal else {"accepted": True})

    def do_DELETE(self):
        room = self._room()
        if room is None:
            return self._send(404, {"error": f"no route {self.path}"})
        return self._send(200, self.rooms.cancel(room))


# ------------------------------------------------------------------ decode's side
class BootstrapError(RuntimeError):
    """The prefill's bootstrap server refused the request or could not be reached."""


def call(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read()).get("error", "")
        except ValueError:
            reason = ""
        raise BootstrapError(f"{method} {url} answered {exc.code}: {reason}") from None
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a truncated answer
        raise BootstrapError(f"{method} {url} failed: {exc}") from None
