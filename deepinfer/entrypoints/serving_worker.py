"""What a router asks a worker, in the shapes SGLang's server answers (smg and sglang-router read
them; docs/routers.md): /server_info (and its older name /get_server_info), /model_info
(/get_model_info), /v1/loads, /health_generate; and vLLM's /tokenize and /detokenize (vllm-router).

/v1/loads answers `include=` sections as SGLang does: `core` (each data-parallel rank's running and
waiting requests and cache tokens), `memory`, `queues`, `disagg`, or `all`; an unknown one is a 400."""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime, timezone

from deepinfer import __version__
from deepinfer.entrypoints.chat import ChatFormatError
from deepinfer.entrypoints.protocol_native import DetokenizeRequest, TokenizeRequest
from deepinfer.entrypoints.serving import APIError, ServerState, collect, submit
from deepinfer.sampling_params import SamplingParams

LOAD_SECTIONS = ("core", "memory", "queues", "disagg")
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's default: a worker that cannot make one token by then is unhealthy
# the /v1/loads `core` fields (metrics.engine_load has two more, the prefix-cache counters)
_CORE = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
         "token_usage", "cache_hit_rate", "max_running_requests")


def _model_config(model_dir: str) -> dict:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def server_info(state: ServerState) -> dict:
    """SGLang's /server_info fields that routers read (smg: ServerInfo in discover_metadata.rs)."""
    loads = state.engine.loads()
    first = loads[0] if loads else {}
    return {"model_path": state.model_dir, "tokenizer_path": state.model_dir,
            "served_model_name": state.served_model_names[0], "version": __version__, "engine": "deepinfer",
            "tp_size": 1, "pp_size": 1, "dp_size": state.engine.dp_size,
            "load_balance_method": "least_work" if state.engine.dp_size > 1 else "none",
            "disaggregation_mode": state.engine.disaggregation_mode, "is_embedding": False,
            "disaggregation": disaggregation_stats(state),
            "context_length": state.engine.engine.max_model_len,
            # per data-parallel rank, as SGLang reports them
            "max_total_num_tokens": first.get("max_total_num_tokens"),
            "max_total_tokens": first.get("max_total_num_tokens"),
            "max_running_requests": first.get("max_running_requests"),
            "internal_states": loads}


def disaggregation_stats(state: ServerState) -> dict:
    """The worker's prefill/decode role and its transfer counters (kv/disagg_*.py stats)."""
    return state.engine.disaggregation_stats()


def model_info(state: ServerState) -> dict:
    config = _model_config(state.model_dir)
    return {"model_path": state.model_dir, "tokenizer_path": state.model_dir, "is_generation": True,
            "has_image_understanding": bool(state.engine.engine.multimodal_placeholders),
            "has_audio_understanding": False, "model_type": config.get("model_type"),
            "architectures": config.get("architectures")}


def loads(state: ServerState, include: str | None) -> dict:
    sections = [s.strip() for s in (include or "core").split(",") if s.strip()]
    if "all" in sections:
        sections = list(LOAD_SECTIONS)
    unknown = [s for s in sections if s not in LOAD_SECTIONS]
    if unknown:
        raise APIError(400, f"include: unknown section(s) {unknown}; give some of {list(LOAD_SECTIONS)} or 'all'",
                       "include")
    out = []
    for load in state.engine.loads():
        entry = {key: load[key] for key in _CORE}
        entry["num_total_reqs"] = load["num_running_reqs"] + load["num_waiting_reqs"]
        if "memory" in sections:
            entry["memory"] = {"token_capacity": load["max_total_num_tokens"]}
        if "queues" in sections:  # grammar compiles and preempted requests wait in the one queue
            entry["queues"] = {"waiting": load["num_waiting_reqs"]}
        if "disagg" in sections:
            entry["disaggregation"] = disaggregation_stats(state)
        out.append(entry)
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
            "dp_rank_count": len(out), "loads": out}


async def health_generate(state: ServerState) -> bool:
    """Generate one token (greedy, from the BOS token); True when it came within the timeout."""
    tokenizer = state.engine.tokenizer
    ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        group = await submit(state, [(ids, params, None)], "input_ids", time.perf_counter(), "max_tokens", "so_args")
        results = await asyncio.wait_for(collect(state, group), HEALTH_GENERATE_TIMEOUT_S)
    except (APIError, asyncio.TimeoutError):
        return False
    return len(results[0].token_ids) == 1


def tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    if body.model is not None:
        state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:  # the ids /v1/chat/completions would run
        fmt = state.chat_format
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            prompt = fmt.render([m.as_dict() for m in body.messages], tools, dict(body.chat_template_kwargs or {}))
        except ChatFormatError as exc:
            raise APIError(400, str(exc), exc.param) from None
        ids = fmt.tokenize(tokenizer, prompt)
    out = {"count": len(ids), "max_model_len": state.engine.engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return out


def detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    if body.model is not None:
        state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"tokens: {bad[:5]} are not token ids of this model (0 to {tokenizer.vocab_size - 1})",
                       "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
