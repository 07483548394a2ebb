"""The encode protocol between a prefill worker and its encoder workers (E/P/D disaggregation,
docs/disaggregation.md), SGLang's HTTP layout of EPD: the router (smg --pd-disaggregation) sees only
prefill and decode; a prefill started with --encoder-urls sends a request's images to encoder
workers itself, and their embeddings come back through the transfer engine into memory the prefill
registered (kv/encode_client.py; the encoder's side is kv/encode_worker.py).

    prefill  GET  <encoder>/encoder_info   the encoder's model digest, transfer backend and width
    prefill  POST <encoder>/encode         body: frame(header, payload)
        header  {"session_id": the prefill's transfer session, "backend", "model_digest",
                 "items": [{"header": the family's (CausalLM.pack_multimodal), "bytes": its payload
                            bytes, "address": where its embeddings go, "capacity": bytes there}]}
        payload the items' encoder inputs back to back
    encoder  unpacks the items, encodes them in one pass and writes each item's span embeddings
             ([span length, hidden] bfloat16, row-major) to its address with one batch of one-sided
             writes, then answers 200 {"items": [{"rows", "bytes"}], "bytes", "encode_seconds",
             "write_seconds"}, or {"error": why} with 400 (the items cannot be read), 409 (this encoder
             cannot serve that prefill: another model or transfer engine) or 503 (the write failed).

Embeddings move as bfloat16: the language model reads them rounded to bfloat16, so this is exact."""

from __future__ import annotations

import json
import struct

import torch

EMBED_DTYPE = torch.bfloat16
_LEN = struct.Struct(">I")


def frame(header: dict, payload: bytes | list[bytes]) -> bytes:
    """A request body: the header's JSON length (4 bytes, big-endian), the JSON, the payload."""
    head = json.dumps(header).encode()
    parts = payload if isinstance(payload, list) else [payload]
    return b"".join([_LEN.pack(len(head)), head, *parts])


def unframe(body: bytes) -> tuple[dict, memoryview]:
    """(header, payload) of a body `frame` made; ValueError when it is not one."""
    if len(body) < _LEN.size:
        raise ValueError("the body is shorter than its header length")
    (n,) = _LEN.unpack_from(body)
    if _LEN.size + n > len(body):
        raise ValueError(f"the body's header claims {n} bytes, the body has {len(body) - _LEN.size}")
    try:
        header = json.loads(body[_LEN.size:_LEN.size + n])
    except ValueError as exc:
        raise ValueError(f"the body's header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("the body's header is not a JSON object")
    return header, memoryview(body)[_LEN.size + n:]


def embed_bytes(rows: int, hidden: int) -> int:
    """Bytes of `rows` embeddings of width `hidden`, as they move."""
    return rows * hidden * EMBED_DTYPE.itemsize
