"""DeepSeek-V4's step planning: its view of the cache's pools (per-layer rings and pages) and
the index tensors of one step (StepMeta), shared by every layer of the same kind."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.base import (CacheSpec, DecodeCache, Pool, PoolSpec, StepData, StepInput, size_bucket,
                                   to_device)
from deepinfer.models.deepseek_v4.config import CSA, DeepseekV4Config
from deepinfer.models.planning import (OwnedRows, RopeTables, arange_within, commit_rows, decode_tokens,
                                      first_step_ids, per_step, ring_rows)


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
    """The generic DecodeCache as DeepSeek-V4's layers see it: one window ring size for every layer,
    compressed entries at the same rows of a slot's pages in every paged pool of a layer."""

    def __init__(self, cache: DecodeCache, config: DeepseekV4Config):
        self.cache = cache
        # ring slots: the sequence slots and the trash slot (DecodeCache), each `ring` rows
        self.ring_slots, self.max_step_tokens = cache.ring_slots, cache.max_step_tokens
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
        # one layer per compressed kind: the planning is shared by the layers of a kind
        kinds = {}
        for layer in self.layers:
            if layer.rate:
                kinds.setdefault((layer.kind, layer.rate), layer)
        self.kinds: list[LayerState] = list(kinds.values())

    def entry_rows(self, layer: LayerState, slots: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """Rows (relative to the compressed region) of compressed entries `entries` of `slots`."""
        return self.cache.page_rows(layer.kv_pool, slots, entries)

    def trash_row(self, layer: LayerState) -> int:
        """A row of the cache's trash page (DecodeCache.trash_page) in the layer's paged pools."""
        return self.cache.trash_page * layer.kv_pool.page_rows

    def entry_base(self) -> int:
        """First row of the compressed-entry region inside a layer's kv tensor."""
        return self.ring_rows + self.max_step_tokens


_MIN_ENTRIES = 64  # candidate entries per token at least (fewer buckets for short sequences)


@functools.lru_cache(maxsize=16)
def _wrapped_window(ring: int, window: int) -> np.ndarray:
    """[ring, window]: row q holds (q + offset) mod ring for the offsets -(window-1) .. 0 (ring rows
    of the window keys of a token at a position p with p mod ring = q)."""
    table = (np.arange(ring)[:, None] + np.arange(-(window - 1), 1)) % ring
    table.flags.writeable = False
    return table


@dataclass(slots=True)
class CompressedRows(StepData):
    """One layer kind's compressed entries in a step (StepMeta.compressed)."""

    tok_rows: np.ndarray  # [W, span] ring rows of each window finished in the step (-1: absent)
    out_rows: np.ndarray  # [W] page row each finished window's entry goes to (unfinished: the trash page)
    cos_sin: tuple[np.ndarray, np.ndarray]  # RoPE at each entry's position
    candidates: np.ndarray  # [T, E] the entry rows each token may see (-1 beyond)
    commit: tuple[np.ndarray, np.ndarray]  # (scratch rows, ring rows) the compressor ring keeps
    attention_rows: np.ndarray | None = None  # [T, window + E] every row a token attends (not CSA: no indexer)


class StepMeta(OwnedRows):
    """Index tensors of one step, shared by every layer of the same kind.

    Built on the host from host tensors (StepInput and the cache's block table live on the CPU:
    no device sync while planning), then moved to the cache's device in one go; `ids` is the
    device copy of the step's token ids, which the engine may patch with the previous step's
    samples before the forward. The index arithmetic runs in numpy: it is ~60 operations on
    arrays of a few hundred elements, where a torch op's fixed cost (~5 us) was most of a
    decode step's planning time.

    A decode step (one token per sequence) is planned with fixed shapes, so that the engine
    records it once per batch size and replays it for every later one (core/graphs.py): one
    compressed window per sequence, finished or not (an unfinished one has no tokens, rows -1, and
    its entry goes to the cache's trash page), and the entries a token may see padded to at least
    _MIN_ENTRIES, then a power of two (then multiples of 64), with -1 (absent: every op skips them,
    and the indexer's pick does not depend on the padding). `steps` > 1 plans that many decode steps
    at once (multi-step decoding: sequence b at position starts[b] + s in step s): every tensor
    gets a leading dimension of `steps`, `ids` of which only the first row is known; numpy's cost
    is per call, so k steps cost about one."""

    def __init__(self, inp: StepInput, cache: CacheView, config: DeepseekV4Config, split=None,
                 steps: int | None = None):
        self.inp, self.cache, self.config = inp, cache, config
        self.starts, self.slots = inp.starts.numpy(), inp.slots.numpy()
        lens = inp.lens.numpy()
        self.num_tokens = int(lens.sum())
        if self.num_tokens > cache.max_step_tokens:
            raise ValueError(f"step has {self.num_tokens} tokens, cache scratch holds {cache.max_step_tokens}")
        self._by_rate: dict[tuple[str, int], CompressedRows] = {}
        # Rows this process computes the token-wise work for (queries, MoE, residual streams):
        # all of them, unless context parallelism (deepinfer/parallel) split the step over ranks;
        # keys and compressed inputs are then completed from the other ranks by all_tokens.
        self.set_split(split)
        self.decode = self.num_tokens == len(lens) and inp.window_floor is None and inp.num_restored is None
        if steps is not None and not self.decode:
            raise ValueError("several steps are planned at once only for decode steps")
        self._plan(steps or 1)
        move = functools.partial(to_device, device=cache.device)
        if steps is not None:  # [steps, ...]: step s is row s of every tensor
            self.ids = move(first_step_ids(inp.ids, steps))
            self._map(lambda a: move(per_step(a, steps)))
        else:
            self.ids = move(inp.ids)
            self._map(move)

    def _plan(self, steps: int) -> None:
        """Every index array of the step (or of `steps` decode steps, token (s, b) = sequence b at
        position starts[b] + s, the only token of its sequence in its step), in numpy."""
        inp, cache, config = self.inp, self.cache, self.config
        if self.decode:
            batch = len(self.starts)
            seq, step = decode_tokens(batch, steps)
            self.positions = self.starts[seq] + step
            # per token: its step's first position of the sequence, the flat index of the sequence's
            # first token in its step, its slot, the end of its sequence's tokens in its step
            self.tok = (self.positions, seq, self.slots[seq], self.positions + 1)
        else:
            lens = inp.lens.numpy()
            first = np.cumsum(lens) - lens
            seq, within = arange_within(lens)
            self.positions = self.starts[seq] + within
            self.tok = (self.starts[seq], first[seq], self.slots[seq], (self.starts + lens)[seq])
        self.seq = seq  # per token: its sequence
        self.rope = RopeTables(config.rope_main.cos_sin(self.positions), config.rope_compress.cos_sin(self.positions))
        window = config.sliding_window
        if self.decode:
            self.window_rows = self._decode_rows(self.positions, seq, self.tok[2], window, cache.ring)
        else:
            key_pos = self.positions[:, None] + np.arange(-(window - 1), 1)
            if inp.window_floor is not None:  # keys never computed after a prefix-cache hit read as absent
                floor = inp.window_floor.numpy()[seq]
                floor = np.where(self.positions >= floor, floor, 0)
                key_pos = np.where(key_pos >= floor[:, None], key_pos, -1)
            start, first_tok, slot, _ = (t[:, None] for t in self.tok)
            self.window_rows = ring_rows(key_pos, start, first_tok, slot, cache.ring, cache.ring_slots)
        self.window_commit = self._commit(cache.ring)
        # Read the block table now: with overlapped scheduling the CPU may hand a freed slot or
        # page to another request while this step is still queued on the device.
        for layer in cache.kinds:
            self._by_rate[layer.kind, layer.rate] = self._compressed(layer)

    def _map(self, f) -> None:
        """Replace every planned array by f(array)."""
        self.window_rows = f(self.window_rows)
        self.window_commit = tuple(map(f, self.window_commit))
        self.rope = self.rope.mapped(f)
        self._by_rate = {key: info.mapped(f) for key, info in self._by_rate.items()}

    def _decode_rows(self, positions: np.ndarray, seq: np.ndarray, slot: np.ndarray, window: int,
                     ring: int) -> np.ndarray:
        """`rows` of positions p-window+1 .. p for decode-step tokens at positions p (of sequences
        `seq`, in `slot`), with fewer passes over the [tokens, window] array: every position but the
        token's own is in the ring, at (p mod ring + offset) mod ring, looked up in a [ring, window]
        table; the token's own is in the scratch. Negative positions (a sequence's first tokens) give -1."""
        rows = np.take(_wrapped_window(ring, window), positions % ring, axis=0)
        rows += (slot * ring)[:, None]
        rows[:, -1] = self.cache.ring_slots * ring + seq
        if len(positions) and positions.min() < window - 1:
            rows[positions[:, None] + np.arange(-(window - 1), 1) < 0] = -1
        return rows

    def _commit(self, ring: int) -> tuple[np.ndarray, np.ndarray]:
        """(scratch rows, ring rows) of the tokens a ring of `ring` rows keeps after the step."""
        start, first, slot, end = self.tok
        pos = self.positions
        if self.decode:  # a decode step keeps its one token per sequence, at its first scratch row
            return self.cache.ring_slots * ring + first, slot * ring + pos % ring
        return commit_rows(pos, end, first + (pos - start), slot, ring, self.cache.ring_slots)

    def compressed(self, layer: LayerState) -> CompressedRows:
        """Windows finished in this step and the entries each token may see, for a layer kind."""
        return self._by_rate[layer.kind, layer.rate]

    def _compressed(self, layer: LayerState) -> CompressedRows:
        rate, ring, cache, inp = layer.rate, layer.comp_ring_size, self.cache, self.inp
        start, first, slot, end = self.tok
        # entries visible to token at p: w < (p + 1) // rate (a decode token's end is its p + 1)
        visible = (end if self.decode else self.positions + 1) // rate
        if self.decode:  # one window per token: the one it finishes, if any
            finished = visible * rate == end
            win = np.where(finished, visible - 1, 0)
        else:
            # windows w whose last token arrives in this step: starts//rate <= w < ends//rate,
            # except the restored ones of a prefix-cache hit (shared pages: read-only)
            lo = self.starts if inp.num_restored is None else np.maximum(self.starts, inp.num_restored.numpy())
            lens = inp.lens.numpy()
            w_lo = lo // rate
            win_seq, within = arange_within(np.maximum((self.starts + lens) // rate - w_lo, 0))
            win = w_lo[win_seq] + within
            seq_first = np.cumsum(lens) - lens
            w_start, w_first, w_slot, finished = self.starts[win_seq], seq_first[win_seq], self.slots[win_seq], None
        # CSA entries mix the previous window (first half) with their own (second half)
        span = 2 * rate if layer.kind == CSA else rate
        if finished is None:
            tok_pos = (win[:, None] + 1) * rate - span + np.arange(span)
            tok_rows = ring_rows(tok_pos, w_start[:, None], w_first[:, None], w_slot[:, None], ring, cache.ring_slots)
            out_rows = cache.entry_rows(layer, w_slot, win)
        else:  # an unfinished window: no tokens, its entry to the trash page (rows of finished ones only)
            done = np.flatnonzero(finished)
            tok_rows = np.full((len(win), span), -1, dtype=np.int64)
            # the finishing token is the window's last: the span's positions end at its own
            tok_rows[done] = self._decode_rows(self.positions[done], first[done], slot[done], span, ring)
            out_rows = np.full(len(win), cache.trash_row(layer), dtype=np.int64)
            out_rows[done] = cache.entry_rows(layer, slot[done], win[done])
        entry_cos_sin = self.config.rope_compress.cos_sin(win * rate)
        most = cache.block_table.shape[1] * layer.kv_pool.page_rows  # entries a block-table row maps
        width = min(size_bucket(int(visible.max()), _MIN_ENTRIES), most) if len(visible) else 0
        entries = np.arange(width)[None, :]
        # a sequence's entry rows, then each token's (its sequence's, up to what it sees): the rows
        # are looked up once per sequence, not once per token
        seen = entries < visible[:, None]
        per_seq = cache.entry_rows(layer, self.slots[:, None], entries)
        cand = np.where(seen, per_seq[self.seq], -1)
        info = CompressedRows(tok_rows, out_rows, entry_cos_sin, cand, self._commit(ring))
        if layer.kind != CSA:  # every visible entry is attended: the whole index list is known now
            rows = np.full((len(cand), self.window_rows.shape[1] + width), -1, dtype=np.int64)
            window, entries_part = rows[:, :self.window_rows.shape[1]], rows[:, self.window_rows.shape[1]:]
            window[...] = self.window_rows
            np.copyto(entries_part, (per_seq + cache.entry_base())[self.seq], where=seen)
            info.attention_rows = rows
        return info
