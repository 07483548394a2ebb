"""The model fingerprint every store key is salted with: pages computed by one model (weights,
config, compute dtype, page layout, tokenizer) are never read by another. Image content is already
in the page keys (core/prefix_cache.py keys a page with the digests of the images it overlaps).

Weights are hashed whole up to FULL_HASH_BYTES of checkpoint; a larger checkpoint (hundreds of GB)
is identified by each file's name, size, safetensors header and sampled chunks, which two different
checkpoints share only if they are byte-identical in every sample."""

from __future__ import annotations

import hashlib
import os
import pathlib

import torch

FORMAT_VERSION = b"deepinfer-kv-page-v1"
FULL_HASH_BYTES = 1 << 30
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 16


def _file_digest(path: pathlib.Path, h, whole: bool) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        if whole:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
            return
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(head + f.read(min(header_len, 1 << 26)))  # safetensors: names, shapes, dtypes, offsets
        for i in range(_SAMPLES):
            f.seek(size * i // _SAMPLES)
            h.update(f.read(_SAMPLE_BYTES))


def model_fingerprint(model_dir, tokenizer, spec, page_tokens: int, dtype: torch.dtype) -> bytes:
    """16 bytes naming what a page of this engine holds. `spec`: the model's CacheSpec (pool names,
    widths, strides and dtypes: a layout that splits pools has other widths)."""
    h = hashlib.blake2b(FORMAT_VERSION, digest_size=16)
    root = pathlib.Path(model_dir)
    weights = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    whole = sum(p.stat().st_size for p in weights) <= FULL_HASH_BYTES
    for name in ("config.json", "generation_config.json"):
        if (root / name).is_file():
            h.update((root / name).read_bytes())
    for path in weights:
        _file_digest(path, h, whole)
    tok = pathlib.Path(os.fspath(tokenizer)) if tokenizer is not None else root
    tok_file = tok / "tokenizer.json" if tok.is_dir() else tok
    if tok_file.is_file():
        h.update(hashlib.blake2b(tok_file.read_bytes(), digest_size=16).digest())
    h.update(repr([(p.name, p.width, p.stride, str(p.dtype or dtype)) for p in spec.pools if p.stride]).encode())
    h.update(f"page_tokens={page_tokens};dtype={dtype}".encode())
    return h.digest()
