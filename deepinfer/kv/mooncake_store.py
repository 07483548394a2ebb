"""L3 on Mooncake Store (PyPI mooncake-transfer-engine / -non-cuda; Debian's libibverbs1 even for
TCP): a `mooncake_master` at host:port keeps the index, clients pool their memory (segments) and
move records over the transfer engine (TCP here; RDMA where the machine has it).

This process joins as a client that also lends a segment (`segment_bytes`, default 256 MiB) where
records may be placed; records in it go when this process does, so a store that must outlive every
replica has long-lived clients lending memory (`mooncake_client`, or Mooncake's SSD offload).
Metadata goes peer to peer (P2PHANDSHAKE), so no etcd or HTTP metadata server is needed. A key
written twice keeps its first record (Mooncake's put of an existing key is a no-op)."""

from __future__ import annotations

import socket
from typing import Sequence

from deepinfer.kv.page_store import StoreError

SEGMENT_BYTES = 256 << 20
BUFFER_BYTES = 64 << 20


class MooncakeStore:
    medium = "MOONCAKE"

    def __init__(self, host: str, port: int, segment_bytes: int = SEGMENT_BYTES, protocol: str = "tcp"):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError(f"kv_store mooncake://{host}:{port} needs Mooncake Store: pip install "
                             f"mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine on CUDA) and apt-get "
                             f"install libibverbs1 ({exc})") from None
        self.address = f"{host}:{port}"
        self._store = MooncakeDistributedStore()
        local = "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
        rc = self._store.setup(local, "P2PHANDSHAKE", segment_bytes, BUFFER_BYTES, protocol, "", self.address)
        if rc != 0:
            raise ValueError(f"kv_store mooncake://{self.address}: cannot join the Mooncake Store (setup returned "
                             f"{rc}); is mooncake_master running there?")

    def batch_exists(self, keys: Sequence[str]) -> int:
        found = self._store.batch_is_exist(list(keys))
        if any(f < 0 for f in found):
            raise StoreError(f"Mooncake master {self.address} did not answer (error {min(found)})")
        n = 0
        while n < len(found) and found[n] == 1:
            n += 1
        return n

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [record or None for record in self._store.get_batch(list(keys))]  # b"": missing or failed

    def batch_put(self, keys: Sequence[str], records: Sequence[bytes]) -> list[str]:
        for key, record in zip(keys, records):
            rc = self._store.put(key, record)
            if rc != 0:
                raise StoreError(f"Mooncake put of {key} failed (error {rc}): the store is full or unreachable")
        return []  # the master evicts; a client is not told

    def size_bytes(self) -> int:
        return 0  # the master's metrics endpoint has the pool's usage

    def close(self) -> None:
        self._store.close()
