"""The decode-state cache of DeepSeek-V4: what a sequence needs between steps, and no more.

Per sequence slot and layer:
- a sliding-window ring of KV: `window + margin` rows (margin = rollback room for drafts);
- on CSA/HCA layers, a compressor ring holding the raw (kv, gate) projections of the
  tokens whose window is not finished (CSA keeps two windows for the overlap), plus the
  same margin;
- on CSA layers the same for the indexer's compressor.
Rings are indexed by position modulo their size, so speculative tokens that are rejected
need no undo: with `margin` >= the longest draft, a stale row written for a rejected
position can never alias a position that is still read, and the compressed entry a
rejected token finished is rewritten by the step that feeds the real token at that
position before any later token can see it.
Compressed entries (and CSA indexer keys) grow with the sequence; they live in pages.
One page covers `page_tokens` positions of a sequence (a multiple of every compress
rate), i.e. page_tokens/rate entries on each compressing layer, so a single block
table per sequence serves every layer.

Pages of finished (or preempted) sequences stay in a prefix cache (core/prefix_cache.py) until
their page is needed: a free page is one on the free list or an idle cached one.

Each layer's KV lives in one tensor `[ring rows | step scratch | compressed entries]` so
attention takes one pool and one index list. The scratch holds the step's new tokens:
a prefill chunk longer than the ring must not overwrite keys its own earlier tokens still
need, so new tokens are staged there and copied into the ring after the layer ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.core.config import CSA, ModelConfig
from deepinfer.core.prefix_cache import PrefixCache


class CacheFull(RuntimeError):
    """Not enough free pages or slots; the scheduler should preempt or wait."""


@dataclass(slots=True)
class LayerState:
    kind: str
    rate: int  # 0 for sliding-only layers
    kv: torch.Tensor  # [ring_rows + scratch + entry_rows, head_dim]
    comp_ring: torch.Tensor | None = None  # [slots*ring + scratch, 2*C] raw kv|gate per token
    index_ring: torch.Tensor | None = None  # CSA: [slots*ring + scratch, 2*2*Di]
    index_keys: torch.Tensor | None = None  # CSA: [entry_rows, Di]
    margin: int = 0  # rollback room of the compressor rings (see the module docstring)

    @property
    def comp_ring_size(self) -> int:
        return (2 * self.rate if self.kind == CSA else self.rate) + self.margin


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StateCache:
    """Preallocated pools for `max_seqs` sequence slots and `num_pages` pages of compressed state."""

    def __init__(self, config: ModelConfig, *, max_seqs: int, num_pages: int, max_step_tokens: int,
                 max_model_len: int, margin: int = 0, page_tokens: int = 128,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        rates = [config.compress_rate(i) for i in range(config.num_hidden_layers)]
        for rate in set(rates) - {0}:
            if page_tokens % rate:
                raise ValueError(f"page_tokens ({page_tokens}) must be a multiple of every compress rate ({rate})")
        self.config = config
        self.max_seqs = max_seqs
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.max_step_tokens = max_step_tokens
        self.max_model_len = max_model_len
        self.ring = config.sliding_window + margin
        self.ring_rows = max_seqs * self.ring
        self.max_pages_per_seq = _cdiv(max_model_len, page_tokens)
        self.dtype, self.device = dtype, torch.device(device)
        d, di = config.head_dim, config.index_head_dim

        def empty(rows: int, width: int) -> torch.Tensor:
            return torch.zeros(rows, width, dtype=dtype, device=self.device)

        self.layers: list[LayerState] = []
        for i, rate in enumerate(rates):
            kind = config.layer_types[i]
            entry_rows = num_pages * (page_tokens // rate) if rate else 0
            state = LayerState(kind, rate, empty(self.ring_rows + max_step_tokens + entry_rows, d), margin=margin)
            if rate:
                width = 2 * d if kind == CSA else d
                state.comp_ring = empty(max_seqs * state.comp_ring_size + max_step_tokens, 2 * width)
            if kind == CSA:
                state.index_ring = empty(max_seqs * state.comp_ring_size + max_step_tokens, 2 * 2 * di)
                state.index_keys = empty(entry_rows, di)
            self.layers.append(state)

        # host metadata: read when a step's index tensors are planned, never by a kernel
        self.block_table = np.zeros((max_seqs, self.max_pages_per_seq), dtype=np.int64)
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.slot_pages: dict[int, list[int]] = {}
        self.has_compressed_layers = any(layer.rate for layer in self.layers)  # else no pages at all
        self.prefix = PrefixCache(page_tokens) if self.has_compressed_layers else None

    # ------------------------------------------------------------ accounting
    def pages_for(self, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` positions holds (0 for sliding-only models)."""
        return _cdiv(num_tokens, self.page_tokens) if self.has_compressed_layers else 0

    def bytes_per_page(self) -> int:
        per = 0
        for layer in self.layers:
            if layer.rate:
                rows = self.page_tokens // layer.rate
                per += rows * layer.kv.shape[1]
                if layer.index_keys is not None:
                    per += rows * layer.index_keys.shape[1]
        return per * self.layers[0].kv.element_size()

    def bytes_per_slot(self) -> int:
        per = 0
        for layer in self.layers:
            per += self.ring * layer.kv.shape[1]
            for ring in (layer.comp_ring, layer.index_ring):
                if ring is not None:
                    per += layer.comp_ring_size * ring.shape[1]
        return per * self.layers[0].kv.element_size()

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages) + (len(self.prefix.idle) if self.prefix is not None else 0)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate_slot(self, cached_pages: list[int] = ()) -> int:
        """A slot whose first positions are held by `cached_pages` (from the prefix cache)."""
        if not self.free_slots:
            raise CacheFull("no free sequence slot")
        slot = self.free_slots.pop()
        if cached_pages:
            self.prefix.hold(cached_pages)
            self.block_table[slot, :len(cached_pages)] = cached_pages
        self.slot_pages[slot] = list(cached_pages)
        return slot

    def can_admit(self, cached_pages: list[int], num_tokens: int) -> bool:
        """Whether a new slot starting with `cached_pages` can hold positions [0, num_tokens)."""
        need = max(self.pages_for(num_tokens) - len(cached_pages), 0)
        pinned = self.prefix.num_idle_among(cached_pages) if cached_pages else 0
        return need <= self.num_free_pages - pinned

    def can_grow(self, slot: int, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens) - len(self.slot_pages[slot])
        return need <= 0 or need <= self.num_free_pages

    def grow(self, slot: int, num_tokens: int) -> None:
        """Make the slot hold state for positions [0, num_tokens)."""
        if num_tokens > self.max_model_len:
            raise CacheFull(f"{num_tokens} positions exceed max_model_len={self.max_model_len}")
        pages = self.slot_pages[slot]
        need = self.pages_for(num_tokens) - len(pages)
        if need <= 0:  # most decode steps
            return
        if need > self.num_free_pages:
            raise CacheFull(f"slot {slot} needs {need} pages, {self.num_free_pages} free")
        for _ in range(need):
            page = self.free_pages.pop() if self.free_pages else self.prefix.evict()
            self.block_table[slot, len(pages)] = page
            pages.append(page)

    def release(self, slot: int, page_keys: list[bytes] = ()) -> None:
        """Return the slot and its pages. The pages `page_keys` name (the slot's full, computed
        pages) go to the prefix cache; the rest are freed. Ring contents need no clearing: a new
        sequence only reads positions it has written."""
        pages = self.slot_pages.pop(slot)
        if self.prefix is not None:
            self.prefix.insert(page_keys, pages)
        # last page first: it becomes the least recently used, so a prefix is evicted from its tail
        for page in reversed(pages):
            if self.prefix is None or not self.prefix.drop(page):
                self.free_pages.append(page)
        self.free_slots.append(slot)

    # ------------------------------------------------------------ row maps
    def entry_rows(self, layer: LayerState, slots: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """Rows (relative to the compressed region) of compressed entries `entries` of `slots`
        (numpy index arrays, broadcast against each other: this is host-side planning)."""
        per_page = self.page_tokens // layer.rate
        return self.block_table[slots, entries // per_page] * per_page + entries % per_page

    def entry_base(self) -> int:
        """First row of the compressed-entry region inside a layer's kv tensor."""
        return self.ring_rows + self.max_step_tokens
