"""POST /generate, SGLang's native route: `text` or `input_ids` (one prompt or a list),
`sampling_params` by SGLang's names, `stream`. What smg and sglang-router send a worker they take
for SGLang (deepinfer's /v1/models says owned_by "sglang": docs/routers.md).

The answer per output is SGLang's: {"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "e2e_latency"}}; one prompt with n=1 is one object, anything
else a list (prompt i's choice j at i * n + j). finish_reason is {"type": "length", "length": N},
{"type": "stop", "matched": <stop string or token id>} or {"type": "abort", "message": ...}.
Streamed, each event carries the output so far (SGLang's default, not increments), with `index`
when there is more than one output, then `data: [DONE]`."""

from __future__ import annotations

import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints.protocol_native import GenerateRequest, GenerateSampling
from deepinfer.entrypoints.serving import _UINT64, APIError, EventStream, ServerState, bootstrap_of, collect, \
    delta_error, event_stream, sse, sse_error, submit, unless_disconnected
from deepinfer.entrypoints.streams import Delta
from deepinfer.sampling_params import SamplingParams

# fields served only at their default: what a request that sets one is told instead
UNSERVED = {"return_logprob": "ask /v1/completions for logprobs", "return_hidden_states": "not served",
            "return_entropy": "not served", "return_bytes": "not served", "background": "not served",
            "rid": "send the request id as the X-Request-Id header", "priority": "requests are served in arrival order"}

# SamplingParams' names -> SGLang's (what an error names)
_SGLANG_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seq_seed": "sampling_seed",
                 "include_stop_str_in_output": "no_stop_trim"}


def _so_args(sp: GenerateSampling) -> tuple[dict | None, str]:
    given = [(kind, name) for kind, name in (("json", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf"))
             if getattr(sp, name) is not None]
    if not given:
        return None, "sampling_params"
    if len(given) > 1:
        raise APIError(400, "give one of sampling_params.json_schema, regex and ebnf", f"sampling_params.{given[1][1]}")
    kind, name = given[0]
    return {"schema_type": kind, "schema": getattr(sp, name)}, f"sampling_params.{name}"


def _params(sp: GenerateSampling, so_args: dict | None, so_field: str) -> list[SamplingParams]:
    """One SamplingParams per choice (choice i gets sampling_seed + i); an invalid value is a 400
    naming the SGLang field."""
    out = []
    for i in range(sp.n):
        seed = None if sp.sampling_seed is None else (sp.sampling_seed + i) % _UINT64
        try:
            out.append(SamplingParams(
                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=sp.max_new_tokens,
                min_tokens=sp.min_new_tokens, ignore_eos=sp.ignore_eos, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
                seq_seed=seed, so_args=so_args, min_p=sp.min_p, frequency_penalty=sp.frequency_penalty,
                presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty,
                logit_bias=sp.logit_bias, include_stop_str_in_output=sp.no_stop_trim,
                skip_special_tokens=sp.skip_special_tokens))
        except (ValueError, TypeError) as exc:
            name = str(exc).split(" ", 1)[0].split("[", 1)[0]
            field = so_field if name == "so_args" else f"sampling_params.{_SGLANG_NAMES.get(name, name)}"
            raise APIError(400, f"{field}: {exc}", field) from None
    return out


def _prompts(body: GenerateRequest, tokenizer) -> tuple[list[tuple[list[int], str | None]], str]:
    """(token ids, text) per prompt, and the field they came from."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", "text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts or any(not t for t in texts):
            raise APIError(400, "text is empty", "text")
        return [(tokenizer.encode(t), t) for t in texts], "text"
    batch = body.input_ids if body.input_ids and isinstance(body.input_ids[0], list) else [body.input_ids]
    if not batch or any(not ids for ids in batch):
        raise APIError(400, "input_ids is empty", "input_ids")
    return [(list(ids), None) for ids in batch], "input_ids"


def _finish_reason(delta: Delta, max_new_tokens: int) -> dict | None:
    if not delta.finished:
        return None
    if delta.finish_reason == "length":
        return {"type": "length", "length": max_new_tokens}
    if delta.finish_reason == "stop":  # a stop string or token; None: the model's end of sequence
        matched = delta.stop_reason if delta.stop_reason is not None else (delta.token_ids or [None])[-1]
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": delta.error or "the request was aborted"}


def _output(rid: str, prompt_tokens: int, so_far: Delta, max_new_tokens: int, arrival: float) -> dict:
    meta = {"id": rid, "finish_reason": _finish_reason(so_far, max_new_tokens), "prompt_tokens": prompt_tokens,
            "completion_tokens": len(so_far.token_ids)}
    if so_far.finished:
        meta["e2e_latency"] = time.perf_counter() - arrival
    return {"text": so_far.text, "output_ids": list(so_far.token_ids), "meta_info": meta}


async def create_generate(body: GenerateRequest, request: Request, state: ServerState):
    arrival = time.perf_counter()
    for name, instead in UNSERVED.items():
        if getattr(body, name) != GenerateRequest.model_fields[name].default:
            raise APIError(400, f"{name} is not served on deepinfer's /generate: {instead}", name,
                           "unsupported_parameter")
    sp = body.sampling_params
    prompts, field = _prompts(body, state.engine.tokenizer)
    so_args, so_field = _so_args(sp)
    params = _params(sp, so_args, so_field)
    items = [(ids, p, text) for ids, text in prompts for p in params]
    group = await submit(state, items, field, arrival, "sampling_params.max_new_tokens", so_field,
                         body.data_parallel_rank, bootstrap_of(body, len(items), state))
    prompt_tokens = [len(ids) for ids, _, _ in items]
    if body.stream:
        return EventStream(event_stream(state, group, _stream(group, prompt_tokens, sp, arrival, so_field)))
    results = await unless_disconnected(request, collect(state, group, so_field))
    if results is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    outputs = [_output(rid, n, res, sp.max_new_tokens, arrival)
               for rid, n, res in zip(group.request_ids, prompt_tokens, results)]
    return outputs[0] if len(outputs) == 1 else outputs


async def _stream(group, prompt_tokens: list[int], sp: GenerateSampling, arrival: float, so_field: str):
    so_far = [Delta() for _ in group.request_ids]
    many = len(so_far) > 1
    async for index, delta in group.deltas():
        if delta.error:  # its grammar did not compile in time, or its prefill worker failed
            yield sse_error(delta_error(delta, so_field))
        so_far[index].merge(delta)
        out = _output(group.request_ids[index], prompt_tokens[index], so_far[index], sp.max_new_tokens, arrival)
        if many:
            out["index"] = index
        yield sse(json.dumps(out))
