"""DeepSeek-V4.1's step planning: its cache spec, its view of the pools, and the index tensors of one
step (StepMeta), planned on the host in numpy from the step's host inputs and the block table.

Who owns what (CSA2): every layer has a window ring of KV (window + rollback margin rows per
sequence). Only KV sources own paged state: their compressed entries and their index keys, one row
per `rate` positions. A consumer reads its source's entries, so its window ring lives in its
source's pool (`layers.S.kv`: per sequence slot, one ring per member of the source's group, then the
step's scratch rows, then the source's pages): attention takes one tensor and one index list, as in
DeepSeek-V4. A ratio-2 source also keeps the raw (kv, gate) projections of a pair's first token until
its second arrives. Engram keeps the last tokens' classes (its n-gram look-back), as integers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.base import (CacheSpec, DecodeCache, Pool, PoolSpec, StepData, StepInput, size_bucket,
                                   step_inputs, to_device, with_step_tensors)
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.planning import RopeTables, arange_within, commit_rows, ring_rows


def kv_groups(cfg: DeepseekV41Config) -> dict[int, list[int]]:
    """KV source -> the layers reading its compressed entries (itself first), in layer order."""
    groups: dict[int, list[int]] = {}
    for role in cfg.roles:
        if role.rate:
            groups.setdefault(role.kv_source, []).append(role.layer)
    return groups


def engram_ring(cfg: DeepseekV41Config, margin: int) -> int:
    return cfg.engram_max_ngram_size - 1 + margin


def cache_spec(cfg: DeepseekV41Config, margin: int) -> CacheSpec:
    hd, ring = cfg.head_dim, cfg.sliding_window + margin
    groups = kv_groups(cfg)
    pools = []
    for role in cfg.roles:
        p = f"layers.{role.layer}."
        if role.rate == 0:
            pools.append(PoolSpec(p + "kv", hd, ring=ring, scratch=True, kind="swa", layer=role.layer))
        elif role.owns_kv:
            members = len(groups[role.layer])
            pools.append(PoolSpec(p + "kv", hd, ring=members * ring, scratch=True, stride=role.rate,
                                  kind="kv_source", layer=role.layer))
            pools.append(PoolSpec(p + "index_keys", cfg.index_head_dim, stride=role.rate, kind="index_keys",
                                  layer=role.layer))
            if role.rate > 1:  # the raw [kv | gate] of the tokens of an unfinished group
                pools.append(PoolSpec(p + "compressor", 2 * hd, ring=role.rate + margin, scratch=True,
                                      kind="compressor", layer=role.layer))
    if cfg.engram_layer_ids:
        pools.append(PoolSpec("engram.classes", 1, ring=engram_ring(cfg, margin), scratch=True, kind="engram",
                              dtype=torch.int64))
    return CacheSpec(tuple(pools))


@dataclass(slots=True)
class LayerView:
    """One layer's place in the pools: its window ring is member `member` of `pool`'s per-slot rings."""

    pool: Pool
    member: int  # which of the pool's per-slot rings is this layer's
    members: int  # rings per slot in the pool
    source: Pool | None = None  # rate > 0: the pool holding the compressed entries (= pool)
    index_keys: Pool | None = None  # the latest KV source's index keys (index sources read them)
    compressor: Pool | None = None  # a ratio-2 KV source's staging ring


class CacheView:
    """The generic DecodeCache as DeepSeek-V4.1's layers see it."""

    def __init__(self, cache: DecodeCache, config: DeepseekV41Config):
        self.cache, self.config = cache, config
        self.ring_slots, self.max_step_tokens = cache.ring_slots, cache.max_step_tokens  # + the padding slot
        self.dtype, self.device = cache.dtype, cache.device
        pools = cache.pools
        groups = kv_groups(config)
        first = next(p for p in pools.values() if p.spec.name.endswith(".kv"))
        self.ring = first.spec.ring // (len(groups[first.spec.layer]) if first.spec.kind == "kv_source" else 1)
        self.layers: list[LayerView] = []
        for role in config.roles:
            if role.rate == 0:
                self.layers.append(LayerView(pools[f"layers.{role.layer}.kv"], 0, 1))
                continue
            s = role.kv_source
            pool = pools[f"layers.{s}.kv"]
            self.layers.append(LayerView(pool, groups[s].index(role.layer), len(groups[s]), pool,
                                         pools[f"layers.{s}.index_keys"], pools.get(f"layers.{s}.compressor")))
        self.engram = pools.get("engram.classes")


_MIN_ENTRIES = 64  # compressed entries a token's candidate row holds at least (fewer decode buckets)

RowPair = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class RowTensors(StepData):
    """A Rows' device tensors (StepMeta.rows[key]); the fields after `flat` only where the Rows
    plans queries (`rope`..`visible`) or Engram's look-back (`engram`, `engram_commit`: every token's)."""

    commit: dict[int, RowPair]  # ring members per slot -> (scratch rows, member-0 ring rows) the ring keeps
    tokens: torch.Tensor | None  # flat token indices of the set (None: every token)
    flat: torch.Tensor  # the set's flat token rows
    rope: RopeTables | None = None  # cos/sin at each token's position
    window: dict[int, RowPair] | None = None  # ring members -> (window key rows, in the ring) per token
    entries: dict[int, torch.Tensor] | None = None  # rate -> [n, M] page rows of the entries a token may see
    visible: dict[int, torch.Tensor] | None = None  # rate -> entries visible to each token
    engram: torch.Tensor | None = None  # [n, ngram - 1] ring rows of the classes of positions p - 1, p - 2, ...
    engram_commit: RowPair | None = None  # (scratch rows, ring rows) of the classes the ring keeps


@dataclass(slots=True)
class EntryWrites(StepData):
    """The compressed entries the KV sources of one rate finish in a step (StepMeta.writes[rate])."""

    out_rows: torch.Tensor  # page row of each entry (relative to the page region; unfinished: the trash page)
    cos_sin: RowPair  # RoPE at each entry's position
    tok_rows: torch.Tensor  # rows of each entry's tokens (ratio 1: flat rows; ratio 2: the staging ring)
    commit: RowPair | None = None  # ratio 2: (scratch rows, ring rows) the staging ring keeps
    scratch: int | None = None  # ratio 2: the staging ring's first scratch row


class Rows:
    """The index arrays of a set of the step's tokens (all of them, or the decoder's subset under the
    CED split), planned on the host and moved to the device once (`dev`, kept in StepMeta.rows under
    `key`: the forward reads them from there, see BoundRows): positions, RoPE tables, window rows per
    pool layout, the compressed entries each token may see (padded with -1 to a size bucket, so decode
    steps of a batch size share few shapes; the indexer's picks do not depend on the padding),
    Engram's look-back rows and ring commit.

    Context parallelism (parallel/context_parallel.py): a layer computes the queries of this rank's
    share of its rows and writes the keys of all of them. The share is a Rows whose `write` is the whole
    set (which then plans only what writes need: `queries` False) and whose `split` gathers every
    rank's rows of the set; in one process a Rows is its own `write` set and `gather` returns its input."""

    dev: RowTensors

    def __init__(self, meta: "StepMeta", key: str, tokens: np.ndarray | None, floor: np.ndarray | None,
                 queries: bool = True):
        self.meta, self.key = meta, key
        self.write, self.split = self, None  # _share sets them for a rank's share
        self.queries = queries
        self.tokens = tokens  # flat token indices (None: every token)
        self.seq = meta.seq if tokens is None else meta.seq[tokens]
        self.positions = meta.positions if tokens is None else meta.positions[tokens]
        self.flat = np.arange(meta.num_tokens) if tokens is None else tokens
        self.count = len(self.positions)
        self.floor = floor  # per token: window keys below it were never computed and read as absent
        cfg, cache = meta.config, meta.cache
        self.commit = {m: meta.commit(cache.ring, m, self) for m in meta.ring_members}
        if cache.engram is not None:
            ring, n = cache.engram.spec.ring, cfg.engram_max_ngram_size - 1
            pos = self.key_positions(n)[:, :-1][:, ::-1]  # p - 1, p - 2, ...
            self.engram = np.where(pos >= 0, meta.ring_rows(pos, self.seq[:, None], ring, 1)[0], -1)
            if tokens is None:  # the step's classes the ring keeps
                self.engram_commit = meta.commit(ring, 1, self)
        if not queries:
            self.dev = self._to_device(cache.device)
            return
        self.rope = RopeTables(cfg.rope_main.cos_sin(self.positions), cfg.rope_compress.cos_sin(self.positions))
        # window keys oldest first, absent ones (-1) last: the order of DeepSeek's prefill index lists,
        # which decides what falls in each 64-index block of the online softmax
        pos = self.key_positions(cfg.sliding_window - 1)
        shift = (pos < 0).sum(axis=1, keepdims=True)
        pos = np.take_along_axis(pos, (np.arange(pos.shape[1]) + shift) % pos.shape[1], axis=1)
        self.window = {m: meta.ring_rows(pos, self.seq[:, None], cache.ring, m) for m in meta.ring_members}
        self.entries = {rate: self._entries(rate) for rate in meta.rates}
        self.visible = {rate: (self.positions + 1) // rate for rate in meta.rates}
        self.dev = self._to_device(cache.device)

    def key_positions(self, back: int) -> np.ndarray:
        """[n, back + 1] positions p - back .. p of each token, -1 where absent (before the start, or
        below the token's floor)."""
        pos = self.positions[:, None] + np.arange(-back, 1)
        if self.floor is not None:
            floor = np.where(self.positions >= self.floor, self.floor, 0)
            pos = np.where(pos >= floor[:, None], pos, -1)
        return np.where(pos >= 0, pos, -1)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of every token of the `write` set, from every rank's share (t: this share's rows)."""
        return t if self.split is None else self.split.gather(t)

    def _entries(self, rate: int) -> np.ndarray:
        """[n, M] page rows (relative to the page region) of the compressed entries each token may see:
        entry j is visible to position p once (j + 1) * rate <= p + 1; -1 elsewhere."""
        meta = self.meta
        visible = (self.positions + 1) // rate
        pool = meta.paged_pool(rate)
        most = meta.cache.cache.block_table.shape[1] * pool.page_rows  # entries a block-table row maps
        width = min(size_bucket(int(visible.max()), _MIN_ENTRIES), most) if self.count else 0
        j = np.arange(width)[None, :]
        rows = meta.cache.cache.page_rows(pool, meta.slots[self.seq][:, None], j)
        return np.where(j < visible[:, None], rows, -1)

    def _to_device(self, device: torch.device) -> RowTensors:
        move = functools.partial(to_device, device=device)

        out = RowTensors({m: tuple(map(move, v)) for m, v in self.commit.items()},
                         None if self.tokens is None else move(self.tokens), move(self.flat))
        if self.queries:
            out.rope = self.rope.mapped(move)
            out.window = {m: tuple(map(move, v)) for m, v in self.window.items()}
            out.entries = {r: move(v) for r, v in self.entries.items()}
            out.visible = {r: move(v) for r, v in self.visible.items()}
        if hasattr(self, "engram"):
            out.engram = move(self.engram)
        if hasattr(self, "engram_commit"):
            out.engram_commit = tuple(map(move, self.engram_commit))
        self.meta.rows[self.key] = out
        return out


class BoundRows:
    """A Rows as one run of the forward sees it: its host structure (tokens, split, write set) with the
    device tensors of the StepMeta the forward was given (`tensors`: its `rows`). The engine replays a
    recorded step with another step's metadata (core/graphs.with_step_tensors swaps the tensors of
    StepMeta.rows, not those a Rows holds), so the forward reads tensors only through these."""

    def __init__(self, rows: Rows, tensors: dict[str, RowTensors], bound: dict):
        self.rows, self.dev = rows, tensors[rows.key]
        bound[rows.key] = self
        self.write = self if rows.write is rows else bound.get(rows.write.key) or BoundRows(rows.write, tensors, bound)

    def __getattr__(self, name: str):
        return getattr(self.rows, name)


class StepMeta:
    """Index tensors of one step. Planned on the host from host tensors (no device sync), moved to the
    device in one go; `ids` is the device copy of the step's token ids, which the engine may patch
    with the previous step's samples before the forward. The forward reads the step only through the
    tensors of `ids`, `rows` (each Rows' device tensors by key: "all", and "encoder" / "decoder" /
    "decoder_write" where they differ) and `writes`, so the engine records a decode step once per shape
    bucket and replays it with a later step's (core/graphs.py). A decode step (one token per sequence,
    no prefix-cache replay) is planned with shapes that depend on its batch size and its entries' size
    bucket only: each KV source writes one entry per sequence, finished or not (an unfinished pair
    reads no token and writes to the cache's trash page)."""

    def __init__(self, inp: StepInput, cache: CacheView, config: DeepseekV41Config, split=None):
        self.inp, self.cache, self.config = inp, cache, config
        self.starts, self.slots = inp.starts.numpy(), inp.slots.numpy()
        self.lens = inp.lens.numpy()
        self.first = np.cumsum(self.lens) - self.lens
        self.ends = self.starts + self.lens
        self.num_tokens = int(self.lens.sum())
        if self.num_tokens > cache.max_step_tokens:
            raise ValueError(f"step has {self.num_tokens} tokens, cache scratch holds {cache.max_step_tokens}")
        self.seq, within = arange_within(self.lens)
        self.positions = self.starts[self.seq] + within
        self.floor = inp.window_floor.numpy()[self.seq] if inp.window_floor is not None else None
        self.restored = inp.num_restored.numpy() if inp.num_restored is not None else np.zeros_like(self.starts)
        self.rates = sorted({r.rate for r in config.roles if r.rate})
        self.ring_members = sorted({v.members for v in cache.layers})
        self.decode = self.num_tokens == len(self.lens) and inp.window_floor is None and inp.num_restored is None
        device = cache.device
        self.ids = inp.ids if device.type == "cpu" else inp.ids.to(device, non_blocking=True)
        # read the block table now: overlapped scheduling may hand a freed page to another request
        # context parallelism: `split` (deepinfer/parallel) says which rows this rank computes
        self.split = split
        self.rows: dict[str, RowTensors] = {}  # each Rows' device tensors, by its key
        self.all = Rows(self, "all", None, self.floor, queries=split is None)  # every token: the keys written
        self.encoder = self.all if split is None else self._share(self.all, split, "encoder")  # computed here
        self.decoder = self.encoder  # split_decoder: the decoder layers' rows under the CED split
        self.writes = {rate: self._entry_writes(rate) for rate in self.rates}

    def bind(self) -> tuple[BoundRows, BoundRows]:
        """(encoder, decoder) rows with this metadata's tensors (BoundRows)."""
        bound: dict[str, BoundRows] = {}
        encoder = BoundRows(self.encoder, self.rows, bound)
        decoder = encoder if self.decoder is self.encoder else bound.get(self.decoder.key) or \
            BoundRows(self.decoder, self.rows, bound)
        return encoder, decoder

    @classmethod
    def ahead(cls, inp: StepInput, cache: CacheView, config: DeepseekV41Config, steps: int,
              split=None) -> "StepMeta":
        """`steps` greedy decode steps planned at once (multi-step decoding: sequence b feeds position
        starts[b] + s in step s): each planned as the decode step it is, their tensors stacked (a
        leading dimension of `steps`, row s being step s's; the candidate rows padded to the widest
        step's bucket). `ids`: row 0 is the step's, the engine feeds the others back from the samples."""
        if not bool((inp.lens == 1).all()) or inp.window_floor is not None or inp.num_restored is not None:
            raise ValueError("several steps are planned at once only for decode steps")
        plans = [cls(StepInput(inp.ids, inp.slots, inp.starts + s, inp.lens), cache, config, split)
                 for s in range(steps)]
        for rate in plans[0].rates:
            entries = [p.rows["all"].entries for p in plans]
            width = max(e[rate].shape[1] for e in entries)
            for e in entries:
                e[rate] = torch.nn.functional.pad(e[rate], (0, width - e[rate].shape[1]), value=-1)
        per_step = [step_inputs(p)[0] for p in plans]
        return with_step_tensors(plans[0], [torch.stack(ts) for ts in zip(*per_step)])

    def paged_pool(self, rate: int) -> Pool:
        """A pool with one row per `rate` positions (all such pools share the page-row arithmetic)."""
        return next(p for p in self.cache.cache.pools.values() if p.spec.stride == rate)

    def ring_rows(self, pos: np.ndarray, seq: np.ndarray, ring: int, members: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, in_ring) of token position `pos` of batch sequence `seq` in a pool [slot rings | scratch]
        with `members` rings of `ring` rows per slot (member 0's ring; a layer adds member * ring where
        in_ring): the step's own tokens come from the scratch (one row per flat token), older ones
        from the ring; negative positions give -1."""
        start = self.starts[seq]
        rows = ring_rows(pos, start, self.first[seq], self.slots[seq], ring, self.cache.ring_slots, members)
        return rows, (pos < start) & (pos >= 0)

    def commit(self, ring: int, members: int, rows: "Rows") -> tuple[np.ndarray, np.ndarray]:
        """(scratch rows, member-0 ring rows) of the tokens of `rows` a ring keeps after the step."""
        return commit_rows(rows.positions, self.ends[rows.seq], rows.flat, self.slots[rows.seq], ring,
                           self.cache.ring_slots, members)

    def _entry_writes(self, rate: int) -> EntryWrites:
        """The compressed entries finished in this step (KV sources of `rate`): their page rows, the rows
        of their tokens (ratio 1: the step's flat row; ratio 2: the staging ring), RoPE at each entry's
        position (entry j stands for position j * rate)."""
        pool = self.paged_pool(rate)
        if self.decode:  # one entry per sequence: the one its token finishes, if any
            seq = np.arange(len(self.lens))
            finished = self.ends % rate == 0
            entry = np.maximum(self.ends // rate - 1, 0)
        else:
            first = np.maximum(self.starts, self.restored)  # restored pages are shared: read-only
            lo = first // rate
            counts = np.maximum(self.ends // rate - lo, 0)
            seq, within = arange_within(counts)
            entry, finished = lo[seq] + within, None
        out_rows = self.cache.cache.page_rows(pool, self.slots[seq], entry)
        if finished is not None:
            out_rows = np.where(finished, out_rows, self.cache.cache.trash_page * pool.page_rows)
        cos_sin = self.config.rope_compress.cos_sin(entry * rate)
        commit = scratch = None
        if rate > 1:
            ring = rate + self.cache.ring - self.config.sliding_window  # rate + rollback margin
            tok_pos = entry[:, None] * rate + np.arange(rate)
            tok_rows = self.ring_rows(tok_pos, seq[:, None], ring, 1)[0]
            if finished is not None:
                tok_rows = np.where(finished[:, None], tok_rows, -1)
            commit = self.commit(ring, 1, self.all)
            scratch = self.cache.ring_slots * ring
        else:
            tok_rows = self.first[seq] + (entry - self.starts[seq])
        move = functools.partial(to_device, device=self.cache.device)
        return EntryWrites(move(out_rows), tuple(map(move, cos_sin)), move(tok_rows),
                           None if commit is None else tuple(map(move, commit)), scratch)

    def split_decoder(self, logit_rows: torch.Tensor, mode: str, keep: int) -> None:
        """The CED split (model.py's doc): the decoder layers run on each long chunk's last `keep` rows
        (compact), or on every row with the same masking (mask, a check); off: every row, exact. A
        sequence whose step needs logits of any row but its last (prompt logprobs) runs in full: the
        decoder's window, and everything it feeds, would reach below the tail for those rows. (The
        DSpark drafter's context rows, the last window + margin positions, lie in the tail.) Reads
        `logit_rows` only for a step with a chunk longer than `keep` (never a decode step)."""
        if mode == "off" or not (self.lens > keep).any():
            return
        logit_rows = logit_rows.cpu().numpy()
        last = self.first + self.lens - 1
        seq_of = np.searchsorted(last, logit_rows)
        full = np.zeros(len(self.lens), dtype=bool)
        full[seq_of[logit_rows != last[seq_of]]] = True
        cut = (self.lens > keep) & ~full
        if not cut.any():
            return
        floor = self.floor.copy() if self.floor is not None else np.zeros(self.num_tokens, dtype=np.int64)
        tail_pos = (self.ends - keep)[self.seq]
        in_tail = cut[self.seq] & (self.positions >= tail_pos)
        floor = np.where(in_tail, tail_pos, floor)
        tokens = np.arange(self.num_tokens) if mode == "mask" else np.flatnonzero(~cut[self.seq] | in_tail)
        if self.split is None:
            self.decoder = Rows(self, "decoder", tokens, floor[tokens])
        else:
            rows = Rows(self, "decoder_write", tokens, floor[tokens], queries=False)
            self.decoder = self._share(rows, self.split.subset(torch.from_numpy(tokens)), "decoder")

    def _share(self, rows: Rows, split, key: str) -> Rows:
        """This rank's share of `rows` under context parallelism (`split`: of the rows of `rows`)."""
        own = split.own_rows.numpy()
        share = Rows(self, key, rows.flat[own], None if rows.floor is None else rows.floor[own])
        share.write, share.split = rows, split
        return share
