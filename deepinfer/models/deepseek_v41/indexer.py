"""DeepSeek-V4.1's index selection on indexer scores: candidate blocks (the candidate source's first
level) and the top-k picks. Scores are [n, M] over the entries a token may see (-inf elsewhere).

Both select with a stable sort: among equal scores the earlier entry (block) wins, so a token's
selection never depends on how far its row is padded, i.e. on which other tokens share the step
(batch invariance). The reference's torch.topk(sorted=False) leaves such ties to the
implementation; the goldens compare picks up to ties at the cutoff (tests/v41_goldens.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def top_columns(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, columns) of the k largest scores per row, earlier column first among equals."""
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """The candidate mask [n, M] (bool): entries in blocks of `block_size`, a block scored by its best
    entry, the block holding the token's newest visible entry (visible - 1) always kept, then the best
    `topk_blocks` blocks; blocks whose score is -inf (nothing visible) are never kept. The mask marks
    whole blocks (entries past `visible` in the newest block too: their scores are -inf anyway)."""
    n, width = scores.shape
    blocks = F.pad(scores, (0, -width % block_size), value=float("-inf")).unflatten(1, (-1, block_size)).amax(dim=-1)
    newest = torch.div(visible - 1, block_size, rounding_mode="floor")
    columns = torch.arange(blocks.shape[1], device=scores.device)
    blocks = blocks.masked_fill((columns == newest[:, None]) & (visible[:, None] > 0), float("inf"))
    values, kept = top_columns(blocks, min(topk_blocks, blocks.shape[1]))
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(1, kept, values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=1)[:, :width]


def topk_picks(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The rows (`candidates` values) of the k best-scoring entries per token, in entry order (as the
    reference lists them: it decides which 64-index block of the attention each falls in), -1 where
    fewer are finite (last). scores, candidates [n, M]; column j of a row is entry j."""
    k = min(k, scores.shape[1])
    values, columns = top_columns(scores, k)
    columns = torch.where(torch.isfinite(values), columns, scores.shape[1]).sort(dim=1).values
    picked = candidates.gather(1, columns.clamp(max=max(scores.shape[1] - 1, 0)))
    return torch.where(columns < scores.shape[1], picked, torch.full_like(picked, -1))
