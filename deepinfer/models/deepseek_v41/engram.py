"""Engram (DeepSeek-V4.1): n-gram memory added to the residual stream before a few layers.

Each position hashes the token classes of itself and its last `max_ngram - 1` predecessors into one
row per (n-gram size, head) of a large table; the rows (FP8, E8M0 per 32) project to one key per hc
copy and a shared value, and a gate made from the stream and the key decides how much value each
copy takes (IMPLEMENTING.md, section 7). What is derived here, exactly as the reference derives it:

- the token-class map, from the checkpoint's tokenizer: every id decoded alone, normalised
  (NFKC, NFD, accents stripped, lowercase, whitespace runs to one space, stripped; a lone space
  survives; partial UTF-8 byte tokens keep their raw form); equal strings share a class, classes
  numbered in first-seen order;
- per layer multipliers 2r + 1 with r from numpy's default_rng(10007 * layer);
- one prime bucket size per (layer, n-gram size, head): the next prime above engram_vocab_size - 1
  not used before (our own primality test: sympy is not a runtime dependency).

The tables stay memory-mapped in the checkpoint file; a step gathers only the rows it looks up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.base import ConfigError
from deepinfer.models.deepseek_v41.config import DeepseekV41Config

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin below 3.3e24


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def token_classes(tokenizer_file: str | os.PathLike) -> np.ndarray:
    """The class of every token id ([vocab] int64) of a tokenizer.json, as the reference builds it."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(os.fspath(tokenizer_file))
    sentinel = "\ue000"  # keeps a token that is exactly one space from being stripped to nothing
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    size = tok.get_vocab_size(with_added_tokens=True)
    classes: dict[str, int] = {}
    lookup = np.empty(size, dtype=np.int64)
    for i in range(size):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte token: keyed by its raw form
            key = tok.id_to_token(i)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[i] = classes.setdefault(key, len(classes))
    return lookup


def bucket_primes(layers: int, ngram: int, heads: int, vocab_size: int) -> np.ndarray:
    """[layers, ngram - 1, heads]: per bucket the next prime above vocab_size - 1 not used before
    (engram_num_embeddings of each layer is the sum of its row)."""
    seen: set[int] = set()
    primes = np.zeros((layers, ngram - 1, heads), dtype=np.int64)
    for i in range(layers):
        for n in range(ngram - 1):
            current = vocab_size - 1
            for h in range(heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                primes[i, n, h] = current
    return primes


@dataclass(frozen=True, slots=True)
class EngramLayout:
    """Bucket sizes and multipliers of every Engram layer."""

    primes: np.ndarray  # [layers, ngram - 1, heads] int64
    offsets: np.ndarray  # [layers, (ngram - 1) * heads]: first table row of each bucket
    multipliers: np.ndarray  # [layers, ngram] int64, odd

    @classmethod
    def from_config(cls, cfg: DeepseekV41Config) -> "EngramLayout":
        ngram = cfg.engram_max_ngram_size
        primes = bucket_primes(len(cfg.engram_layer_ids), ngram, cfg.engram_n_heads, cfg.engram_vocab_size)
        flat = primes.reshape(len(primes), -1)
        offsets = np.cumsum(flat, axis=1) - flat
        bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
        multipliers = np.stack([np.random.default_rng(10007 * layer).integers(0, bound, size=(ngram,), dtype=np.int64)
                                * 2 + 1 for layer in cfg.engram_layer_ids])
        for layer, rows, want in zip(cfg.engram_layer_ids, flat.sum(axis=1), cfg.engram_num_embeddings):
            if rows != want:
                raise ConfigError(f"Engram layer {layer}: its buckets (primes from engram_vocab_size "
                                  f"{cfg.engram_vocab_size}) hold {rows} rows, engram_num_embeddings says {want}")
        return cls(primes, offsets, multipliers)


def checkpoint_token_map(cfg: DeepseekV41Config) -> np.ndarray:
    """The token classes of the checkpoint's tokenizer.json (next to its config.json), checked against
    engram_compressed_vocab_size (every multiplier derives from it), as [vocab_size] int64."""
    path = os.path.join(cfg.checkpoint_dir or "", "tokenizer.json")
    if not cfg.checkpoint_dir or not os.path.isfile(path):
        raise ConfigError(f"Engram (engram_layer_ids {cfg.engram_layer_ids}) hashes token classes built from the "
                          f"checkpoint's tokenizer: no tokenizer.json next to its config.json ({path!r})")
    lookup = token_classes(path)
    classes = int(lookup.max()) + 1
    if classes != cfg.engram_compressed_vocab_size:
        raise ConfigError(f"{path} gives {classes} Engram token classes, the config says engram_compressed_vocab_size "
                          f"{cfg.engram_compressed_vocab_size}: not this model's tokenizer")
    if len(lookup) < cfg.vocab_size:  # ids past the tokenizer (vocabulary padding): classes of their own
        lookup = np.concatenate([lookup, classes + np.arange(cfg.vocab_size - len(lookup))])
    return lookup[:cfg.vocab_size]


def engram_update(streams: torch.Tensor, kv: torch.Tensor, qk_weight: torch.Tensor, eps: float,
                  shut: torch.Tensor | None = None) -> torch.Tensor:
    """copies [..., N, D] + gate * value, from kv [..., (N + 1) D] (one key per copy, then the shared value):
    gate = sigmoid(signed sqrt(max(|dot|, 1e-6))), dot = <h, qk_weight * key> / (rms h * rms key * sqrt(D)),
    each copy normalised on its own; 0 where `shut` (bool [...]: image rows). The trainer
    (tools/train_tiny_v41.py) differentiates through it."""
    hc, d = streams.shape[-2:]
    key, value = kv[..., :hc * d].unflatten(-1, (hc, d)), kv[..., hc * d:]
    rstd = torch.rsqrt(streams.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (streams * qk_weight * key).sum(-1) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if shut is not None:
        gate = gate.masked_fill(shut.unsqueeze(-1), 0.0)
    return streams + gate.unsqueeze(-1) * value.unsqueeze(-2)


class EngramHash:
    """Hash ids of every Engram layer for a step's tokens, on the device."""

    def __init__(self, cfg: DeepseekV41Config, token_map: np.ndarray, device: torch.device):
        layout = EngramLayout.from_config(cfg)
        self.layout = layout
        self.ngram = cfg.engram_max_ngram_size
        self.token_map = torch.from_numpy(token_map).to(device)
        self.pad = int(token_map[cfg.engram_pad_token_id])
        self.primes = torch.from_numpy(layout.primes).to(device)
        self.offsets = torch.from_numpy(layout.offsets).to(device)
        self.multipliers = torch.from_numpy(layout.multipliers).to(device)

    def classes(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[ids]

    def __call__(self, classes: torch.Tensor) -> torch.Tensor:
        """classes [T, ngram] (column k: the class at position p - k, the pad class past the start)
        -> hash ids [T, layers, (ngram - 1) * heads]: table rows, bucket offsets included."""
        products = classes.unsqueeze(1) * self.multipliers  # [T, layers, ngram]
        rolling, out = products[..., 0], []
        for k in range(1, self.ngram):
            rolling = torch.bitwise_xor(rolling, products[..., k])
            out.append(rolling.unsqueeze(-1) % self.primes[:, k - 1])
        return torch.cat(out, dim=-1) + self.offsets


def lookup_rows(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows `ids` (any shape) of an FP8 table with E8M0 scales per 32 of a row, dequantized to float32
    (exact) on `device`. The table stays where it is (memory-mapped): only these rows are read."""
    flat = ids.reshape(-1).cpu()
    rows = table[flat].float()
    s = scale[flat].float().repeat_interleave(rows.shape[-1] // scale.shape[-1], dim=-1)
    return (rows * s).view(*ids.shape, table.shape[-1]).to(device)  # (also no ids: a rank with no rows)
