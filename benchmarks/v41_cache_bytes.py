"""Decode-state bytes per token: DeepSeek-V4.1-Flash against DeepSeek-V4-Flash, from each model's own
cache spec (the pools deepinfer allocates) at the released shapes, bf16 cache, no rollback margin.
Nothing is timed: the figures are what the engine's cache planner multiplies out.

    python benchmarks/v41_cache_bytes.py

Per sequence of L tokens: paged state (compressed entries and index keys: V4 every CSA/HCA layer,
V4.1 only its 4 KV sources) grows with L; per-slot state (window rings, compressor staging, Engram's
look-back) is fixed. Prints a table and writes benchmarks/results/v41_cache_bytes.json.
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from deepinfer.models.deepseek_v4 import DeepseekV4Config  # noqa: E402
from deepinfer.models.deepseek_v4.step import cache_spec as v4_cache_spec  # noqa: E402
from deepinfer.models.deepseek_v41 import DeepseekV41Config  # noqa: E402
from deepinfer.models.deepseek_v41.step import cache_spec as v41_cache_spec  # noqa: E402
from v41_released import text_only  # noqa: E402

PAGE = 128
BF16 = 2
LENGTHS = (4096, 32768, 131072, 1048576)

# DeepSeek-V4-Flash's released config (reference/DEEPSEEK_V4.md): 43 layers, HCA (128) on layers 0-1 and
# the odd layers, CSA (4) on the even ones from 2.
V4_FLASH = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "compress_ratios": [128, 128] + [4 if i % 2 == 0 else 128 for i in range(2, 43)],
    "max_position_embeddings": 1048576,
}


def per_token(spec, length: int) -> dict:
    paged = spec.bytes_per_page(PAGE, BF16) * math.ceil(length / PAGE)
    slot = spec.bytes_per_slot(BF16)
    return {"paged": paged / length, "slot": slot / length, "total": (paged + slot) / length}


def main() -> None:
    specs = {"DeepSeek-V4-Flash": v4_cache_spec(DeepseekV4Config.from_dict(V4_FLASH), 0),
             "DeepSeek-V4.1-Flash": v41_cache_spec(DeepseekV41Config.from_dict(text_only()), 0)}
    rows = {name: {str(n): per_token(spec, n) for n in LENGTHS} for name, spec in specs.items()}
    print(f"{'model':22s} " + " ".join(f"{n:>12d}" for n in LENGTHS) + "   (bytes per token, bf16 cache)")
    for name, r in rows.items():
        print(f"{name:22s} " + " ".join(f"{r[str(n)]['total']:12.0f}" for n in LENGTHS))
    ratio = {str(n): rows["DeepSeek-V4.1-Flash"][str(n)]["total"] / rows["DeepSeek-V4-Flash"][str(n)]["total"]
             for n in LENGTHS}
    print(f"{'V4.1 / V4':22s} " + " ".join(f"{ratio[str(n)]:12.3f}" for n in LENGTHS))
    out = os.path.join(os.path.dirname(__file__), "results", "v41_cache_bytes.json")
    with open(out, "w") as f:
        json.dump({"page_tokens": PAGE, "element_bytes": BF16, "bytes_per_token": rows, "v41_over_v4": ratio,
                   "pools": {name: {"paged_bytes_per_page": spec.bytes_per_page(PAGE, BF16),
                                    "slot_bytes": spec.bytes_per_slot(BF16)} for name, spec in specs.items()}},
                  f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
