"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLM, run by uvicorn.

`deepinfer serve` (deepinfer/__main__.py) builds it with `serve(...)`. Limits and access
control are plain ASGI middleware so they answer before a handler reads anything: an oversized
body gets 413 without being buffered past the limit, a missing API key 401. Every error,
including FastAPI's own validation and routing errors, has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, except on Anthropic's /v1/messages routes, whose
errors have Anthropic's shape `{"type": "error", "error": {"type", "message"}}`.

Every request has an id: the client's (or router's) `X-Request-Id`, else a fresh one; it names the
engine requests, appears in responses (`chatcmpl-<id>`, /generate's meta_info.id) and logs, and is
sent back in the `X-Request-Id` header.

Readiness and liveness: HTTP comes up first and the model loads behind it (Startup), so a router
or an orchestrator sees the worker: `/health` (readiness, what routers poll) is 503 while the
model loads, while draining and once the engine has failed; `/liveness` is 200 unless the engine
has failed (restart me). A model that fails to load ends the process with the error.

Shutdown (SIGTERM or Ctrl-C): the server drains - /health and new requests get 503 (a router's
retry sends them elsewhere) while running requests may finish for `shutdown_timeout` seconds;
what still runs then is aborted (its stream ends with finish_reason "abort"); when nothing runs the
listener closes, the engine thread stops and the process exits. A second signal exits at once.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.entrypoints.chat import load_chat_format
from deepinfer.entrypoints.dp_client import DataParallelClient
from deepinfer.entrypoints.metrics import ServerMetrics
from deepinfer.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from deepinfer.entrypoints.protocol_anthropic import CountTokensRequest, MessagesRequest, error_body
from deepinfer.entrypoints.protocol_native import DetokenizeRequest, GenerateRequest, TokenizeRequest
from deepinfer.entrypoints.protocol_responses import ResponsesRequest
from deepinfer.entrypoints.serving import REQUEST_ID, APIError, ServerState
from deepinfer.entrypoints.serving_generate import create_generate
from deepinfer.entrypoints.serving_chat import create_chat_completion
from deepinfer.entrypoints.serving_completion import create_completion
from deepinfer.entrypoints.serving_messages import count_tokens, create_message
from deepinfer.entrypoints.serving_render import add_render_routes
from deepinfer.entrypoints.serving_responses import create_response
from deepinfer.entrypoints.serving_worker import detokenize, health_generate, loads, model_info, server_info, tokenize

logger = logging.getLogger("deepinfer.server")

MAX_REQUEST_ID_CHARS = 256
DRAIN_BACKSTOP_S = 5.0  # past the drain deadline, exit even if an aborted request has not ended yet


def _shaped(path: str, error: APIError) -> dict:
    """The error body in the shape of the API the path belongs to."""
    return error_body(error.status, error.message, error.param) if path.startswith("/v1/messages") else error.body()


def _error_response(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(_shaped(request.url.path, error), status_code=error.status)


async def _send_error(send, path: str, error: APIError) -> None:
    body = json.dumps(_shaped(path, error)).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _request_id(header: bytes | None) -> str:
    """The client's X-Request-Id (printable ASCII without spaces, at most MAX_REQUEST_ID_CHARS), else a fresh id."""
    if header is None:
        return uuid.uuid4().hex
    text = header.decode("latin-1")
    if not text or len(text) > MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in text):
        raise APIError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters without "
                       "spaces; leave it out and the server makes one", "X-Request-Id")
    return text


class Guard:
    """ASGI middleware: the request id (X-Request-Id in, the same out; serving.REQUEST_ID for the
    handler), the API key on /v1 routes (`Authorization: Bearer <key>`, or `x-api-key: <key>` as
    Anthropic's clients send it), and the body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        try:
            rid = _request_id(headers.get(b"x-request-id"))
        except APIError as error:
            return await _send_error(send, scope["path"], error)
        REQUEST_ID.set(rid)  # this task's context: the handler runs in it

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        return await self._guarded(scope, receive, send_with_id, headers)

    async def _guarded(self, scope, receive, send, headers: dict):
        if self.api_key is not None and scope["path"].startswith("/v1"):
            bearer = headers.get(b"authorization", b"")
            x_api_key = headers.get(b"x-api-key", b"")
            if not (hmac.compare_digest(bearer, f"Bearer {self.api_key}".encode()) or
                    (x_api_key and hmac.compare_digest(x_api_key, self.api_key.encode()))):
                return await _send_error(send, scope["path"], APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    code="invalid_api_key"))
        too_large = APIError(413, f"the request body exceeds {self.max_body_bytes} bytes (--max-body-bytes)",
                             code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _send_error(send, scope["path"], too_large)
        chunks, size, more = [], 0, True
        while more:  # read the whole body here, counting, so a body without a length cannot exceed it either
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await _send_error(send, scope["path"], too_large)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    name = ""
    for p in parts:
        name += f"[{p}]" if p.isdigit() else (f".{p}" if name else p)
    return name or None


def build_app(state: ServerState, metrics: ServerMetrics, api_key: str | None = None,
              max_body_bytes: int = 32 << 20) -> FastAPI:
    app = FastAPI(title="deepinfer")

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = _param(first.get("loc", ()))
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return _error_response(request, APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(request, APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        logger.exception("request %s failed", REQUEST_ID.get())
        return _error_response(request, APIError(500, f"internal error: {exc!r}", type="server_error"))

    @app.get("/health")
    async def health():
        """Readiness: 200 while the engine takes requests; 503 while draining or once it failed."""
        engine = state.engine
        if not engine.alive:
            why = f"the engine failed: {engine.error}" if engine.error is not None else \
                "draining: running requests finish, new ones go elsewhere"
            return JSONResponse(APIError(503, why, code="unavailable", type="server_error").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/liveness")
    async def liveness():
        """Liveness: 200 unless the engine failed (then the process should be restarted)."""
        if state.engine.error is not None:
            return JSONResponse(APIError(503, f"the engine failed: {state.engine.error}", code="unavailable",
                                         type="server_error").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate_one():
        """Readiness, proven: one token generated (within 20 s)."""
        if not state.engine.alive or not await health_generate(state):
            return JSONResponse(APIError(503, "the engine did not generate a token", code="unavailable",
                                         type="server_error").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=name, root=state.model_dir, max_model_len=state.engine.engine.max_model_len)
                               for name in state.served_model_names])

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(state)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return model_info(state)

    @app.get("/v1/loads")
    async def get_loads(include: str | None = None):
        return loads(state, include)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        return await create_generate(body, request, state)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(state, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(body, request, state)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(body, request, state)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await create_message(body, request, state)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest):
        return await count_tokens(body, state)

    add_render_routes(app, state)  # vLLM's prompt renderers, read by KV-aware routers
    return Guard(app, api_key, max_body_bytes)


class Startup:
    """The ASGI app uvicorn runs: 503 on every route (200 on /liveness) until the model is loaded,
    then the server's app; it answers uvicorn's lifespan and closes the engine at shutdown."""

    def __init__(self):
        self.app = None
        self.engine = None  # AsyncLLM or DataParallelClient, once loaded
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False

    def open(self, app, engine) -> bool:
        """The loaded server goes live; False (and the engine closed) if shutdown came first."""
        with self._lock:
            if not self._closed:
                self.app, self.engine = app, engine
                return True
        engine.close()
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        if scope["path"] == "/liveness":
            body = b'{"status": "loading"}'
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        await _send_error(send, scope["path"], APIError(503, "the model is loading; retry when /health answers 200",
                                                        code="loading", type="server_error"))

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.close()
                return await send({"type": "lifespan.shutdown.complete"})


class _Server(uvicorn.Server):
    """uvicorn that drains before it stops listening: on the first SIGTERM / Ctrl-C the engine takes
    nothing new (503, which routers retry elsewhere) and /health turns 503, running requests may
    finish for `grace` seconds, then it stops; a second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, gate: Startup, grace: float):
        super().__init__(config)
        self.gate, self.grace = gate, grace
        self.drain_until: float | None = None

    def handle_exit(self, sig, frame) -> None:
        engine = self.gate.engine
        if self.drain_until is None and not self.should_exit and engine is not None:
            self.drain_until = time.monotonic() + self.grace
            logger.info("draining: %d request(s) running may finish within %.0f s; /health and new requests get 503",
                        engine.num_live, self.grace)
            engine.start_draining(self.grace)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and not self.should_exit:
            engine = self.gate.engine
            if engine is None or engine.num_live == 0 or time.monotonic() > self.drain_until + DRAIN_BACKSTOP_S:
                self.should_exit = True
        return await super().on_tick(counter)


def _load(startup: Startup, server: _Server, model: str, name: str, metrics: ServerMetrics, api_key: str | None,
          chat_format: str, max_waiting_requests: int, max_body_bytes: int, engine_args: dict, disaggregation,
          host: str) -> None:
    """The loading thread: build the engine and the app, then open the server (or stop it with the error)."""
    from deepinfer.llm import LLM

    engine = None
    try:
        if disaggregation is not None and disaggregation.mode == "encode":  # the multimodal encoder alone
            from deepinfer.entrypoints.encode_server import build_encode_app
            from deepinfer.kv.encode_worker import EncodeWorker

            engine = EncodeWorker(model, disaggregation, host, engine_args.get("accelerator"))
            app = build_encode_app(engine, metrics, model, name, lambda a: Guard(a, api_key, max_body_bytes))
            if startup.open(app, engine):
                logger.info("ready: encoder worker for %s as %r", model, name)
            return
        if engine_args.get("data_parallel_size", 1) > 1:  # one rank process per data-parallel rank
            if disaggregation is not None and (disaggregation.enabled or disaggregation.encoder_urls):
                raise ValueError("--disaggregation-mode or --encoder-urls with --data-parallel-size > 1 is not "
                                 "served yet: run one worker per rank behind the router")
            engine = DataParallelClient(model, max_waiting_requests=max_waiting_requests, metrics=metrics,
                                        **engine_args)
        else:
            llm = LLM(model, **engine_args)
            try:
                engine = AsyncLLM(llm, max_waiting_requests, metrics, disaggregation, host, model)
            except ValueError:
                llm.close()  # e.g. a parallel layout: its worker processes go too
                raise
        if engine.tokenizer is None:
            raise ValueError(f"{model} has no tokenizer.json: the server needs one to read prompts and write text")
        fmt = load_chat_format(model, engine.tokenizer, chat_format)
        app = build_app(ServerState(engine, fmt, [name], model), metrics, api_key, max_body_bytes)
    except BaseException as exc:  # noqa: BLE001 - serve() raises it once uvicorn has stopped
        if engine is not None:
            engine.close()
        startup.error = exc
        server.should_exit = True
        return
    if startup.open(app, engine):
        logger.info("ready: serving %s as %r (chat format %s)", model, name, fmt.name)


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, chat_format: str = "auto", max_waiting_requests: int = 1024,
          max_body_bytes: int = 32 << 20, shutdown_timeout: float = 10.0, log_level: str = "info",
          access_log: bool = False, disaggregation=None, **engine_args) -> None:
    """Listen, load the model behind the listener, serve until SIGTERM / Ctrl-C (then drain).
    `disaggregation` (kv/disagg.py DisaggregationConfig): serve as a prefill or decode worker."""
    if disaggregation is not None:
        disaggregation.validate()
    from deepinfer.llm import default_model

    model = os.fspath(model) if model is not None else default_model()
    name = served_model_name or os.path.basename(os.path.normpath(model))
    metrics = ServerMetrics(name)
    startup = Startup()
    # uvicorn's own graceful timeout is only a backstop: the drain ends the streams first
    config = uvicorn.Config(startup, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5)
    server = _Server(config, startup, shutdown_timeout)
    logger.info("loading %s as %r; http://%s:%d/health answers 200 once it is ready", model, name, host, port)
    loader = threading.Thread(target=_load, name="deepinfer-load", daemon=True, args=(
        startup, server, model, name, metrics, api_key, chat_format, max_waiting_requests, max_body_bytes,
        engine_args, disaggregation, host))
    loader.start()
    try:
        server.run()
    finally:
        startup.close()
    if startup.error is not None:
        raise startup.error
