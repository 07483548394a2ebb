"""The OpenAI API's request and response bodies (the subset deepinfer serves), as pydantic models.

Requests reject fields they do not know (OpenAI answers those with a 400 too), except a few
that only matter to OpenAI's own service (`user`, `store`, `metadata`, ...), which are accepted
and ignored. deepinfer's extra sampling fields (`top_k`, `ignore_eos`, `stop_token_ids`,
`so_args`) ride in the same body, e.g. through the openai client's `extra_body`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    so_args: dict | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's penalties and bias, and vLLM's extra sampling fields (SamplingParams' names and meanings;
    # SamplingParams validates them, a bad value is a 400 naming the field)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # the data-parallel rank to run on (SGLang's field; smg --dp-aware adds it); none: the instance chooses
    data_parallel_rank: int | None = None
    # prefill/decode disaggregation: smg --pd-disaggregation adds them (docs/disaggregation.md)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # vLLM's prefill/decode protocol (vllm-router --vllm-pd-disaggregation): {"do_remote_decode": true} asks a
    # prefill worker to keep the prompt's state for a decode worker, whose request then carries the
    # kv_transfer_params the prefill's response returned ({"do_remote_prefill": true, "remote_host", ...})
    kv_transfer_params: dict | None = None
    # SGLang's fields, which vllm-router writes into the completions and chat bodies it forwards: accepted
    # at the values that mean what deepinfer does (stop strings trimmed, no hidden states returned)
    no_stop_trim: Literal[False] = False
    return_hidden_states: Literal[False] = False
    # accepted and ignored: they steer OpenAI's service, not the model
    user: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict = "{}"


class ToolCallParam(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message of a conversation; `content` may be a list of text parts (joined by newlines) and
    `image_url` parts, which stay a list for serving_chat to place (it accepts data: URIs only)."""

    model_config = ConfigDict(extra="ignore")  # e.g. `refusal`, `audio`: nothing a prompt uses

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind == "image_url":
                    image = part.get("image_url")
                    url = image.get("url") if isinstance(image, dict) else None
                    if not isinstance(url, str):
                        raise ValueError(f"content[{j}]: an image_url part needs image_url.url (a data: URI)")
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content[{j}]: content parts are 'text' or 'image_url', got type {kind!r}")
            if all(part["type"] == "text" for part in content):
                return "\n".join(part["text"] for part in content)
        return content

    def as_dict(self) -> dict:
        return self.model_dump(exclude_none=True)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # SGLang's chat fields, which vllm-router writes into every chat body it forwards: accepted at the
    # values that mean what deepinfer does (reasoning parsed out and streamed)
    continue_final_message: Literal[False] = False
    separate_reasoning: Literal[True] = True
    stream_reasoning: Literal[True] = True
    include_reasoning: Literal[True] = True


# ------------------------------------------------------------------ responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict | None = None  # a prefill worker's answer to {"do_remote_decode": true} (vLLM's)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCallOut):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict | None = None  # a prefill worker's answer to {"do_remote_decode": true} (vLLM's)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    # "sglang": smg reads owned_by to pick a worker's protocol, and deepinfer speaks SGLang's worker
    # contract (/server_info, /v1/loads, /generate, its PD bootstrap fields); "vllm" would make smg skip
    # /server_info and /v1/loads, anything else registers the worker as a generic OpenAI backend
    owned_by: str = "sglang"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
