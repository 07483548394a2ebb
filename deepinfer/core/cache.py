"""The decode-state cache: preallocated pools a model declares (its CacheSpec), sequence slots,
and pages of state that grows with the sequence.

A pool is one tensor of rows of `width` features, in up to three regions:
- slot rows: `ring` rows per sequence slot, indexed by position modulo `ring` (sliding-window
  state: rejected speculative tokens need no undo while the ring keeps a rollback margin), for
  `max_seqs` slots and one more, `trash_slot`, never handed out;
- scratch rows: one per token of the step (max_step_tokens), where a step stages its new rows
  before they are committed (a prefill chunk longer than a ring must not overwrite rows its own
  earlier tokens still read);
- page rows: state that grows with the sequence, one row per `stride` positions, in pages of
  `page_tokens` positions. One block table per sequence serves every paged pool: page p of a
  sequence holds rows of positions [p * page_tokens, (p + 1) * page_tokens) in every paged pool.
  One more page, `trash_page`, is never handed out either: a step padded to a fixed shape (a
  recorded step's bucket, core/graphs.py) writes what its padding computes into the trash slot and
  page (the trash slot's block-table row maps every page to the trash page).
Pages of finished (or preempted) sequences stay in a prefix cache (core/prefix_cache.py) until
their page is needed: a free page is one on the free list or an idle cached one.
"""

from __future__ import annotations


import numpy as np
import torch

from deepinfer.core.prefix_cache import PrefixCache
from deepinfer.models.base import CacheSpec, Pool


class CacheFull(RuntimeError):
    """Not enough free pages or slots; the scheduler should preempt or wait."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StateCache:
    """Preallocated pools for `max_seqs` sequence slots and `num_pages` pages."""

    def __init__(self, spec: CacheSpec, *, max_seqs: int, num_pages: int, max_step_tokens: int,
                 max_model_len: int, page_tokens: int = 128, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        for stride in {p.stride for p in spec.pools} - {0}:
            if page_tokens % stride:
                raise ValueError(f"page_tokens ({page_tokens}) must be a multiple of every pool's stride ({stride})")
        self.spec = spec
        self.max_seqs = max_seqs
        self.trash_slot, self.ring_slots = max_seqs, max_seqs + 1  # slot rows exist for ring_slots slots
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.max_step_tokens = max_step_tokens
        self.max_model_len = max_model_len
        self.max_pages_per_seq = _cdiv(max_model_len, page_tokens)
        self.dtype, self.device = dtype, torch.device(device)
        self.pools: dict[str, Pool] = {}
        for p in spec.pools:
            scratch_base = self.ring_slots * p.ring
            page_base = scratch_base + (max_step_tokens if p.scratch else 0)
            page_rows = page_tokens // p.stride if p.stride else 0
            data = torch.zeros(page_base + (num_pages + 1) * page_rows, p.width, dtype=p.dtype or dtype,
                               device=self.device)
            self.pools[p.name] = Pool(p, data, scratch_base, page_base, page_rows)

        # host metadata: read when a step's index tensors are planned, never by a kernel
        self.block_table = np.zeros((self.ring_slots, self.max_pages_per_seq), dtype=np.int64)
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.trash_page = num_pages  # written by padding, never read (see the module doc)
        self.block_table[self.trash_slot] = self.trash_page
        self.slot_pages: dict[int, list[int]] = {}
        self.paged = spec.paged  # read for every sequence of every step (pages_for): once here
        self.prefix = PrefixCache(page_tokens) if self.paged else None

    # ------------------------------------------------------------ accounting
    def pages_for(self, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` positions holds (0 for a model without paged state)."""
        return -(-num_tokens // self.page_tokens) if self.paged else 0

    def bytes_per_page(self) -> int:
        return self.spec.bytes_per_page(self.page_tokens, self.element_size)

    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_slot(self.element_size)

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

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

    def release(self, slot: int, page_keys: list[bytes] = (), seq=None) -> None:
        """Return the slot and its pages. The pages `page_keys` name (the slot's full, computed
        pages) go to the prefix cache; the rest are freed. Slot rows need no clearing: a new
        sequence only reads positions it has written. `seq`: the slot's sequence, for KV events."""
        pages = self.slot_pages.pop(slot)
        if self.prefix is not None:
            self.prefix.insert(page_keys, pages, seq)
        # last page first: it becomes the least recently used, so a prefix is evicted from its tail
        for page in reversed(pages):
            if self.prefix is None or not self.prefix.drop(page):
                self.free_pages.append(page)
        self.free_slots.append(slot)

    # ------------------------------------------------------------ row maps
    def page_rows(self, pool: Pool, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Rows of `pool`'s paged region (relative to pool.page_base) holding row `rows` of each of
        `slots`' paged state (numpy index arrays, broadcast against each other: host-side
        planning). Row r covers positions [r * stride, (r + 1) * stride)."""
        per_page = pool.page_rows
        return self.block_table[slots, rows // per_page] * per_page + rows % per_page
