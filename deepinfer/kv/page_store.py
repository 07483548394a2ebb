"""The L3 interface: a page store keeps page records (kv/page_record.py) by key, in batches, as
SGLang's HiCache storage backends do (batch_exists / batch_get / batch_set). Keys are strings the
tiered store builds (the model fingerprint and the page's chained hash, kv/tiered.py), so a backend
never interprets them. A backend may fail: it raises StoreError (or OSError) and the tiered store
counts a miss; it never returns a record it did not store (the record's checksum is checked anyway).
"""

from __future__ import annotations

from typing import Protocol, Sequence
from urllib.parse import urlparse


class StoreError(RuntimeError):
    """The store could not be reached or refused an operation."""


class PageStore(Protocol):
    medium: str  # how KV events name the tier ("DISK" for files, "MOONCAKE" for Mooncake Store)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the store holds (a prefix: lookups stop at a miss)."""

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The records of `keys` (None where missing)."""

    def batch_put(self, keys: Sequence[str], records: Sequence[bytes]) -> None:
        """Store records; a key that exists is left as it is (its record is the same page)."""

    def size_bytes(self) -> int:
        """Bytes the store holds for this process's view (0 when the backend does not say)."""

    def close(self) -> None: ...


def open_page_store(url: str, budget_bytes: int | None = None) -> PageStore:
    """`file:///dir` (a directory: local disk, NFS, a 3FS mount) or `mooncake://host:port` (a
    Mooncake Store master)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        from deepinfer.kv.file_store import FileStore

        if not parsed.path:
            raise ValueError(f"kv_store {url!r}: a file store needs a directory, e.g. file:///var/cache/deepinfer")
        return FileStore(parsed.path, budget_bytes)
    if parsed.scheme == "mooncake":
        from deepinfer.kv.mooncake_store import MooncakeStore

        if not parsed.hostname or not parsed.port:
            raise ValueError(f"kv_store {url!r}: give the Mooncake master as mooncake://host:port")
        return MooncakeStore(parsed.hostname, parsed.port)
    raise ValueError(f"kv_store {url!r}: use file:///path/to/dir or mooncake://host:port")
