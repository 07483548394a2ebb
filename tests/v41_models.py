"""deepinfer's DeepSeek-V4.1 model on the golden checkpoints (tests/goldens/v41), and a way to run one of
its blocks alone on the inputs the reference recorded (level 2 of the V4.1 verification)."""

from __future__ import annotations

import contextlib
from functools import cache
from unittest import mock

import torch

from deepinfer.backends import get_accelerator
from deepinfer.core.cache import StateCache
from deepinfer.core.loader import load_checkpoint
from deepinfer.models.base import StepInput
from deepinfer.models.deepseek_v41 import model as v41_model
from deepinfer.models.deepseek_v41.model import StepState
from deepinfer.models.registry import load_config
from v41_goldens import checkpoint_dir, e2e_tolerance, load


@cache
def model(config: str, accelerator: str = "cpu"):
    """The golden checkpoint `config` through deepinfer's registry and loader (built once)."""
    return build(config, accelerator)


def build(config: str, accelerator: str = "cpu"):
    """A new model of the golden checkpoint `config` (on the accelerator as the environment sets it now)."""
    directory = checkpoint_dir(config)
    cfg, cls = load_config(directory)
    weights, extra = load_checkpoint(directory, cls.checkpoint_tensors(cfg), cls, keep_prefixes=cls.extra_prefixes)
    accel = get_accelerator(accelerator)
    accel.tune_for_model(cfg.hidden_size)  # as the engine does: one thread for a tiny model
    out = cls(cfg, weights, accel)
    out.extra = extra
    return out


def new_cache(m, max_seqs: int = 8, max_step_tokens: int = 512, max_model_len: int = 512, margin: int = 0,
              num_pages: int = 64) -> StateCache:
    return StateCache(m.cache_spec(margin), max_seqs=max_seqs, num_pages=num_pages, max_step_tokens=max_step_tokens,
                      max_model_len=max_model_len, page_tokens=128, device=m.accel.device)


def page_rows(meta, rate: int, entries: torch.Tensor) -> torch.Tensor:
    """Entry indices [n, k] (-1 none) of the step's single sequence -> rows of its pages."""
    rows = meta.rows["all"].entries[rate][-1]  # the last token sees every entry of the step
    return torch.where(entries >= 0, rows[entries.clamp(min=0)], -1)


def run_block(m, config: str, layer: int, recorded_picks: bool = False,
              pre_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer` of deepinfer's model alone on the reference's recorded prefill inputs
    (blocks_<config>: `L<i>.in.x`, `in.pre_mix`) with the cross-layer state it found published: its KV
    source's compressed KV and index keys (recorded, or written by running the source's block first
    when the golden keeps only the source's brief names), the picks of `state_in`, the candidates.
    `recorded_picks`: an index source uses the reference's picks instead of its own (they may differ
    on ties at the cutoff). `pre_in` replaces the recorded collapse weights (a deliberately wrong
    schedule). Returns (copies [n, hc, d], pre for the next layer [n, hc])."""
    g = load(f"blocks_{config}")
    n = len(g.meta["input_ids"])
    cache = new_cache(m)
    slot = cache.allocate_slot()
    cache.grow(slot, n)
    ids = torch.tensor(g.meta["input_ids"])
    meta = m.prepare(StepInput(ids, torch.tensor([slot]), torch.tensor([0]), torch.tensor([n])), cache)
    role = m.config.roles[layer]
    if role.rate and not role.owns_kv:
        src = f"L{role.kv_source}.attn."
        if src + "compress_kv" in g:  # the source's published entries and keys (rows 0..e-1 of its pages)
            view = meta.cache.layers[layer]
            rows = page_rows(meta, role.rate, torch.arange(n // role.rate))
            view.pool.data[view.pool.page_base + rows] = g[src + "compress_kv"][0].float()
            view.index_keys.data[view.index_keys.page_base + rows] = g[src + "indexer.k"][0].float()
        else:
            _block(m, g, meta, role.kv_source, StepState(), recorded_picks)
    state = StepState()
    if role.rate and not role.owns_index:  # the reference's picks are entry + n (-1 none)
        picks = g[f"L{layer}.state_in.topk_idxs"][0].long()
        state.picks[role.index_source] = (meta.all, page_rows(meta, role.rate, torch.where(picks >= 0, picks - n, -1)))
    if role.reindex:
        mask = g[f"L{layer}.state_in.candidates"][0]  # padded as the step's candidate rows are
        width = meta.rows["all"].entries[role.rate].shape[1]
        state.candidates = (meta.all, torch.nn.functional.pad(mask, (0, width - mask.shape[1])))
    return _block(m, g, meta, layer, state, recorded_picks, pre_in)


def _block(m, g, meta, layer: int, state, recorded_picks: bool, pre_in: torch.Tensor | None = None):
    p, n = f"L{layer}.", meta.num_tokens
    role = m.config.roles[layer]
    streams, pre = g[p + "in.x"][0].float(), g[p + "in.pre_mix"][0].float() if pre_in is None else pre_in
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        if recorded_picks and role.owns_index:
            picks = g[p + "attn.indexer.out"][0].long()
            fixed = page_rows(meta, role.rate, torch.where(picks >= 0, picks - n, -1))
            stack.enter_context(mock.patch.object(v41_model, "topk_picks", lambda *args: fixed))
        return m.block(f"layers.{layer}.", streams, pre, lambda h: m._attention(layer, h, meta, meta.all, state),
                       lambda h: m._moe(layer, h))


def split_decode_logprobs(config: str, accelerator: str, decode_steps: int = 2) -> torch.Tensor:
    """|log-prob - the reference's| of golden prompt 3 fed as the goldens' split: its prefill, then
    `decode_steps` tokens one per step, on a new model on `accelerator` (e2e_<config>: p3.split)."""
    from model_runner import run_schedule

    g = load(f"e2e_{config}")
    ids, p0 = g["p3.ids"], g.meta["prompts"][3]["split_prefill_len"]
    fed = ids[:p0 + decode_steps]
    m = build(config, accelerator)
    logits = run_schedule(m, new_cache(m), [fed], [[(0, p0)]] + [[(0, 1)]] * decode_steps)[0].cpu()
    # log-prob of token t + 1 at position t, from the last prefill position to the last fed one
    logprobs = torch.log_softmax(logits.double(), -1).gather(1, ids[1:p0 + decode_steps + 1, None]).squeeze(1)
    return (logprobs[p0 - 1:] - g["p3.split.logprobs"][:decode_steps + 1]).abs()


def check_split_decode(config: str, accelerator: str) -> None:
    """split_decode_logprobs on `accelerator` within the cpu backend's level-3 bound (e2e_tolerance)."""
    diff = split_decode_logprobs(config, accelerator)
    tol = e2e_tolerance(config)
    print(f"{config} on {accelerator}: |d logprob| mean {float(diff.mean()):.4f} max {float(diff.max()):.4f} (bound {tol})")
    assert float(diff.mean()) <= tol["mean"] and float(diff.max()) <= tol["max"]
