"""The L3 interface: a page store keeps page records (kv/page_record.py) by key, in batches, as
SGLang's HiCache storage backends do (batch_exists / batch_get / batch_set). Keys are strings the
tiered store builds (the model fingerprint and the page's chained hash, kv/tiered.py), so a backend
never interprets them. A backend may fail: it raises StoreError (or OSError) and the tiered store
counts a miss; it never returns a record it did not store (the record's checksum is checked anyway).
"""

from __future__ import annotations

from typing import Protocol, Sequence
from urllib.parse import parse_qs, urlparse


class StoreError(RuntimeError):
    """The store could not be reached or refused an operation."""


class PageStore(Protocol):
    medium: str  # how KV events name the tier ("DISK" for files, "MOONCAKE" for Mooncake Store)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the store holds (a prefix: lookups stop at a miss)."""

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The records of `keys` (None where missing)."""

    def batch_put(self, keys: Sequence[str], records: Sequence[bytes]) -> list[str]:
        """Store records; a key that exists is left as it is (its record is the same page). Returns the
        keys of records the store dropped to make room (for KV events; [] where the backend's
        evictions happen elsewhere, as in Mooncake's master)."""

    def size_bytes(self) -> int:
        """Bytes the store holds for this process's view (0 when the backend does not say)."""

    def close(self) -> None: ...


def open_page_store(url: str) -> PageStore:
    """`file:///dir[?max_bytes=N]` (a directory: local disk, NFS, a 3FS mount; N its byte budget) or
    `mooncake://host:port` (a Mooncake Store master)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        from deepinfer.kv.file_store import FileStore

        if not parsed.path:
            raise ValueError(f"kv_store {url!r}: a file store needs a directory, e.g. file:///var/cache/deepinfer")
        query = parse_qs(parsed.query)
        if set(query) - {"max_bytes"}:
            raise ValueError(f"kv_store {url!r}: a file store takes only ?max_bytes=N (its byte budget)")
        budget = query.get("max_bytes", [None])[-1]
        if budget is not None and not (budget.isdigit() and int(budget) > 0):
            raise ValueError(f"kv_store {url!r}: max_bytes must be a positive integer (bytes), got {budget!r}")
        return FileStore(parsed.path, int(budget) if budget is not None else None)
    if parsed.scheme == "mooncake":
        from deepinfer.kv.mooncake_store import MooncakeStore

        if not parsed.hostname or not parsed.port:
            raise ValueError(f"kv_store {url!r}: give the Mooncake master as mooncake://host:port")
        return MooncakeStore(parsed.hostname, parsed.port)
    raise ValueError(f"kv_store {url!r}: use file:///path/to/dir or mooncake://host:port")
