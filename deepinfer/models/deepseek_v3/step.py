"""DeepSeek-V3's step planning: its cache spec (one paged latent pool per layer) and the index
tensors of one step (StepMeta), shared by every layer."""

from __future__ import annotations

import functools

import numpy as np
import torch

from deepinfer.models.base import CacheSpec, DecodeCache, PoolSpec, StepInput, size_bucket, to_device
from deepinfer.models.deepseek_v3.config import DeepseekV3Config
from deepinfer.models.planning import OwnedRows, arange_within, decode_tokens, first_step_ids, per_step


def cache_spec(cfg: DeepseekV3Config) -> CacheSpec:
    """Per layer, one paged pool of latent rows: a row per position (stride 1), [the normed latent
    (kv_lora_rank) | the roped shared key (qk_rope_head_dim)], what transformers' cache holds (V3:
    576 floats per token per layer). A row depends only on its token and position: no window ring,
    nothing per slot, so the pages are the whole decode state and a prefix-cache hit restores it
    exactly (replay_window 0). No rollback margin either: V3 has no drafter here."""
    return CacheSpec(tuple(PoolSpec(f"layers.{i}.latent", cfg.latent_dim, stride=1, kind="mla", layer=i)
                           for i in range(cfg.num_hidden_layers)))


# Attention widths of V3's steps are rounded up to powers of two from 64 to 1024, then to multiples of
# 1024: decode steps fall into few shape buckets (the engine records a bucket twice before replaying
# it, core/graphs.py), and the padded columns (-1) cost the attention kernels a skipped entry each.
_MIN_WIDTH, _LINEAR_FROM = 64, 1024


class StepMeta(OwnedRows):
    """Index tensors of one step, planned on the host (numpy, from the cache's block table: no device
    sync) and moved to the cache's device in one go:
    - positions and their rope cos/sin;
    - write_rows [T]: the pool row each token's latent row goes to (every layer's pool has the same
      page layout, so one set of rows serves all);
    - attention [T, W]: the pool rows each token attends to, its sequence's positions 0..p (-1
      beyond), W = the step's longest context rounded up (size_bucket: the shapes of a decode step
      depend on the batch size and that bucket only, so one recording serves many steps). O(T x W):
      fine for decode and for the short prefills of the tiny models; a causal-range form of the op
      would be the way to long prefills.
    `ids` is the device copy of the step's token ids, which the engine may patch with the previous
    step's samples. With context parallelism (`split`), `own` selects the token rows this rank
    computes and `all_tokens` gathers rows of every token from every rank. `steps` plans that many
    decode steps at once (multi-step decoding: sequence b at position starts[b] + s in step s):
    every tensor gets a leading dimension of `steps`, `ids` of which only the first row is known."""

    def __init__(self, inp: StepInput, cache: DecodeCache, config: DeepseekV3Config, split=None,
                 steps: int | None = None):
        self.inp, self.cache, self.config = inp, cache, config
        starts, slots, lens = inp.starts.numpy(), inp.slots.numpy(), inp.lens.numpy()
        self.num_tokens = int(lens.sum())
        batch = len(lens)
        if steps is None:
            seq, within = arange_within(lens)
        elif self.num_tokens != batch:
            raise ValueError("several steps are planned at once only for decode steps")
        else:  # token (s, b): sequence b at position starts[b] + s
            seq, within = decode_tokens(batch, steps)
        positions = starts[seq] + within
        self.positions = positions
        cos, sin = config.cos_sin(positions)
        pool = cache.pools["layers.0.latent"]
        tok_slots = slots[seq]
        write_rows = pool.page_base + cache.page_rows(pool, tok_slots, positions)
        most = cache.block_table.shape[1] * pool.page_rows  # positions a block-table row maps
        width = min(size_bucket(int(positions.max()) + 1, _MIN_WIDTH, _LINEAR_FROM), most) if len(positions) else 0
        cols = np.arange(width)[None, :]
        rows = pool.page_base + cache.page_rows(pool, tok_slots[:, None], cols)
        attention = np.where(cols <= positions[:, None], rows, -1)
        planned = [write_rows, attention, cos, sin]
        ids = inp.ids
        if steps is not None:  # [steps, ...]: step s is row s of every tensor
            ids, planned = first_step_ids(inp.ids, steps), [per_step(a, steps) for a in planned]
        self.ids, self.write_rows, self.attention, self.rope = ids, planned[0], planned[1], tuple(planned[2:])
        self.set_split(split)
        self._to_device(cache.device)

    def _to_device(self, device: torch.device) -> None:
        move = functools.partial(to_device, device=device)

        self.ids = move(self.ids)
        self.write_rows = move(self.write_rows)
        self.attention = move(self.attention)
        self.rope = tuple(map(move, self.rope))
