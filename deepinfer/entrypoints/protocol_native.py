"""Bodies of the routes that are not OpenAI's: SGLang's native `/generate` (what SGLang's router
and smg send a worker they know as SGLang) and vLLM's `/tokenize` and `/detokenize` (vllm-router
tokenizes through them). Unknown fields are refused with a 400 naming them, as on the OpenAI routes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.entrypoints.protocol import ChatMessage, Tool


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateSampling(_Request):
    """SGLang's `sampling_params`, by SGLang's names (defaults as SGLang has them: 128 new tokens)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    n: int = Field(1, ge=1, le=128)
    json_schema: str | None = None  # a JSON schema, as a string
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None


class GenerateRequest(_Request):
    """POST /generate: `text` or `input_ids` (one prompt, or a list of them)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    data_parallel_rank: int | None = None  # smg --dp-aware adds it
    # prefill/decode disaggregation: smg --pd-disaggregation adds them (docs/disaggregation.md)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # smg re-serializes the body with its defaults for these; accepted and ignored (model: SGLang's
    # /generate has none, smg sends "unknown"; nothing here logs prompts or labels metrics per request)
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    return_text_in_logprobs: bool = False
    # served only with these values (serving_generate.UNSERVED names the alternative)
    return_logprob: bool = False
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False
    rid: str | None = None
    priority: int | None = None


class TokenizeRequest(_Request):
    """POST /tokenize as vLLM has it: a `prompt`, or chat `messages` rendered by the chat format
    (exactly the ids /v1/chat/completions would run)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # the chat formats always end with the assistant's turn
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
