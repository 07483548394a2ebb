"""The reference dense_attention (backends/reference.py) against an independent formulation: torch's
scaled_dot_product_attention over the whole packed batch with a block-diagonal mask. Its query blocking
(bounded logits memory) must not change results; bad lengths are refused. The other backends are checked
against it in tests/conformance and tests/ascend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backends import reference


def masked_sdpa(q, k, v, lens, scale):
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask = seq[:, None] == seq[None, :]  # True: may attend
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("lens", [(9,), (30, 0, 1, 17), (5, 5, 5)])
def test_matches_block_diagonal_sdpa(lens, monkeypatch):
    gen = torch.Generator().manual_seed(len(lens))
    t, h, d = sum(lens), 3, 20
    q, k, v = (torch.randn(t, h, d, generator=gen) for _ in range(3))
    expected = masked_sdpa(q, k, v, list(lens), 0.3)
    torch.testing.assert_close(reference.dense_attention(q, k, v, list(lens), 0.3), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(reference, "_DENSE_LOGITS", 7)  # queries in blocks of 1-2: the same result
    torch.testing.assert_close(reference.dense_attention(q, k, v, list(lens), 0.3), expected, rtol=1e-5, atol=1e-5)


def test_sequences_do_not_see_each_other():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(10, 2, 8, generator=gen) for _ in range(3))
    out = reference.dense_attention(q, k, v, [4, 6], 1.0)
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 5.0
    v2[4:] -= 3.0  # change only the second sequence
    again = reference.dense_attention(q, k2, v2, [4, 6], 1.0)
    assert torch.equal(out[:4], again[:4]) and not torch.allclose(out[4:], again[4:])


@pytest.mark.parametrize("lens", [[3, 2], [7, -1]])
def test_lengths_must_cover_the_tokens(lens):
    q = torch.zeros(6, 1, 4)
    with pytest.raises(ValueError, match="must be >= 0 and sum to the 6 tokens"):
        reference.dense_attention(q, q, q, lens, 1.0)
