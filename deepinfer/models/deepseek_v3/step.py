"""DeepSeek-V3's step planning: its cache spec (one paged latent pool per layer) and the index
tensors of one step (StepMeta), shared by every layer."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.core.cache import CacheSpec, PoolSpec, StateCache
from deepinfer.models.base import StepInput
from deepinfer.models.deepseek_v3.config import DeepseekV3Config


def cache_spec(cfg: DeepseekV3Config) -> CacheSpec:
    """Per layer, one paged pool of latent rows: a row per position (stride 1), [the normed latent
    (kv_lora_rank) | the roped shared key (qk_rope_head_dim)], what transformers' cache holds (V3:
    576 floats per token per layer). A row depends only on its token and position: no window ring,
    nothing per slot, so the pages are the whole decode state and a prefix-cache hit restores it
    exactly (replay_window 0). No rollback margin either: V3 has no drafter here."""
    return CacheSpec(tuple(PoolSpec(f"layers.{i}.latent", cfg.latent_dim, stride=1, kind="mla", layer=i)
                           for i in range(cfg.num_hidden_layers)))


def _arange_within(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes `counts`: (group index of each element, index within its group)."""
    group = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return group, np.arange(len(group)) - first[group]


class StepMeta:
    """Index tensors of one step, planned on the host (numpy, from the cache's block table: no device
    sync) and moved to the cache's device in one go:
    - positions and their rope cos/sin;
    - write_rows [T]: the pool row each token's latent row goes to (every layer's pool has the same
      page layout, so one set of rows serves all);
    - attention [T, W]: the pool rows each token attends to, its sequence's positions 0..p (-1
      beyond), W = the step's longest context. O(T x W): fine for decode and for the short
      prefills of the tiny models; a causal-range form of the op would be the way to long prefills.
    `ids` is the device copy of the step's token ids, which the engine may patch with the previous
    step's samples. With context parallelism (`split`), `own` selects the token rows this rank
    computes and `all_tokens` gathers rows of every token from every rank."""

    def __init__(self, inp: StepInput, cache: StateCache, config: DeepseekV3Config, split=None):
        self.inp, self.cache, self.config = inp, cache, config
        starts, slots, lens = inp.starts.numpy(), inp.slots.numpy(), inp.lens.numpy()
        self.num_tokens = int(lens.sum())
        seq, within = _arange_within(lens)
        positions = starts[seq] + within
        self.positions = positions
        self.rope = config.cos_sin(positions)
        pool = cache.pools["layers.0.latent"]
        tok_slots = slots[seq]
        self.write_rows = pool.page_base + cache.page_rows(pool, tok_slots, positions)
        width = int(positions.max()) + 1 if self.num_tokens else 0
        cols = np.arange(width)[None, :]
        rows = pool.page_base + cache.page_rows(pool, tok_slots[:, None], cols)
        self.attention = np.where(cols <= positions[:, None], rows, -1)
        self.split = split
        self.own: slice | torch.Tensor = slice(None) if split is None else split.own
        self._to_device(cache.device)

    def _to_device(self, device: torch.device) -> None:
        on_host = device.type == "cpu"

        def move(t):
            t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            return t if on_host else t.to(device, non_blocking=True)

        self.ids = move(self.inp.ids)
        self.write_rows = move(self.write_rows)
        self.attention = move(self.attention)
        self.rope = tuple(map(move, self.rope))

    def all_tokens(self, own_rows: torch.Tensor) -> torch.Tensor:
        """Rows of every token of the step, from the rows of the tokens this process owns."""
        return own_rows if self.split is None else self.split.gather(own_rows)
