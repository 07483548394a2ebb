"""Encode/prefill/decode disaggregation: the settings of a worker's role (`deepinfer serve
--disaggregation-mode prefill|decode|encode`, `--encoder-urls`: SGLang's flag names) and the role
objects the server's engine thread drives (kv/disagg_prefill.py, kv/disagg_decode.py; an encoder
worker is kv/encode_worker.py, a prefill's calls to it kv/encode_client.py). docs/disaggregation.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from deepinfer.kv.transfer import BACKENDS, PROTOCOLS

MODES = ("null", "prefill", "decode", "encode")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's and smg's default


class Bootstrap(NamedTuple):
    """Where a request's decode state comes from (decode) or is asked for (prefill): the fields a
    PD router adds to the request body."""

    host: str
    port: int
    room: int


@dataclass(frozen=True, slots=True)
class DisaggregationConfig:
    mode: str = "null"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    transfer_backend: str = "mooncake"
    transfer_protocol: str = "tcp"
    ib_device: str = ""
    # seconds a side waits for the other: decode for prefill's first token and state, prefill for
    # decode to ask for a finished request's state (then it frees its pages)
    transfer_timeout: float = 30.0
    # encoder workers (--disaggregation-mode encode) a prefill (or colocated) worker sends its
    # requests' images to (kv/encode_client.py); empty: it runs its own encoder
    encoder_urls: tuple[str, ...] = ()
    encoder_buffer_mb: int = 0  # the registered arena encoders write embeddings into; 0: two contexts' worth

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be one of {MODES}, got {self.mode!r}")
        if self.encoder_urls and self.mode not in ("null", "prefill"):
            raise ValueError(f"--encoder-urls is for the worker that runs prompts (--disaggregation-mode prefill, or "
                             f"none): a {self.mode} worker never encodes images")
        if self.encoder_buffer_mb < 0:
            raise ValueError(f"--encoder-buffer-mb must be >= 0 (0: sized from the context), got {self.encoder_buffer_mb}")
        for url in self.encoder_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--encoder-urls: {url!r} is not an encoder worker's URL (http://host:port)")
        if self.transfer_backend not in BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {BACKENDS}, "
                             f"got {self.transfer_backend!r}")
        if self.transfer_protocol not in PROTOCOLS:
            raise ValueError(f"--disaggregation-transfer-protocol must be one of {PROTOCOLS}, "
                             f"got {self.transfer_protocol!r}")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"--disaggregation-bootstrap-port must be a port (0 to 65535), got {self.bootstrap_port}")
        if not self.transfer_timeout > 0:
            raise ValueError(f"--disaggregation-transfer-timeout must be > 0 seconds, got {self.transfer_timeout}")

    @property
    def enabled(self) -> bool:
        return self.mode != "null"


def make_role(config: DisaggregationConfig, engine, model_dir: str, host: str, post):
    """The role object of a disaggregated worker (None for "null"). `post(fn)` runs fn on the engine
    thread (AsyncLLM's command queue): the roles' threads change the engine only through it."""
    config.validate()
    if not config.enabled:
        return None
    if config.mode == "encode":
        raise ValueError("an encoder worker runs no language model: kv/encode_worker.py serves it")
    from deepinfer.kv.transfer import make_transport

    transport = make_transport(config.transfer_backend, host, config.transfer_protocol, config.ib_device,
                               config.transfer_timeout, receives=config.mode == "decode")
    if config.mode == "prefill":
        from deepinfer.kv.disagg_prefill import PrefillRole
        return PrefillRole(config, engine, model_dir, host, transport, post)
    from deepinfer.kv.disagg_decode import DecodeRole
    return DecodeRole(config, engine, model_dir, transport, post)
