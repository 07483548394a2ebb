"""DeepSeek-V4's step planning: its view of the cache's pools (per-layer rings and pages) and
the index tensors of one step (StepMeta), shared by every layer of the same kind."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.core.cache import CacheSpec, Pool, PoolSpec, StateCache
from deepinfer.models.base import StepInput
from deepinfer.models.deepseek_v4.config import CSA, DeepseekV4Config


def cache_spec(cfg: DeepseekV4Config, margin: int) -> CacheSpec:
    """Per layer: the window ring of KV (window + margin rows, the step's scratch, then the
    compressed entries, one per `rate` positions, on CSA/HCA layers: one pool so attention
    takes one tensor and one index list); on CSA/HCA layers the compressor's ring of raw
    (kv, gate) projections of unfinished windows (CSA keeps two windows for the overlap); on
    CSA layers the same for the indexer's compressor, and its paged keys."""
    hd, di, ring = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window + margin
    pools = []
    for i, kind in enumerate(cfg.layer_types):
        rate = cfg.compress_rate(i)
        p = f"layers.{i}."
        pools.append(PoolSpec(p + "kv", hd, ring=ring, scratch=True, stride=rate, kind=kind, layer=i))
        if rate:
            span = (2 * rate if kind == CSA else rate) + margin
            width = 2 * hd if kind == CSA else hd
            pools.append(PoolSpec(p + "compressor", 2 * width, ring=span, scratch=True, kind=kind, layer=i))
        if kind == CSA:
            pools.append(PoolSpec(p + "indexer", 2 * 2 * di, ring=2 * rate + margin, scratch=True, kind=kind,
                                  layer=i))
            pools.append(PoolSpec(p + "index_keys", di, stride=rate, kind=kind, layer=i))
    return CacheSpec(tuple(pools))


@dataclass(slots=True)
class LayerState:
    """One layer's pools (the cache pools `layers.{i}.*` of cache_spec above):
    kv = [window ring rows | step scratch | compressed entries]; on CSA/HCA layers the compressor's
    ring of raw (kv, gate) projections of the tokens whose window is not finished (CSA keeps two
    windows for the overlap), on CSA layers the indexer's ring and its paged keys. Rings keep
    `margin` rows of rollback room for rejected drafts: with margin >= the longest draft, a stale
    row written for a rejected position never aliases a position still read, and the compressed
    entry a rejected token finished is rewritten before any later token can see it."""

    kind: str
    rate: int  # 0 for sliding-only layers
    kv: torch.Tensor
    kv_pool: Pool
    comp_ring: torch.Tensor | None = None  # [slots*ring + scratch, 2*C] raw kv|gate per token
    index_ring: torch.Tensor | None = None  # CSA: [slots*ring + scratch, 2*2*Di]
    index_keys: torch.Tensor | None = None  # CSA: [entry_rows, Di]
    margin: int = 0

    @property
    def comp_ring_size(self) -> int:
        return (2 * self.rate if self.kind == CSA else self.rate) + self.margin


class CacheView:
    """The generic StateCache as DeepSeek-V4's layers see it: one window ring size for every layer,
    compressed entries at the same rows of a slot's pages in every paged pool of a layer."""

    def __init__(self, cache: StateCache, config: DeepseekV4Config):
        self.cache = cache
        self.max_seqs, self.max_step_tokens = cache.max_seqs, cache.max_step_tokens
        self.page_tokens, self.block_table = cache.page_tokens, cache.block_table
        self.dtype, self.device = cache.dtype, cache.device
        pools = cache.pools
        first = pools["layers.0.kv"]
        self.ring = first.spec.ring  # window + rollback margin
        self.ring_rows = first.scratch_base
        margin = self.ring - config.sliding_window
        self.layers: list[LayerState] = []
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}."
            kv = pools[p + "kv"]
            comp, index, keys = (pools.get(p + n) for n in ("compressor", "indexer", "index_keys"))
            self.layers.append(LayerState(
                config.layer_types[i], config.compress_rate(i), kv.data, kv,
                comp.data if comp else None, index.data if index else None, keys.data if keys else None, margin))

    def entry_rows(self, layer: LayerState, slots: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """Rows (relative to the compressed region) of compressed entries `entries` of `slots`."""
        return self.cache.page_rows(layer.kv_pool, slots, entries)

    def entry_base(self) -> int:
        """First row of the compressed-entry region inside a layer's kv tensor."""
        return self.ring_rows + self.max_step_tokens


def _arange_within(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes `counts`: (group index of each element, index within its group)."""
    group = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return group, np.arange(len(group)) - first[group]


class StepMeta:
    """Index tensors of one step, shared by every layer of the same kind.

    Built on the host from host tensors (StepInput and the cache's block table live on the CPU:
    no device sync while planning), then moved to the cache's device in one go; `ids` is the
    device copy of the step's token ids, which the engine may patch with the previous step's
    samples before the forward. The index arithmetic runs in numpy: it is ~60 operations on
    arrays of a few hundred elements, where a torch op's fixed cost (~5 us) was most of a
    decode step's planning time."""

    def __init__(self, inp: StepInput, cache: CacheView, config: DeepseekV4Config, planner=None, split=None):
        self.inp, self.cache, self.config = inp, cache, config
        self.starts, self.slots = inp.starts.numpy(), inp.slots.numpy()
        lens = inp.lens.numpy()
        self.first = np.cumsum(lens) - lens  # flat index of each sequence's first token
        self.ends = self.starts + lens
        self.num_tokens = int(lens.sum())
        if self.num_tokens > cache.max_step_tokens:
            raise ValueError(f"step has {self.num_tokens} tokens, cache scratch holds {cache.max_step_tokens}")
        self._by_rate: dict[tuple[str, int], dict] = {}
        # Rows this process computes the token-wise work for (queries, MoE, residual streams):
        # all of them, unless context parallelism (deepinfer/parallel) split the step over ranks;
        # keys and compressed inputs are then completed from the other ranks by all_tokens.
        self.split = split
        self.own: slice | torch.Tensor = slice(None) if split is None else split.own
        # An accelerator's planner (its step program's) may compute the same arrays faster; it
        # declines what it does not cover (it returns False), and the numpy below is the definition.
        replay = inp.window_floor is not None or inp.num_restored is not None
        if planner is None or replay or not planner(self):
            self._plan()
        self._to_device(cache.device)

    def _plan(self) -> None:
        """Every index array of the step, in numpy."""
        inp, cache, config = self.inp, self.cache, self.config
        self.seq, within = _arange_within(inp.lens.numpy())
        self.positions = self.starts[self.seq] + within
        self.rope = {"main": config.rope_main.cos_sin(self.positions),
                     "compress": config.rope_compress.cos_sin(self.positions)}
        window = config.sliding_window
        key_pos = self.positions[:, None] + np.arange(-(window - 1), 1)
        if inp.window_floor is not None:  # keys never computed after a prefix-cache hit read as absent
            floor = inp.window_floor.numpy()[self.seq]
            floor = np.where(self.positions >= floor, floor, 0)
            key_pos = np.where(key_pos >= floor[:, None], key_pos, -1)
        self.window_rows = self.rows(key_pos, self.seq[:, None], cache.ring, 0)
        self.window_commit = self._commit(cache.ring, 0)
        # Read the block table now: with overlapped scheduling the CPU may hand a freed slot or
        # page to another request while this step is still queued on the device.
        for layer in cache.layers:
            if layer.rate:
                self.compressed(layer)

    def _to_device(self, device: torch.device) -> None:
        on_host = device.type == "cpu"

        def move(t):
            t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            return t if on_host else t.to(device, non_blocking=True)

        self.ids = move(self.inp.ids)
        self.window_rows = move(self.window_rows)
        self.window_commit = tuple(map(move, self.window_commit))
        self.rope = {k: tuple(map(move, v)) for k, v in self.rope.items()}
        for info in self._by_rate.values():
            for k in ("tok_rows", "out_rows", "candidates", "attention_rows"):
                if k in info:
                    info[k] = move(info[k])
            info["cos_sin"] = tuple(map(move, info["cos_sin"]))
            info["commit"] = tuple(map(move, info["commit"]))

    def all_tokens(self, own_rows: torch.Tensor) -> torch.Tensor:
        """Rows of every token of the step, from the rows of the tokens this process owns."""
        return own_rows if self.split is None else self.split.gather(own_rows)

    def rows(self, pos: np.ndarray, seq: np.ndarray, ring: int, ring_base: int) -> np.ndarray:
        """Row of token `pos` of batch sequence `seq` (broadcast against pos) in a [ring rows |
        scratch] tensor whose scratch starts at slots*ring: the step's own tokens are read from
        the scratch, older ones from the ring; negative positions give -1."""
        start = self.starts[seq]
        scratch = self.cache.max_seqs * ring + self.first[seq] + (pos - start)
        ringed = ring_base + self.slots[seq] * ring + pos % ring  # numpy's % is floor-mod, as torch.remainder
        rows = np.where(pos >= start, scratch, ringed)
        return np.where(pos >= 0, rows, -1)

    def _commit(self, ring: int, ring_base: int) -> tuple[np.ndarray, np.ndarray]:
        """(scratch rows, ring rows) of the tokens a ring of `ring` rows keeps after the step."""
        tokens = np.flatnonzero(self.positions >= (self.ends[self.seq] - ring))
        pos, seq = self.positions[tokens], self.seq[tokens]
        src = self.cache.max_seqs * ring + tokens
        dst = ring_base + self.slots[seq] * ring + pos % ring
        return src, dst

    def compressed(self, layer: LayerState) -> dict:
        """Windows finished in this step and the entries each token may see, for a layer kind."""
        key = (layer.kind, layer.rate)
        if key in self._by_rate:
            return self._by_rate[key]
        rate, ring, cache, inp = layer.rate, layer.comp_ring_size, self.cache, self.inp
        # windows w whose last token arrives in this step: starts//rate <= w < ends//rate,
        # except the restored ones of a prefix-cache hit (shared pages: read-only)
        first = self.starts if inp.num_restored is None else np.maximum(self.starts, inp.num_restored.numpy())
        w_lo = first // rate
        counts = np.maximum(self.ends // rate - w_lo, 0)
        win_seq, within = _arange_within(counts)
        win = w_lo[win_seq] + within
        # CSA entries mix the previous window (first half) with their own (second half)
        span = 2 * rate if layer.kind == CSA else rate
        tok_pos = (win[:, None] + 1) * rate - span + np.arange(span)
        tok_rows = self.rows(tok_pos, win_seq[:, None], ring, 0)
        out_rows = cache.entry_rows(layer, self.slots[win_seq], win)
        entry_cos_sin = self.config.rope_compress.cos_sin(win * rate)
        # entries visible to token at p: w < (p + 1) // rate
        visible = (self.positions + 1) // rate
        width = int(visible.max()) if self.num_tokens else 0
        entries = np.arange(width)[None, :]
        cand = cache.entry_rows(layer, self.slots[self.seq][:, None], entries)
        cand = np.where(entries < visible[:, None], cand, -1)
        info = dict(tok_rows=tok_rows, out_rows=out_rows, cos_sin=entry_cos_sin, candidates=cand,
                    commit=self._commit(ring, 0))
        if layer.kind != CSA:  # every visible entry is attended: the whole index list is known now
            base = cache.entry_base()
            info["attention_rows"] = np.concatenate([self.window_rows, np.where(cand >= 0, cand + base, -1)], axis=1)
        self._by_rate[key] = info
        return info


