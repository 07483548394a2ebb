"""Which data-parallel rank takes a request: the one with the least expected work.

A rank's expected work for a new prompt is the prefill it still owes (prompt tokens of accepted
requests that have not produced a token yet, less what each found cached), plus the tokens its
running requests hold in the KV cache (prompt + generated so far: the per-step decode load and
the room taken), minus the prompt's prefix-cache hit on that rank: the prompt tokens that rank
would not have to compute. Lowest rank on ties, so the choice is a pure function of the state.

The hit is estimated on the front, without asking the ranks: a per-rank record of the prefix
pages it sent there, keyed with the engine's own page hashing (core/prefix_cache.py), least
recently sent forgotten first once a record holds as many pages as that rank's cache. It can be
wrong only in one way that matters (a rank evicted pages the record still holds), which costs a
recompute, never a wrong output.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from deepinfer.core.prefix_cache import PrefixCache


class LeastWorkBalancer:
    def __init__(self, num_pages: Sequence[int], page_tokens: int, prefix_cache: bool):
        self.page_tokens = page_tokens
        self.capacity = list(num_pages)
        self._hasher = PrefixCache(page_tokens) if prefix_cache else None  # only its key chain is used
        self._sent: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.capacity]

    def page_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The prefix-cache keys of the prompt's full pages (empty without a prefix cache)."""
        return self._hasher.keys([], token_ids) if self._hasher is not None else []

    def hit_tokens(self, rank: int, keys: Sequence[bytes]) -> int:
        """Prompt tokens rank `rank` probably holds cached: its longest recorded prefix of `keys`."""
        sent, hit = self._sent[rank], 0
        for key in keys:
            if key not in sent:
                break
            hit += 1
        return hit * self.page_tokens

    def choose(self, keys: Sequence[bytes], owed: Sequence[int], held: Sequence[int],
               candidates: Sequence[int]) -> int:
        """The candidate rank of least owed prefill + held KV tokens - prefix hit (lowest on ties)."""
        return min(candidates, key=lambda r: (owed[r] + held[r] - self.hit_tokens(r, keys), r))

    def remember(self, rank: int, keys: Sequence[bytes]) -> None:
        """The prompt's pages were sent to `rank`: it will hold them once it has prefilled them."""
        sent = self._sent[rank]
        for key in keys:
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > self.capacity[rank]:
            sent.popitem(last=False)
