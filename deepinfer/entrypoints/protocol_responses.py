"""The request body of OpenAI's Responses API (POST /v1/responses), the part deepinfer serves.

The top-level fields are checked here (an unknown one is a 400 naming it, as OpenAI answers);
input items, tools and tool_choice stay dicts and are read item by item in serving_responses.py,
whose errors name the exact item (`input[2].content[0].image_url`). Fields that only steer
OpenAI's service (`store`, `metadata`, `user`, `service_tier`, ...) are accepted and ignored; the
server is stateless, so the fields that point at stored state (`previous_response_id`,
`conversation`, `prompt`, `background`) are refused (serving_responses.refuse_stateful).
deepinfer's own fields ride in the same body (the openai client's `extra_body`): `top_k`, `seed`,
`so_args` (structured outputs, as on the chat route) and `chat_template_kwargs`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextConfig(_Request):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: str | None = None  # a hint to OpenAI's models; no chat format has it (ignored)


class ReasoningConfig(_Request):
    effort: str | None = None  # the chat format's reasoning_effort
    summary: str | None = None  # summaries are OpenAI's; the reasoning itself is returned (ignored)
    generate_summary: str | None = None  # the older name of `summary` (ignored)


class ResponsesRequest(_Request):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # refused: they need state this server does not keep
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    # accepted and ignored: they steer OpenAI's service, not the model
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None  # a limit on OpenAI's hosted tools, which this server does not run
    # deepinfer's own
    top_k: int = -1
    seed: int | None = None
    so_args: dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    data_parallel_rank: int | None = None  # the rank to run on (smg --dp-aware adds it)
