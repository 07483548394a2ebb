"""L3 on a directory (local disk, NFS, a 3FS mount): one file per page record.

Writes are atomic: a record goes to a temporary file in the same directory, then os.replace puts it
under its name, so a reader sees a whole record or none, and replicas writing the same key at once
each replace it with a whole record of the same page. A file read that fails (deleted or replaced
meanwhile) is a miss. Least recently used records go when the directory exceeds its byte budget:
reads touch a file's mtime, so replicas sharing the directory share one recency order."""

from __future__ import annotations

import os
import threading
import uuid
from typing import Sequence

from deepinfer.kv.page_store import StoreError

DEFAULT_BUDGET = 64 << 30


class FileStore:
    medium = "DISK"

    def __init__(self, root: str, budget_bytes: int | None = None):
        self.root = os.path.abspath(root)
        self.budget = budget_bytes or DEFAULT_BUDGET
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_store file://{root}: cannot create the directory ({exc})") from None
        self._lock = threading.Lock()
        self._bytes = sum(size for _, size, _ in self._records())

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    def _records(self):
        """(path, size, mtime) of every record in the directory."""
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if not entry.name.startswith("."):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    yield entry.path, st.st_size, st.st_mtime

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not os.path.exists(self._path(key)):
                return i
        return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        out = []
        for key in keys:
            path = self._path(key)
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except FileNotFoundError:  # evicted, or deleted by another replica meanwhile
                out.append(None)
                continue
            try:
                os.utime(path)  # recently used: the budget evicts others first
            except OSError:  # a read-only directory still serves reads
                pass
        return out

    def batch_put(self, keys: Sequence[str], records: Sequence[bytes]) -> list[str]:
        written = 0
        for key, record in zip(keys, records):
            path = self._path(key)
            if os.path.exists(path):
                continue
            tmp = os.path.join(os.path.dirname(path), f".tmp-{uuid.uuid4().hex}")
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(record)
                os.replace(tmp, path)
            except OSError as exc:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise StoreError(f"cannot write {path}: {exc}") from exc
            written += len(record)
        if written:
            with self._lock:
                self._bytes += written
                over = self._bytes > self.budget
            if over:
                return self._evict()
        return []

    def _evict(self) -> list[str]:
        """Delete least recently used records until the directory is at 90% of its budget; returns
        their keys."""
        records = sorted(self._records(), key=lambda r: r[2])
        total = sum(size for _, size, _ in records)
        evicted = []
        for path, size, _ in records:
            if total <= self.budget * 0.9:
                break
            try:
                os.unlink(path)
                total -= size
                evicted.append(os.path.basename(path))
            except FileNotFoundError:  # another replica evicted it
                total -= size
            except OSError:
                break
        with self._lock:
            self._bytes = total
        return evicted

    def size_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        pass
