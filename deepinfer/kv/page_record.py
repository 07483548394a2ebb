"""A page's record in a page store: a header naming what it is, then the page's rows of every paged
pool of the model's cache spec, in the spec's order (what a page holds in the cache pool, and nothing
else: the sliding window is rebuilt by bounded replay, as for a hit in the pool).

Header: MAGIC, the model fingerprint (kv/fingerprint.py), the page key, the payload's length and its
BLAKE2b checksum. A record whose header or checksum does not match what the reader expects (a flipped
byte, a truncated file, another model's page under a colliding name) is rejected: a counted miss."""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"DIKVPG01"
_HEADER = struct.Struct("<8s16s16sQ16s")
HEADER_BYTES = _HEADER.size


class BadRecord(ValueError):
    """The record is not the page asked for, or its bytes were damaged."""


def _checksum(payload) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode(fingerprint: bytes, key: bytes, payload) -> bytes:
    """`payload`: the page's bytes (a bytes-like object)."""
    return _HEADER.pack(MAGIC, fingerprint, key, len(payload), _checksum(payload)) + bytes(payload)


def decode(record: bytes, fingerprint: bytes, key: bytes, payload_bytes: int) -> memoryview:
    """The payload of `record` if it is the page `key` of the model `fingerprint`, whole and undamaged."""
    if len(record) < HEADER_BYTES:
        raise BadRecord(f"truncated header ({len(record)} bytes)")
    magic, fp, k, n, checksum = _HEADER.unpack_from(record)
    if magic != MAGIC:
        raise BadRecord("not a deepinfer page record")
    if fp != fingerprint or k != key:
        raise BadRecord("a page of another model or another prefix")
    payload = memoryview(record)[HEADER_BYTES:]
    if n != payload_bytes or len(payload) != n:
        raise BadRecord(f"payload of {len(payload)} bytes, header says {n}, the model's page has {payload_bytes}")
    if _checksum(payload) != checksum:
        raise BadRecord("checksum mismatch")
    return payload
