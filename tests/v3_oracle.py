"""transformers' DeepseekV3ForCausalLM as the oracle for deepinfer's V3 graph, in float32.

Each function runs one schedule through transformers and returns per-position logits [L, V]
(row i: the logits after token i, i.e. predicting token i + 1):
- full_logits: one forward over the whole sequence (no cache);
- chunked_logits: the sequence fed in chunks through a DynamicCache (transformers 5 caches MLA's
  normalised latent and rope key, not per-head K/V: the same state as deepinfer's latent pages);
- greedy_decode: prefill (optionally chunked), then one token per forward, greedy;
- schedule_logits: a mixed-batch schedule (sequences at different phases sharing steps), each
  sequence run alone with its own chunk boundaries (a padded transformers batch is not the
  oracle of an unpadded engine batch; causal logits do not depend on other sequences).
Causal logits at a position do not depend on how the sequence was cut into steps, so all four
agree with full_logits (tests/oracle/test_v3_oracle_selfcheck.py: ~1e-7 relative); deepinfer is
held to rel_err <= TOL against them.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

TOL = 1e-4  # deepinfer's V3 graph vs these logits: max |diff| / max |ref|


@contextlib.contextmanager
def single_thread():
    """transformers' eager MoE is hundreds of tiny ops per forward: on a loaded machine, OpenMP
    threads spin-waiting between them cost 10-100x the work; one thread runs the V3 oracle
    modules in seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prompts(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Random prompts of the given lengths (ids 2.. so bos/eos 0/1 never appear)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen) for n in lengths]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _cache_kwarg(hf) -> str:
    # transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40)
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def new_cache(hf):
    from transformers import DynamicCache

    return DynamicCache(config=hf.config)


def _step(hf, ids: torch.Tensor, cache) -> torch.Tensor:
    out = hf(input_ids=ids.view(1, -1), use_cache=True, **{_cache_kwarg(hf): cache})
    return out.logits[0].float()


@torch.no_grad()
def full_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """(a) one forward of the whole sequence. ids [L] -> [L, V]."""
    return hf(input_ids=ids.view(1, -1), use_cache=False).logits[0].float()


@torch.no_grad()
def chunked_logits(hf, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """(b) ids fed in chunks of the given sizes (sum <= len(ids)) through one DynamicCache.
    -> [sum(chunks), V]."""
    cache, out, start = new_cache(hf), [], 0
    for n in chunks:
        out.append(_step(hf, ids[start:start + n], cache))
        start += n
    if start > len(ids):
        raise ValueError(f"chunks cover {start} tokens, the sequence has {len(ids)}")
    return torch.cat(out)


@torch.no_grad()
def greedy_decode(hf, prompt: torch.Tensor, steps: int, prefill_chunks: list[int] | None = None
                  ) -> tuple[list[int], torch.Tensor]:
    """(c) prefill (in prefill_chunks, default one chunk), then `steps` greedy tokens, one forward
    each. -> (the generated tokens [steps], logits of every position [len(prompt) + steps - 1, V]:
    the prompt's rows, then the row of each fed-back token but the last)."""
    chunks = prefill_chunks or [len(prompt)]
    if sum(chunks) != len(prompt):
        raise ValueError("prefill_chunks must cover the prompt exactly")
    cache, rows, start = new_cache(hf), [], 0
    for n in chunks:
        rows.append(_step(hf, prompt[start:start + n], cache))
        start += n
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(steps - 1):
        rows.append(_step(hf, torch.tensor([tokens[-1]]), cache))
        tokens.append(int(rows[-1][-1].argmax()))
    return tokens, torch.cat(rows)


@torch.no_grad()
def schedule_logits(hf, prompts: list[torch.Tensor], steps: list[list[tuple[int, int]]]
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(d) a mixed-batch schedule: steps[j] lists (sequence, tokens it runs in step j), as
    tests/oracle/test_model_vs_transformers.py writes them. A sequence that runs past its prompt
    continues greedily (each further token is the argmax of the previous row). Each sequence runs
    alone through its own DynamicCache with the same chunk boundaries as in the schedule.
    -> per sequence (its tokens [n], its logits [n, V]), n = the tokens the schedule gave it."""
    caches = [new_cache(hf) for _ in prompts]
    tokens = [p.tolist() for p in prompts]
    seen = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in steps:
        for s, n in step:
            end = seen[s] + n
            if end > len(tokens[s]) + 1 and end > len(prompts[s]):
                raise ValueError(f"sequence {s}: decode steps feed one token at a time")
            if end > len(tokens[s]):  # decoding: the next token is the greedy one of the last row
                tokens[s].append(int(rows[s][-1][-1].argmax()))
            rows[s].append(_step(hf, torch.tensor(tokens[s][seen[s]:end]), caches[s]))
            seen[s] = end
    return [(torch.tensor(tokens[s][:seen[s]]), torch.cat(rows[s])) for s in range(len(prompts))]


def hf_generate(hf, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate() with no stopping (an eos would end it early): what the
    peers benchmark runs."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generation_config.eos_token_id = None  # else generate() falls back to the model's eos
    with torch.no_grad():
        out = hf.generate(prompt.view(1, -1), generation_config=gc)
    return out[0, len(prompt):].tolist()
