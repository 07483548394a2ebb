"""The transfer engine P/D disaggregation moves decode state with: Mooncake's TransferEngine
(PyPI `mooncake-transfer-engine-non-cuda` on CPU hosts, `mooncake-transfer-engine` with CUDA), in
its P2PHANDSHAKE mode (peers find each other by `host:rpc_port`, no metadata server).

Both sides register their cache pools as memory regions once; a transfer is a batch of one-sided
writes (source address in this process, destination address in the peer's registered memory), the
same call whether the protocol is TCP (what runs here), RDMA or NVLink. NIXL is the other backend
SGLang and vLLM use; it is named by --disaggregation-transfer-backend but not wired here yet."""

from __future__ import annotations

import threading

BACKENDS = ("mooncake", "nixl")
PROTOCOLS = ("tcp", "rdma")


class TransferError(RuntimeError):
    """A write to the peer failed (the peer is gone, or its memory is not registered)."""


class MooncakeTransport:
    """One Mooncake TransferEngine: this process's registered regions and its writes to peers."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = ""):
        if protocol not in PROTOCOLS:
            raise ValueError(f"--disaggregation-transfer-protocol must be one of {PROTOCOLS}, got {protocol!r}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(
                "--disaggregation-transfer-backend mooncake needs Mooncake's transfer engine: pip install "
                "mooncake-transfer-engine-non-cuda (CPU hosts; mooncake-transfer-engine with CUDA) and, on Debian, "
                f"apt-get install libibverbs1 (it is loaded even for TCP): {exc}") from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake's TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}, "
                               f"{device!r}) returned {rc}: check --disaggregation-ib-device and the protocol")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"  # what a peer writes to
        self._lock = threading.Lock()  # one batch at a time per engine (its Python binding is not reentrant)

    def register(self, address: int, length: int) -> None:
        rc = self.engine.register_memory(address, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {length} bytes at {address:#x} (rc={rc})")

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """One-sided writes of src[i] (here) to dst[i] (peer's registered memory), lengths[i] bytes each."""
        if not src:
            return
        with self._lock:
            rc = self.engine.batch_transfer_sync_write(peer, src, dst, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake write of {sum(lengths)} bytes in {len(src)} segment(s) to {peer} failed "
                                f"(rc={rc}): the peer is unreachable or its memory is not registered")


def make_transport(backend: str, host: str, protocol: str = "tcp", device: str = "") -> MooncakeTransport:
    if backend == "mooncake":
        return MooncakeTransport(host, protocol, device)
    if backend == "nixl":
        try:
            import nixl  # noqa: F401
        except ImportError:
            raise RuntimeError("--disaggregation-transfer-backend nixl: NIXL is not installed (pip install --no-deps "
                               "nixl nixl-cu12 numpy gives its UCX path on CPU); or use mooncake") from None
        raise RuntimeError("--disaggregation-transfer-backend nixl is not wired in deepinfer yet "
                           "(docs/disaggregation.md); use --disaggregation-transfer-backend mooncake")
    raise ValueError(f"--disaggregation-transfer-backend must be one of {BACKENDS}, got {backend!r}")
