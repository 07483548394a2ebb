"""An encoder worker (`deepinfer serve --disaggregation-mode encode`): the model family's multimodal
encoder alone (V4.1: the vision tower, not the language model), serving prefill workers' /encode
calls (kv/encode_protocol.py). Encoder passes run one at a time on one thread, off the event loop;
each call's embeddings are staged in a registered buffer and written into the caller's arena with
one batch of one-sided writes."""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from deepinfer.kv.encode_protocol import EMBED_DTYPE, embed_bytes, unframe
from deepinfer.kv.transfer import TransferError
from deepinfer.kv.transfer_layout import model_digest

logger = logging.getLogger("deepinfer.kv")


class EncodeRefused(ValueError):
    """A call this encoder will not serve: `status` is the HTTP answer (400, 409 or 503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EncodeWorker:
    def __init__(self, model_dir: str, config, host: str, accelerator: str | None = None):
        from deepinfer.backends import get_accelerator
        from deepinfer.core.loader import load_checkpoint
        from deepinfer.kv.transfer import make_transport
        from deepinfer.models.registry import load_config

        config.validate()
        model_cfg, model_cls = load_config(model_dir)
        self.accel = get_accelerator(accelerator)
        weights, _ = load_checkpoint(model_dir, model_cls.encoder_tensors(model_cfg), model_cls, subset=True)
        self.encoder = model_cls.make_encoder(model_cfg, weights, self.accel)
        self.model = os.path.basename(os.path.normpath(model_dir))
        self.digest = model_digest(model_dir)
        self.backend = config.transfer_backend
        self.transport = make_transport(config.transfer_backend, host, config.transfer_protocol, config.ib_device,
                                        config.transfer_timeout)
        self.staging = torch.empty(0, dtype=torch.uint8)  # registered; grows to the largest call's output
        self._retired: list[torch.Tensor] = []
        self.run_lock = threading.Lock()  # one encoder pass (and its write) at a time
        self.lock = threading.Lock()
        self.in_flight = 0
        self.draining = False
        self.counters = {"calls": 0, "items": 0, "refused": 0, "failed_writes": 0, "bytes": 0, "encode_seconds": 0.0,
                         "write_seconds": 0.0}
        logger.info("encoder worker for %s: transfer session %s", self.model, self.transport.session_id)

    # ------------------------------------------------------------ what the server asks
    @property
    def alive(self) -> bool:
        return not self.draining

    @property
    def num_live(self) -> int:
        return self.in_flight

    def start_draining(self, grace_seconds: float) -> None:
        self.draining = True

    def route(self) -> dict:
        return {"mode": "encode", "model": self.model, "model_digest": self.digest, "backend": self.backend,
                "hidden_size": self.encoder.hidden_size, "session_id": self.transport.session_id}

    def stats(self) -> dict:
        with self.lock:
            return {"mode": "encode", "in_flight": self.in_flight, **self.counters}

    def run(self, body: bytes) -> dict:
        """Serve one /encode call (blocking: a server thread runs it); EncodeRefused says why not."""
        with self.lock:
            self.in_flight += 1
        try:
            return self._run(body)
        except EncodeRefused:
            with self.lock:
                self.counters["refused"] += 1
            raise
        finally:
            with self.lock:
                self.in_flight -= 1

    def _run(self, body: bytes) -> dict:
        try:
            header, payload = unframe(body)
            session, items = header["session_id"], header["items"]
            if header.get("backend") != self.backend:
                raise EncodeRefused(409, f"this encoder moves embeddings with {self.backend!r}, the prefill with "
                                         f"{header.get('backend')!r}: give both the same "
                                         "--disaggregation-transfer-backend")
            if header.get("model_digest") != self.digest:
                raise EncodeRefused(409, f"this encoder serves {self.model!r} (config.json digest {self.digest}), the "
                                         f"prefill another ({header.get('model_digest')}): start both with one --model")
            inputs, start = [], 0
            for k, item in enumerate(items):
                n = int(item["bytes"])
                if start + n > len(payload):
                    raise ValueError(f"item {k} claims {n} bytes past the end of the payload")
                inputs.append(self.encoder.unpack(item["header"], bytes(payload[start:start + n])))
                start += n
        except EncodeRefused:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise EncodeRefused(400, f"the encode call cannot be read: {exc!r}") from None
        with self.run_lock:
            t0 = time.perf_counter()
            embeds = self.encoder.encode(inputs)
            t1 = time.perf_counter()
            sizes = [embed_bytes(e.shape[0], e.shape[1]) for e in embeds]
            for k, (item, n) in enumerate(zip(items, sizes)):
                if n > int(item["capacity"]):
                    raise EncodeRefused(400, f"item {k}'s embeddings take {n} bytes; the prefill reserved "
                                             f"{item['capacity']}: are both on the same --model?")
            staging = self._staging(sum(sizes))
            src, offset = [], 0
            for e, n in zip(embeds, sizes):
                staging[offset:offset + n].view(EMBED_DTYPE).view(e.shape).copy_(e.to(EMBED_DTYPE))
                src.append(staging.data_ptr() + offset)
                offset += n
            try:
                self.transport.write(session, src, [int(item["address"]) for item in items], sizes)
            except TransferError as exc:
                with self.lock:
                    self.counters["failed_writes"] += 1
                raise EncodeRefused(503, f"writing the embeddings to the prefill failed: {exc}") from None
            t2 = time.perf_counter()
        with self.lock:
            c = self.counters
            c["calls"] += 1
            c["items"] += len(items)
            c["bytes"] += sum(sizes)
            c["encode_seconds"] += t1 - t0
            c["write_seconds"] += t2 - t1
        return {"items": [{"rows": e.shape[0], "bytes": n} for e, n in zip(embeds, sizes)], "bytes": sum(sizes),
                "encode_seconds": t1 - t0, "write_seconds": t2 - t1}

    def _staging(self, nbytes: int) -> torch.Tensor:
        """The registered staging buffer, grown (and registered anew) when a call needs more."""
        if self.staging.numel() < nbytes:
            self._retired.append(self.staging)  # still registered with the transfer engine: kept alive
            self.staging = torch.empty(max(nbytes, 2 * self.staging.numel()), dtype=torch.uint8)
            self.transport.register(self.staging.data_ptr(), self.staging.numel())
        return self.staging

    def close(self) -> None:
        self.draining = True
        self.transport.close()
