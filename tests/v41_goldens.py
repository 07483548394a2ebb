"""The DeepSeek-V4.1 golden files (tests/goldens/v41/, written by tools/v41_goldens.py from DeepSeek's
reference code): loading them, and the two comparisons their README defines (ulp_error for floats,
tie-aware top-k picks). Needs only torch, numpy and safetensors: no reference, no sympy."""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

GOLDENS = Path(__file__).parent / "goldens" / "v41"
CONFIGS = ("ced10", "mini6")  # the tiny checkpoints, each a directory in the HF layout
VL_CONFIG = "mini6vl"  # mini6 with a vision tower (its text tensors are mini6's, through the shard index)
# mini6 with index_topk wider than its candidate blocks, and so few positions that no token sees more
# entries than index_topk (its tensors are mini6's, through the shard index): e2e goldens only
WIDE_CONFIG = "mini6wide"
E2E_CONFIGS = CONFIGS + (WIDE_CONFIG,)


class Golden(dict):
    """name -> tensor for one golden file, aliases resolved (the file stores equal tensors once);
    `meta` is its json. `under(prefix)` gives the entries below a dotted prefix, prefix stripped."""

    def __init__(self, stem: str):
        tensors = load_file(GOLDENS / f"{stem}.safetensors")
        self.meta = json.loads((GOLDENS / f"{stem}.json").read_text())
        super().__init__(tensors)
        for alias, target in self.meta.get("aliases", {}).items():
            self[alias] = tensors[target]

    def under(self, prefix: str) -> dict[str, torch.Tensor]:
        prefix = prefix.rstrip(".") + "."
        return {k[len(prefix):]: v for k, v in self.items() if k.startswith(prefix)}


@cache
def load(stem: str) -> Golden:
    """stem: "ops", "engram", "blocks_ced10", "e2e_ced10", "e2e_mini6", "e2e_mini6wide" (README lists them)."""
    return Golden(stem)


def checkpoint_dir(config: str) -> Path:
    """The tiny checkpoint: config.json (nested text_config), model.safetensors (mini6vl: a shard index),
    tokenizer files."""
    assert config in E2E_CONFIGS + (VL_CONFIG,), config
    return GOLDENS / config


def vl_registered() -> bool:
    """Whether the registry reads the VL checkpoint (DeepSeek-V4.1 with a vision tower): the image
    tests skip where it does not."""
    from deepinfer.models.base import ConfigError
    from deepinfer.models.registry import load_config

    try:
        load_config(checkpoint_dir(VL_CONFIG))
    except ConfigError:
        return False
    return True


VL_SKIP_REASON = "DeepSeek-V4.1 with a vision tower is not in this tree yet (the V4.1 text model, issue 23)"


def vision_pngs() -> list[bytes]:
    """The two PNG files of the vision goldens, as stored."""
    return [load("vision")[f"image{j}.png"].numpy().tobytes() for j in (0, 1)]


def noise() -> dict:
    """The reference's own noise, measured by the tool (README, "Tolerances")."""
    return json.loads((GOLDENS / "noise.json").read_text())


SAME_DTYPE_PROBES = ("reordered", "ties", "rounding")
ALL_PROBES = SAME_DTYPE_PROBES + ("fp32",)


def block_tolerance(config: str, key: str, probes: tuple[str, ...] = ALL_PROBES) -> dict[str, float]:
    """The recommended bound for a block output (README, "Tolerances"), in ulp_error units: twice the
    worst the reference's own noise probes reached on that tensor when rerun alone on the recorded
    inputs, for the max, the 99.9th percentile and the mean, never below one ulp (max, p999).
    probes=SAME_DTYPE_PROBES is the strict bound for code that keeps the reference's bf16 rounding
    points; the default adds the fp32 probe (kernels that keep intermediates in fp32).
    key: a name noise.json lists under blocks.<config>.<probe>, e.g. "L3.out.x", "dspark_step.mtp0.out.x"."""
    measured = noise()["blocks"][config]
    worst = {m: max(measured[p][key][m] for p in probes) for m in ("max", "p999", "mean")}
    return {"max": max(2 * worst["max"], 1.0), "p999": max(2 * worst["p999"], 1.0), "mean": 2 * worst["mean"]}


def e2e_tolerance(config: str) -> dict[str, float]:
    """The recommended end-to-end bounds (README, "Tolerances"): twice the worst over the noise probes
    and the reference's own decode-vs-prefill difference, for |d logprob| of the prompt tokens (mean
    and max), and the top-2 log-prob gap above which a greedy token must agree (greedy_gap)."""
    e2e = noise()["e2e"][config]
    probes = [e2e[p] for p in ("reordered", "ties", "rounding", "fp32")]
    token = [p["prefill_token_logprob"] for p in probes] + [e2e["decode_vs_prefill"]["token_logprob"]]
    return {"mean": 2 * max(t["mean"] for t in token), "max": 2 * max(t["max"] for t in token),
            "greedy_gap": 2 * max(p["max_top2_gap_at_flip"] for p in probes),
            "dspark_logprob": 2 * max(p["dspark_draft_logprob"]["max"] for p in probes),
            "dspark_confidence": 2 * max(p["dspark_confidence"]["max"] for p in probes)}


def vision_tolerance(key: str) -> dict[str, float]:
    """The bound for an image embedding (README, "Image input"), in ulp_error units: twice the worst of the
    vision probes (fp32, reordered) on it, never below one ulp (max, p999). key: "image0.vit",
    "image1.aligner", ..."""
    measured = noise()["vision"]["vision"]
    worst = {m: max(measured[p][key][m] for p in measured) for m in ("max", "p999", "mean")}
    return {"max": max(2 * worst["max"], 1.0), "p999": max(2 * worst["p999"], 1.0), "mean": 2 * worst["mean"]}


def vision_e2e_tolerance() -> dict[str, float]:
    """e2e_tolerance for the image prompt (noise.json: vision.e2e)."""
    e2e = noise()["vision"]["e2e"]
    probes = [e2e[p] for p in ("reordered", "ties", "rounding", "fp32")]
    token = [p["prefill_token_logprob"] for p in probes] + [e2e["decode_vs_prefill"]["token_logprob"]]
    return {"mean": 2 * max(t["mean"] for t in token), "max": 2 * max(t["max"] for t in token),
            "greedy_gap": 2 * max(p["max_top2_gap_at_flip"] for p in probes)}


def real_token_map() -> np.ndarray:
    """Engram's token-class map of the real 129,280-token DeepSeek vocabulary ([129280] int64).
    Stored compactly: class ids are numbered in first-seen order, so only the ids that reuse an
    earlier class are stored (with that class); every other id opens the next class."""
    stored = np.load(GOLDENS / "engram_real_token_map.npz")
    meta = load("engram").meta["real"]
    lookup = np.full(meta["vocab_size"], -1, dtype=np.int64)
    lookup[stored["repeat_ids"]] = stored["repeat_classes"]
    fresh = lookup < 0
    lookup[fresh] = np.arange(int(fresh.sum()))
    return lookup


def token_map_sha256(lookup: np.ndarray) -> str:
    """The digest the golden states for a token map: sha256 of its int32 little-endian bytes."""
    return hashlib.sha256(np.asarray(lookup, dtype="<i4").tobytes()).hexdigest()


def ulp_error(actual: torch.Tensor, expected: torch.Tensor, mantissa_bits: int = 7) -> torch.Tensor:
    """|actual - expected| in ulps, bf16 ulps by default (7 stored mantissa bits; 23 gives fp32 ulps)
    whatever the dtypes, each element measured at max(|expected|, RMS(expected)). Elements far below
    the tensor's RMS count in ulps of the RMS, i.e. an absolute error of one ulp of a typical element:
    a sum that cancels to nearly zero does not turn a rounding difference into thousands of ulps."""
    bits = mantissa_bits
    e, a = expected.double(), actual.double()
    rms = e.square().mean().sqrt()
    magnitude = torch.maximum(e.abs(), rms).clamp_min(torch.finfo(torch.float32).tiny)
    return (a - e).abs() / torch.exp2(torch.floor(torch.log2(magnitude)) - bits)


def topk_boundary_ties(score: torch.Tensor, k: int) -> torch.Tensor:
    """[..., n] scores -> bool [...]: rows whose k-th and (k+1)-th largest scores are equal and finite.
    There torch.topk(sorted=False), which the reference uses, may keep either entry."""
    if score.size(-1) <= k:
        return torch.zeros(score.shape[:-1], dtype=torch.bool)
    top = score.float().topk(k + 1, dim=-1).values
    return (top[..., k - 1] == top[..., k]) & torch.isfinite(top[..., k])


def same_topk_picks(score: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Per row: `actual` picks are as good as `expected` (the golden's), given `score` (what the top-k
    ran on). Equal sets always pass; otherwise the two may differ only in entries whose score equals
    the k-th largest. Picks are index lists ([..., k], -1 = none); compare the sets, not the order."""
    k = expected.size(-1)
    kth = score.float().topk(k, dim=-1).values[..., -1:]

    def membership(picks):
        m = torch.zeros(score.shape, dtype=torch.bool)
        valid = picks >= 0
        m.scatter_(-1, picks.clamp_min(0).long(), valid)
        return m

    e, a = membership(expected), membership(actual)
    differ = e ^ a
    tied = score.float() == kth
    return ~(differ & ~tied).any(-1) & (e.sum(-1) == a.sum(-1))
