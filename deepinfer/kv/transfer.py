"""The transfer engines P/D disaggregation moves decode state with (--disaggregation-transfer-backend):

- mooncake: Mooncake's TransferEngine (PyPI `mooncake-transfer-engine-non-cuda` on CPU hosts,
  `mooncake-transfer-engine` with CUDA), in its P2PHANDSHAKE mode (peers find each other by
  `host:rpc_port`, no metadata server);
- nixl: NVIDIA's NIXL agent with its UCX backend (PyPI `nixl`, or `nixl-cu12` alone), peers exchanging
  metadata through NIXL's listener thread (`host:port/agent`, no etcd).

Both sides register their cache pools as memory regions once; a transfer is a batch of one-sided
writes (source address in this process, destination address in the peer's registered memory), the
same call whether the wire is TCP or shared memory (what runs here), RDMA or NVLink."""

from __future__ import annotations

import socket
import threading
import time
import uuid

from deepinfer import envs

BACKENDS = ("mooncake", "nixl")
PROTOCOLS = ("tcp", "rdma")


class TransferError(RuntimeError):
    """A write to the peer failed (the peer is gone, or its memory is not registered)."""


class MooncakeTransport:
    """One Mooncake TransferEngine: this process's registered regions and its writes to peers."""

    # a write is one blocking call (this wheel's batch status call waits too): never on the engine thread
    posts_writes = False

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

    def close(self) -> None:
        """Nothing to stop: the engine's threads go with the process."""

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


def _nixl_api():
    """NIXL's Python API: the `nixl` meta package picks the wheel for the CUDA it finds; without it,
    the CUDA 12 or 13 wheel as installed (either runs UCX on host memory)."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise RuntimeError("--disaggregation-transfer-backend nixl needs NIXL: pip install nixl (with CUDA), or "
                       "nixl-cu12 alone on CPU hosts; or use --disaggregation-transfer-backend mooncake")


class NixlTransport:
    """One NIXL agent (UCX backend): this process's registered regions and its writes to peers. A
    peer is `host:port/agent`, its listener thread's address and agent name; its metadata (which
    regions it registered) is fetched from that listener at the first write to it.

    Progress: a writer drives its own transfers while it polls them. The side written to must
    progress too (UCX's connection set-up, and transports that emulate remote writes, such as
    TCP): NIXL's own progress thread spins without pause (~70% of a core while idle, measured), so
    `receives` starts a thread of ours that progresses every PROGRESS_PERIOD_S instead."""

    PROGRESS_PERIOD_S = 0.001
    posts_writes = True  # start_write posts, NixlWrite.wait polls: the engine thread may write (kv/disagg_prefill.py)

    def __init__(self, host: str, protocol: str = "tcp", device: str = "", timeout: float = 30.0,
                 receives: bool = False):
        if protocol not in PROTOCOLS:
            raise ValueError(f"--disaggregation-transfer-protocol must be one of {PROTOCOLS}, got {protocol!r}")
        envs.default_ucx_settings(tcp=protocol == "tcp", devices=device)
        api = _nixl_api()
        port = _free_port(host)
        self.name = f"deepinfer-{uuid.uuid4().hex[:12]}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=True,
                                                                     listen_port=port))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL started without its UCX backend (its plugins: "
                               f"{', '.join(self.agent.plugin_list)}): reinstall nixl")
        self.session_id = f"{host}:{port}/{self.name}"  # what a peer writes to
        self.timeout = timeout
        self._peers: set[str] = set()  # agents whose metadata this one holds
        self._lock = threading.Lock()  # guards _peers: one metadata fetch per peer
        self._stopped = threading.Event()
        if receives:
            threading.Thread(target=self._progress, name="deepinfer-nixl-progress", daemon=True).start()

    def _progress(self) -> None:
        while not self._stopped.wait(self.PROGRESS_PERIOD_S):
            self.agent.get_new_notifs()  # progresses the UCX workers

    def close(self) -> None:
        """Stop progressing (the worker is shutting down)."""
        self._stopped.set()

    def register(self, address: int, length: int) -> None:
        self.agent.register_memory([(address, length, 0, "")], "DRAM")

    def connected(self, peer: str) -> bool:
        """Whether this agent holds `peer`'s metadata (a write to it needs no fetch first)."""
        return _nixl_peer(peer)[0] in self._peers

    def connect(self, peer: str) -> None:
        """Fetch `peer`'s metadata from its listener (once), waiting at most the timeout."""
        name, host, port = _nixl_peer(peer)
        deadline = time.monotonic() + self.timeout
        with self._lock:
            if name in self._peers:
                return
            self.agent.fetch_remote_metadata(name, host, port)
            while not self.agent.check_remote_metadata(name):
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL agent {name} at {host}:{port} did not send its metadata within "
                                        f"{self.timeout:.0f} s: the peer is gone or unreachable")
                time.sleep(0.001)
            self._peers.add(name)

    def start_write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> "NixlWrite":
        """Post one-sided writes of src[i] (here) to dst[i] (peer's registered memory), lengths[i]
        bytes each; the returned write is polled to completion (`wait`). Thread-safe: NIXL's agent
        serializes its calls (its strict sync mode, on with the listener thread)."""
        self.connect(peer)
        name = _nixl_peer(peer)[0]
        what = f"NIXL write of {sum(lengths)} bytes in {len(src)} segment(s) to {peer}"
        try:
            handle = self.agent.initialize_xfer(
                "WRITE", self.agent.get_xfer_descs([(a, n, 0) for a, n in zip(src, lengths)], "DRAM"),
                self.agent.get_xfer_descs([(a, n, 0) for a, n in zip(dst, lengths)], "DRAM"), name)
            state = self.agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - NIXL's errors are its own exception types
            self._forget(name)
            raise TransferError(f"{what} could not start: {exc}") from None
        return NixlWrite(self.agent, lambda: self._forget(name), handle, state, what,
                         time.monotonic() + self.timeout)

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """One-sided writes of src[i] (here) to dst[i] (peer's registered memory), lengths[i] bytes each."""
        if src:
            self.start_write(peer, src, dst, lengths).wait(self.timeout)

    def _forget(self, name: str) -> None:
        """Drop a peer's metadata after a failure: the next write fetches it again."""
        with self._lock:
            if name not in self._peers:
                return
            self._peers.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - already gone
                pass


class NixlWrite:
    """A posted NIXL write of `agent`'s: `wait` polls it (the writer's polls progress it). `forget()`
    drops the peer's metadata when it fails. Polls back to back for SPIN_S (a write here takes
    0.1-0.5 ms), then POLL_S apart."""

    SPIN_S, POLL_S = 0.002, 0.0002

    def __init__(self, agent, forget, handle, state: str, what: str, deadline: float):
        self.agent, self.forget, self.handle, self.state = agent, forget, handle, state
        self.what, self.deadline = what, deadline

    def wait(self, seconds: float) -> bool:
        """Poll for up to `seconds`: True once the bytes are written, False while it is still going;
        TransferError when it failed or outlived the transport's timeout."""
        start = time.monotonic()
        until = min(start + seconds, self.deadline)
        while self.state == "PROC" and (now := time.monotonic()) < until:
            self.state = self.agent.check_xfer_state(self.handle)
            if now - start > self.SPIN_S:  # a slow write: stop holding the GIL the engine thread wants
                time.sleep(self.POLL_S)
        if self.state == "PROC" and time.monotonic() < self.deadline:
            return False
        self.agent.release_xfer_handle(self.handle)
        if self.state != "DONE":
            self.forget()
            raise TransferError(self.what + (" timed out" if self.state == "PROC" else " failed")
                                + ": the peer is gone or unreachable")
        return True


def _nixl_peer(peer: str) -> tuple[str, str, int]:
    """`host:port/agent` -> (agent, host, port)."""
    try:
        address, name = peer.rsplit("/", 1)
        host, port = address.rsplit(":", 1)
        return name, host, int(port)
    except ValueError:
        raise TransferError(f"{peer!r} is not a NIXL peer (host:port/agent): is the other side's "
                            "--disaggregation-transfer-backend nixl too?") from None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_transport(backend: str, host: str, protocol: str = "tcp", device: str = "", timeout: float = 30.0,
                   receives: bool = False):
    """The transfer engine of `backend`; `timeout`: how long a NIXL write may take (Mooncake's own);
    `receives`: peers write into this process's memory (a decode worker)."""
    if backend == "mooncake":
        return MooncakeTransport(host, protocol, device)
    if backend == "nixl":
        return NixlTransport(host, protocol, device, timeout, receives)
    raise ValueError(f"--disaggregation-transfer-backend must be one of {BACKENDS}, got {backend!r}")
