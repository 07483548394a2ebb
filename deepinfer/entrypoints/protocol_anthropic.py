"""The request body of Anthropic's Messages API (POST /v1/messages), the part deepinfer serves, and
the shape of its errors: `{"type": "error", "error": {"type": ..., "message": ...}}`.

Top-level fields are checked here (an unknown one is a 400 naming it, as Anthropic answers);
messages, content blocks, tools, tool_choice and thinking stay dicts and are read block by block
in serving_messages.py, whose errors name the exact block (`messages[1].content[0].source`).
`temperature`, `top_p` and `top_k` are taken though Anthropic's newest clients no longer name them
(send them in `extra_body`). `metadata`, `service_tier`, `cache_control`, `inference_geo` and
`speed` steer Anthropic's service and are accepted and ignored. deepinfer's
own fields ride in the same body (the anthropic client's `extra_body`): `seed`, `so_args`
(structured outputs, as on the chat route) and `chat_template_kwargs`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# HTTP status -> Anthropic's error type (docs.anthropic.com, "Errors")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """Anthropic's errors have no `param`: the message names the field instead."""
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                                               "invalid_request_error"), "message": message}}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # effort (the chat format's reasoning_effort), format (json_schema)
    # accepted and ignored: they steer Anthropic's service, not the model
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (the prefix cache)
    inference_geo: str | None = None
    speed: str | None = None
    # deepinfer's own
    seed: int | None = None
    so_args: dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    data_parallel_rank: int | None = None  # the rank to run on (smg --dp-aware adds it)


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: the prompt a Messages request would have, counted."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    data_parallel_rank: int | None = None  # smg --dp-aware adds it to every body; counting runs on no rank
