"""What the completion and chat handlers share: the server's state, OpenAI-shaped errors,
request fields -> SamplingParams, queueing into the engine, server-sent events, and racing a
handler against the client's disconnect (an abandoned request is aborted at once).

Request ids: the HTTP layer (api_server.Guard) puts each request's id - the client's
`X-Request-Id`, else a fresh one - in REQUEST_ID for the handler; the engine requests are named
after it (`<id>`, or `<id>-<i>` for several prompts / choices), so logs, /generate's meta_info.id
and the response header all carry the id the client or router chose."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextvars import ContextVar
from dataclasses import dataclass

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse

from deepinfer.core.request import KV_TRANSFER_FAILED
from deepinfer.entrypoints.async_llm import AsyncLLM, EngineDead, InvalidRequest, QueueFull
from deepinfer.entrypoints.streams import Delta, RequestGroup
from deepinfer.entrypoints.chat import ChatFormat
from deepinfer.sampling_params import SamplingParams

_UINT64 = 1 << 64
logger = logging.getLogger("deepinfer.server")

# the id of the HTTP request being handled (set by api_server.Guard for every request)
REQUEST_ID: ContextVar[str] = ContextVar("deepinfer_request_id", default="")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServerState:
    engine: AsyncLLM
    chat_format: ChatFormat
    served_model_names: list[str]
    model_dir: str

    def check_model(self, name: str) -> None:
        if name not in self.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves {self.served_model_names}",
                           "model", "model_not_found")


# request fields passed to SamplingParams as they are (protocol._Sampling)
VLLM_FIELDS = ("frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "min_p", "min_tokens",
               "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens")


def make_params(body, n: int, *, max_tokens: int, max_tokens_field: str, top_logprobs: int = 0,
                prompt_logprobs: int | None = None, so_args: dict | None = None,
                so_field: str = "so_args", logprobs_field: str = "logprobs") -> list[SamplingParams]:
    """One SamplingParams per choice; SamplingParams validates, and its error is reported under
    the request field it came from. With a seed, choice i gets seed + i: reproducible and
    different from its siblings."""
    fields = {"seq_seed": "seed", "max_tokens": max_tokens_field, "so_args": so_field,
              "top_logprobs": logprobs_field, "prompt_logprobs": logprobs_field}
    out = []
    for i in range(n):
        seed = None if body.seed is None else body.seed + i
        if seed is not None and body.seed >= 0:
            seed %= _UINT64
        try:
            out.append(SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=max_tokens,
                ignore_eos=body.ignore_eos, stop=body.stop, stop_token_ids=body.stop_token_ids,
                top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs, seq_seed=seed, so_args=so_args,
                **{name: getattr(body, name) for name in VLLM_FIELDS}))
        except (ValueError, TypeError) as exc:
            name = str(exc).split(" ", 1)[0].split("[", 1)[0]
            param = fields.get(name, name)
            raise APIError(400, str(exc) if param == name else f"{param}: {exc}", param) from None
    return out


def engine_request_ids(n: int) -> list[str]:
    """The engine request ids of an HTTP request with `n` prompts x choices, named after its id."""
    base = REQUEST_ID.get() or uuid.uuid4().hex  # set for every HTTP request; a fresh one otherwise
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


async def submit(state: ServerState, items: list[tuple], prompt_field: str, arrival: float,
                 max_tokens_field: str, so_field: str, data_parallel_rank: int | None = None,
                 disagg=None) -> RequestGroup:
    """Queue every prompt x choice (on `data_parallel_rank` when given; `disagg`: its prefill/decode
    room, kv/disagg.py Bootstrap), mapping the engine's refusals to HTTP errors."""
    ids = engine_request_ids(len(items))
    logger.debug("request %s: %d engine request(s), data_parallel_rank=%s", REQUEST_ID.get(), len(ids),
                 data_parallel_rank)
    try:
        extra = {} if disagg is None else {"disagg": disagg}
        return await state.engine.add(items, arrival, ids, data_parallel_rank=data_parallel_rank, **extra)
    except InvalidRequest as exc:
        text = str(exc)
        first = text.split(" ", 1)[0]
        param = exc.param or (first if first in VLLM_FIELDS else max_tokens_field if "max_tokens" in text else
                              so_field if "so_args" in text else prompt_field)
        raise APIError(400, text, param) from None
    except QueueFull as exc:
        raise APIError(503, str(exc), None, "queue_full", "server_error") from None
    except EngineDead as exc:
        raise APIError(503, str(exc), None, "unavailable", "server_error") from None


def bootstrap_of(body, num_requests: int, state: ServerState):
    """The request's prefill/decode room (kv/disagg.py Bootstrap) when a PD router sent one: SGLang's
    bootstrap_host, bootstrap_port and bootstrap_room (smg --pd-disaggregation), or vLLM's
    kv_transfer_params (vllm-router --vllm-pd-disaggregation; entrypoints/kv_transfer_params.py); else None."""
    from deepinfer.entrypoints import kv_transfer_params as vllm_pd

    given = [name for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if getattr(body, name) is not None]
    kv = getattr(body, "kv_transfer_params", None)
    if vllm_pd.requested(kv):
        if given:
            raise APIError(400, "kv_transfer_params (vLLM's prefill/decode protocol) and bootstrap_host/port/room "
                                "(SGLang's) both name a room: send one of them", "kv_transfer_params")
        if num_requests != 1:
            raise APIError(400, "a prefill/decode request carries one prompt with n=1; send the others as their "
                                "own requests", "kv_transfer_params")
        try:
            return vllm_pd.room_of(kv, state.engine.disaggregation_mode, bool(getattr(body, "stream", False)))
        except vllm_pd.KVTransferError as exc:
            raise APIError(400, str(exc), exc.param) from None
    if not given:
        return None
    if len(given) < 3:
        missing = sorted({"bootstrap_host", "bootstrap_port", "bootstrap_room"} - set(given))
        raise APIError(400, f"{', '.join(missing)} missing: a prefill/decode request names all three bootstrap "
                            "fields (smg --pd-disaggregation adds them)", missing[0])
    if num_requests != 1:
        raise APIError(400, "a prefill/decode request carries one prompt with n=1 (one bootstrap_room); send "
                            "the others as their own requests", "bootstrap_room")
    from deepinfer.kv.disagg import Bootstrap

    return Bootstrap(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room)


def kv_transfer_answer(body, state: ServerState, room) -> dict | None:
    """What a prefill worker's response carries for vLLM's decode worker (kv_transfer_params), else None."""
    from deepinfer.entrypoints import kv_transfer_params as vllm_pd

    kv = getattr(body, "kv_transfer_params", None)
    if room is None or not vllm_pd.requested(kv) or not kv.get("do_remote_decode"):
        return None
    return state.engine.kv_transfer_params(room.room)


def sse(payload) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    error = exc if isinstance(exc, APIError) else APIError(500, str(exc), type="server_error")
    return sse(json.dumps(error.body()))


async def event_stream(state: ServerState, group: RequestGroup, events):
    """Server-sent events around a route's own chunks (`events`, an async generator): [DONE] at the
    end; the engine stopping under the stream reported as an error event, then [DONE] as usual; the
    group's engine requests aborted however the stream ends (the client gone included)."""
    try:
        async for event in events:
            yield event
        yield sse("[DONE]")
    except EngineDead as exc:
        yield sse_error(APIError(503, str(exc), None, "unavailable", "server_error"))
        yield sse("[DONE]")
    finally:
        await events.aclose()
        if not group.finished:
            state.engine.abort(group.request_ids)


class EventStream(StreamingResponse):
    """Server-sent events that stop the moment the client disconnects: starlette otherwise
    notices only at the next write, which for a queued or slow request can be much later. The
    body iterator is closed either way, so its `finally` aborts the engine requests."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def unless_disconnected(request: Request, work):
    """Await `work` (a coroutine) unless the client disconnects first, which cancels it (its
    cleanup aborts the engine requests); returns None then."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return None
    return task.result()


async def collect(state: ServerState, group: RequestGroup, so_field: str = "so_args"):
    """Every request's deltas merged into one final delta each (non-streaming responses). The
    engine ends a request with an error only when its grammar failed to compile in time."""
    results = [Delta() for _ in group.request_ids]
    try:
        async for index, delta in group.deltas():
            results[index].merge(delta)
    except EngineDead as exc:
        raise APIError(503, str(exc), None, "unavailable", "server_error") from None
    finally:
        if not group.finished:
            state.engine.abort(group.request_ids)
    failed = next((r for r in results if r.error), None)
    if failed:
        raise delta_error(failed, so_field)
    return results


def delta_error(delta, so_field: str) -> APIError:
    """The HTTP error of a request the engine ended with an error: its grammar failed (400 on the
    grammar's field), or its decode state never came from the prefill worker (502, an upstream fault)."""
    if delta.stop_reason == KV_TRANSFER_FAILED:
        return APIError(502, delta.error, None, "kv_transfer_failed", "server_error")
    return APIError(400, delta.error, so_field)
