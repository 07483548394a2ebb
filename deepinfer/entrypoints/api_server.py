"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLM, run by uvicorn.

`deepinfer serve` (deepinfer/__main__.py) builds it with `serve(...)`. Limits and access
control are plain ASGI middleware so they answer before a handler reads anything: an oversized
body gets 413 without being buffered past the limit, a missing API key 401. Every error,
including FastAPI's own validation and routing errors, has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, except on Anthropic's /v1/messages routes, whose
errors have Anthropic's shape `{"type": "error", "error": {"type", "message"}}`.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections; the engine accepts no new
request, lets running ones finish for `shutdown_timeout` seconds, then aborts the rest (their
streams end with finish_reason "abort"); then the engine thread stops and the process exits.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from contextlib import asynccontextmanager

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
from deepinfer.entrypoints.protocol_responses import ResponsesRequest
from deepinfer.entrypoints.serving import APIError, ServerState
from deepinfer.entrypoints.serving_chat import create_chat_completion
from deepinfer.entrypoints.serving_completion import create_completion
from deepinfer.entrypoints.serving_messages import count_tokens, create_message
from deepinfer.entrypoints.serving_render import add_render_routes
from deepinfer.entrypoints.serving_responses import create_response

logger = logging.getLogger("deepinfer.server")


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


class Guard:
    """ASGI middleware: the API key on /v1 routes (`Authorization: Bearer <key>`, or `x-api-key: <key>`
    as Anthropic's clients send it), and the body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
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
    @asynccontextmanager
    async def lifespan(app):
        yield
        state.engine.close()

    app = FastAPI(title="deepinfer", lifespan=lifespan)

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
        logger.exception("request failed")
        return _error_response(request, APIError(500, f"internal error: {exc!r}", type="server_error"))

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse(APIError(503, "the engine is not serving", code="unavailable",
                                         type="server_error").body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=name, root=state.model_dir, max_model_len=state.engine.engine.max_model_len)
                               for name in state.served_model_names])

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


class _Server(uvicorn.Server):
    """uvicorn, with the engine drained first when it shuts down."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    async def shutdown(self, sockets=None):
        self.engine.start_draining(self.grace)
        await super().shutdown(sockets)


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, chat_format: str = "auto", max_waiting_requests: int = 1024,
          max_body_bytes: int = 32 << 20, shutdown_timeout: float = 10.0, log_level: str = "info",
          access_log: bool = False, **engine_args) -> None:
    """Load the model, then serve until SIGTERM / Ctrl-C."""
    from deepinfer.llm import LLM, default_model

    model = os.fspath(model) if model is not None else default_model()
    name = served_model_name or os.path.basename(os.path.normpath(model))
    metrics = ServerMetrics(name)
    if engine_args.get("data_parallel_size", 1) > 1:  # one rank process per data-parallel rank
        engine = DataParallelClient(model, max_waiting_requests=max_waiting_requests, metrics=metrics, **engine_args)
    else:
        llm = LLM(model, **engine_args)
        try:
            engine = AsyncLLM(llm, max_waiting_requests, metrics)
        except ValueError:
            llm.close()  # e.g. a parallel layout: its worker processes go too
            raise
    if engine.tokenizer is None:
        engine.close()
        raise ValueError(f"{model} has no tokenizer.json: the server needs one to read prompts and write text")
    fmt = load_chat_format(model, engine.tokenizer, chat_format)
    state = ServerState(engine, fmt, [name], model)
    logger.info("serving %s as %r (chat format %s) on http://%s:%d", model, name, fmt.name, host, port)
    # uvicorn's own graceful timeout is only a backstop: the engine's drain ends the streams first
    config = uvicorn.Config(build_app(state, metrics, api_key, max_body_bytes), host=host, port=port,
                            log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5)
    try:
        _Server(config, engine, shutdown_timeout).run()
    finally:
        engine.close()
