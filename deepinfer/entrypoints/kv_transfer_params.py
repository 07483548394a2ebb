"""vLLM's prefill/decode protocol, as vllm-router --vllm-pd-disaggregation drives it, on the rooms of
SGLang's bootstrap protocol (kv/bootstrap.py), so both routers reach the same transfer code.

vLLM's is sequential: the router first sends the request to a prefill worker with max_tokens 1,
stream false and `kv_transfer_params: {"do_remote_decode": true}`; that worker runs the prompt,
keeps its state in a room of its own and answers with `kv_transfer_params` naming it
({"do_remote_prefill": true, "remote_host", "remote_port": its bootstrap server, "remote_request_id":
the room, ...}); the router sends the original request to a decode worker with those parameters,
and the decode worker fetches the state as it does for smg's bootstrap fields. vLLM's own workers
pull blocks by `remote_block_ids`; here prefill writes into the pages decode offers, so that list is
empty, and a room whose decode never comes is freed after --disaggregation-transfer-timeout."""

from __future__ import annotations

import secrets

from deepinfer.kv.disagg import Bootstrap

FIELD = "kv_transfer_params"


class KVTransferError(ValueError):
    """A kv_transfer_params this worker cannot serve; `param` names the field (HTTP 400)."""

    def __init__(self, message: str, param: str = FIELD):
        super().__init__(message)
        self.param = param


def requested(params: dict | None) -> bool:
    """Whether a request's kv_transfer_params ask for prefill/decode at all (both flags false or
    absent, as vLLM clients may send them, is a plain request)."""
    return bool(params) and bool(params.get("do_remote_decode") or params.get("do_remote_prefill"))


def room_of(params: dict, mode: str, stream: bool) -> Bootstrap:
    """The room of a request carrying vLLM's kv_transfer_params on a worker of this `mode`."""
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise KVTransferError(f"{FIELD}: do_remote_decode and do_remote_prefill are both true; a prefill worker "
                              "gets the first, a decode worker the second")
    if params.get("do_remote_decode"):
        if mode != "prefill":
            raise KVTransferError(f"{FIELD}.do_remote_decode: this worker is not a prefill worker (mode {mode!r}); "
                                  "start it with --disaggregation-mode prefill, or send the request without it")
        if stream:
            raise KVTransferError(f"{FIELD}.do_remote_decode: the prefill's kv_transfer_params come in one "
                                  "response; send stream false (vllm-router does)", "stream")
        return Bootstrap("", 0, secrets.randbits(63))  # this worker's own room; the response names where it is
    if mode != "decode":
        raise KVTransferError(f"{FIELD}.do_remote_prefill: this worker is not a decode worker (mode {mode!r}); "
                              "start it with --disaggregation-mode decode, or send the request without it")
    missing = [k for k in ("remote_host", "remote_port", "remote_request_id") if params.get(k) in (None, "")]
    if missing:
        raise KVTransferError(f"{FIELD}.{missing[0]} missing: a decode request carries the kv_transfer_params "
                              "its prefill worker answered with", f"{FIELD}.{missing[0]}")
    try:
        port, room = int(params["remote_port"]), int(params["remote_request_id"])
    except (TypeError, ValueError):
        raise KVTransferError(f"{FIELD}.remote_port and remote_request_id must be integers (a deepinfer prefill "
                              f"worker's bootstrap port and room), got {params['remote_port']!r} and "
                              f"{params['remote_request_id']!r}", f"{FIELD}.remote_request_id") from None
    return Bootstrap(str(params["remote_host"]), port, room)


def answer(host: str, port: int, engine_id: str, room: int) -> dict:
    """A prefill worker's kv_transfer_params for the request it keeps in `room`, in vLLM's names."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_block_ids": [], "remote_host": host, "remote_port": port, "remote_request_id": str(room),
            "tp_size": 1}
