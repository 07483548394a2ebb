"""POST /v1/completions/render and /v1/chat/completions/render, as vLLM serves them: a request's
prompt as the token ids the engine would run, without running it. A KV-aware router reads them
to match a request against the pages the workers' KV events announce (vllm-router's kv_aware
policy calls them on each worker; docs/kv-events.md), so they must tokenize exactly as the
generating routes do: they call the same code.

Only the fields that decide the prompt are read (model, prompt; model, messages, tools,
tool_choice, chat_template_kwargs, reasoning_effort); sampling fields are ignored, as routers send
the whole request. Completions answer a list, one entry per prompt; chat one entry. An entry
holds `token_ids`, `model` and a `request_id`."""

from __future__ import annotations

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from deepinfer.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, random_id
from deepinfer.entrypoints.serving import APIError, ServerState
from deepinfer.entrypoints.serving_chat import render_chat
from deepinfer.entrypoints.serving_completion import _prompts

COMPLETION_FIELDS = ("model", "prompt")
CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort")


def _read(model, body, names: tuple[str, ...]):
    """The prompt's fields of `body` as `model` validates them (errors as every route reports them)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate({k: body[k] for k in names if k in body})
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def add_render_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions/render")
    async def completions_render(body=Body(...)):
        req = _read(CompletionRequest, body, COMPLETION_FIELDS)
        state.check_model(req.model)
        return [{"request_id": random_id("cmpl"), "token_ids": ids, "model": req.model}
                for ids, _ in _prompts(req.prompt, state.engine.tokenizer)]

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(body=Body(...)):
        req = _read(ChatCompletionRequest, body, CHAT_FIELDS)
        state.check_model(req.model)
        _, ids, _ = await render_chat(req, state)
        return {"request_id": random_id("chatcmpl"), "token_ids": ids, "model": req.model}
