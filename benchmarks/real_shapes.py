"""Real shapes: DeepSeek-V4-Flash's exact layer shapes and storage formats, served from a synthetic
checkpoint. Prints a table and writes benchmarks/results/real_shapes.json.

    python benchmarks/real_shapes.py                     # writes /tmp/deepinfer_real_shapes once (~9 GB)
    python benchmarks/real_shapes.py --model v41         # DeepSeek-V4.1-Flash instead (real_shapes_v41.py, ~12 GB)

The reported figures come from a run on an otherwise idle machine (the JSON records the load average).

The checkpoint is two consecutive decoder layers of V4-Flash in DeepSeek's upstream naming: layer
types as V4-Flash's layers 2 and 3 (a heavily compressed attention layer with hash-routed experts,
then a compressed sparse attention layer with the Lightning Indexer and score-routed experts), the
real 129,280-token vocabulary, embedding and head (bf16 [129280, 4096] each), hidden 4096, 64 heads
of 512, q/o LoRA ranks 1024, 256 routed experts of intermediate 2048 + 1 shared. Formats as the
release stores them: dense projections FP8 e4m3 with ue8m0 128x128 block scales, routed experts FP4
e2m1 (two a byte, int8 on disk) with ue8m0 scales per 32 inputs, the compressor / indexer kv, gate
and head weights, the router, the embedding and the head in bf16, mixing matrices and position
biases float32. Values are random (finite FP8 codes, every FP4 code, scales 2^-10..2^-6), so the
activations stay in range; the tokens mean nothing.

Measured in one run: load time, the process's resident memory (VmRSS) after loading, less the
cache pool and the tokenizer, and once the decode steps have touched every weight (whole tensors
stay memory-mapped from the files as safetensors returns them, expert stacks are assembled in
anonymous memory from slices read, not mapped), beside the weights' bytes memory_report() counts,
each against the files' bytes; decode tokens/s at batch 1 and 32 (the time of decode steps only,
after every prompt is prefilled), and the memory-bandwidth roofline for the bytes those steps read:
every weight but the embedding (one row per token) and the routed experts, plus the routed experts
each step hit (counted from the routing ids), divided into the copy bandwidth measured in the same
run (a 1 GiB tensor copy: bytes read + written per second). Figures to report come from an
otherwise idle machine: the JSON records the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

HC = 4
LAYERS = [("heavily_compressed_attention", "hash_moe", 128), ("compressed_sparse_attention", "moe", 4)]
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The slice's widths: V4-Flash's (reference/DEEPSEEK_V4.md, transformers' DeepseekV4Config
    defaults) unless a test writes a smaller slice in the same formats."""

    hidden: int = 4096
    heads: int = 64
    head_dim: int = 512
    q_rank: int = 1024
    o_groups: int = 8
    o_rank: int = 1024
    experts: int = 256
    top_k: int = 6
    inter: int = 2048
    vocab: int = 129280
    index_heads: int = 64
    index_dim: int = 128
    # routed experts per file (64: ~800 MB); 0 puts them in their layer's file with its other
    # tensors, as a checkpoint sharded by size (Hugging Face's save_pretrained) often has them
    experts_per_shard: int = 64


FLASH = Shapes()


def _config(s: Shapes) -> dict:
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(num_hidden_layers=len(LAYERS), layer_types=[k for k, _, _ in LAYERS],
                           mlp_layer_types=[m for _, m, _ in LAYERS], num_nextn_predict_layers=0,
                           max_position_embeddings=65536, hidden_size=s.hidden, num_attention_heads=s.heads,
                           head_dim=s.head_dim, q_lora_rank=s.q_rank, o_groups=s.o_groups, o_lora_rank=s.o_rank,
                           n_routed_experts=s.experts, num_experts_per_tok=s.top_k,
                           moe_intermediate_size=s.inter, vocab_size=s.vocab, index_n_heads=s.index_heads,
                           index_head_dim=s.index_dim).to_dict()
    cfg.update(architectures=["DeepseekV4ForCausalLM"], torch_dtype="bfloat16",
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "weight_block_size": [BLOCK, BLOCK]})
    return cfg


class Writer:
    """Random tensors in V4-Flash's formats, one safetensors file per shard, bytes counted by kind."""

    def __init__(self, gen: torch.Generator, block: int = BLOCK):
        self.gen, self.tensors, self.bytes, self.block = gen, {}, {}, block

    def _count(self, kind: str, *ts: torch.Tensor) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + sum(t.numel() * t.element_size() for t in ts)

    def _scales(self, *shape: int) -> torch.Tensor:  # ue8m0 exponents of 2^-10 .. 2^-6
        return torch.randint(117, 122, shape, dtype=torch.uint8, generator=self.gen).view(torch.float8_e8m0fnu)

    def fp8(self, name: str, n: int, k: int) -> None:
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=self.gen)
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        b = self.block
        scale = self._scales(-(-n // b), -(-k // b))
        self.tensors[name + ".weight"], self.tensors[name + ".scale"] = codes.view(torch.float8_e4m3fn), scale
        self._count(f"fp8_e4m3 {b}x{b} (ue8m0 scales)", codes, scale)

    def fp4(self, name: str, n: int, k: int) -> None:
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=self.gen)
        scale = self._scales(n, k // 32)
        self.tensors[name + ".weight"], self.tensors[name + ".scale"] = packed.view(torch.int8), scale
        self._count("fp4_e2m1 1x32 (ue8m0 scales)", packed, scale)

    def bf16(self, name: str, *shape: int, std: float = 0.02) -> None:
        t = (torch.randn(shape, generator=self.gen) * std).bfloat16()
        self.tensors[name] = t
        self._count("bfloat16", t)

    def f32(self, name: str, *shape: int, std: float = 0.02, mean: float = 0.0) -> None:
        t = torch.randn(shape, generator=self.gen) * std + mean
        self.tensors[name] = t
        self._count("float32", t)

    def block_entry(self, p: str, d: int, hc: int, q_rank: int, heads: int, head_dim: int, o_groups: int,
                    o_rank: int) -> None:
        """What every V4 / V4.1 block stores alike under prefix `p`: its norms, hyper-connection mixes
        and the attention's projections (FP8) and sink."""
        mix = (2 + hc) * hc
        self.f32(p + "attn_norm.weight", d, std=0.0, mean=1.0)
        self.f32(p + "ffn_norm.weight", d, std=0.0, mean=1.0)
        for sub in ("hc_attn_", "hc_ffn_"):
            self.f32(p + sub + "fn", mix, hc * d)
            self.f32(p + sub + "base", mix, std=0.2)
            self.f32(p + sub + "scale", 3, std=0.0, mean=1.0)
        a = p + "attn."
        self.fp8(a + "wq_a", q_rank, d)
        self.f32(a + "q_norm.weight", q_rank, std=0.0, mean=1.0)
        self.fp8(a + "wq_b", heads * head_dim, q_rank)
        self.fp8(a + "wkv", head_dim, d)
        self.f32(a + "kv_norm.weight", head_dim, std=0.0, mean=1.0)
        self.fp8(a + "wo_a", o_groups * o_rank, heads * head_dim // o_groups)
        self.fp8(a + "wo_b", d, o_groups * o_rank)
        self.f32(a + "attn_sink", heads, std=0.5)

    def ffn_experts(self, f: str, dense: Path, experts_shard: str, experts: int, inter: int, d: int,
                    per_shard: int) -> None:
        """The shared expert (FP8) under `f`, flushed with the layer's dense tensors to `dense`, then
        the routed experts (FP4), `per_shard` per file (`experts_shard` formats the shard number; 0:
        in `dense` too)."""
        for w, n, k in (("w1", inter, d), ("w3", inter, d), ("w2", d, inter)):
            self.fp8(f + "shared_experts." + w, n, k)
        if per_shard:
            self.flush(dense)
        for j in range(experts):
            for w, n, k in (("w1", inter, d), ("w3", inter, d), ("w2", d, inter)):
                self.fp4(f + f"experts.{j}.{w}", n, k)
            if per_shard and (j % per_shard == per_shard - 1 or j == experts - 1):
                self.flush(dense.with_name(experts_shard.format(j // per_shard)))
        if not per_shard:
            self.flush(dense)

    def flush(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.tensors, str(path))
        self.tensors = {}


def write_checkpoint(out: Path, s: Shapes = FLASH) -> dict:
    """The synthetic checkpoint (module doc) in `out`, at the widths `s`; returns bytes by kind."""
    out.mkdir(parents=True, exist_ok=True)
    w = Writer(torch.Generator().manual_seed(0))
    d = s.hidden
    w.bf16("embed.weight", s.vocab, d)
    w.bf16("head.weight", s.vocab, d)
    w.f32("norm.weight", d, std=0.0, mean=1.0)
    w.f32("hc_head_fn", HC, HC * d)
    w.f32("hc_head_base", HC)
    w.f32("hc_head_scale", 1, std=0.0, mean=1.0)
    w.flush(out / "model-embed-head.safetensors")
    for i, (kind, mlp, rate) in enumerate(LAYERS):
        p = f"layers.{i}."
        w.block_entry(p, d, HC, s.q_rank, s.heads, s.head_dim, s.o_groups, s.o_rank)
        a = p + "attn."
        width = 2 * s.head_dim if kind == "compressed_sparse_attention" else s.head_dim
        w.f32(a + "compressor.ape", rate, width, std=0.5)
        w.bf16(a + "compressor.wkv.weight", width, d)
        w.bf16(a + "compressor.wgate.weight", width, d)
        w.f32(a + "compressor.norm.weight", s.head_dim, std=0.0, mean=1.0)
        if kind == "compressed_sparse_attention":
            x = a + "indexer."
            w.fp8(x + "wq_b", s.index_heads * s.index_dim, s.q_rank)
            w.bf16(x + "weights_proj.weight", s.index_heads, d)
            w.f32(x + "compressor.ape", rate, 2 * s.index_dim, std=0.5)
            w.bf16(x + "compressor.wkv.weight", 2 * s.index_dim, d)
            w.bf16(x + "compressor.wgate.weight", 2 * s.index_dim, d)
            w.f32(x + "compressor.norm.weight", s.index_dim, std=0.0, mean=1.0)
        f = p + "ffn."
        w.bf16(f + "gate.weight", s.experts, d)
        if mlp == "hash_moe":
            table = torch.stack([torch.randperm(s.experts, generator=w.gen)[:s.top_k] for _ in range(s.vocab)]).int()
            w.tensors[f + "gate.tid2eid"] = table
            w._count("int32", table)
        else:
            w.f32(f + "gate.bias", s.experts, std=0.1)
        layer_file = f"model-layer{i}-dense.safetensors" if s.experts_per_shard else f"model-layer{i}.safetensors"
        w.ffn_experts(f, out / layer_file, f"model-layer{i}-experts{{}}.safetensors", s.experts, s.inter, d,
                      per_shard=s.experts_per_shard)
    (out / "config.json").write_text(json.dumps(_config(s), indent=2))
    (out / "WRITTEN").write_text(json.dumps(w.bytes))
    return w.bytes


def copy_bandwidth(gib: float = 1.0, repeats: int = 10) -> float:
    """Bytes read + written per second by a `gib` GiB tensor copy: the best of `repeats` (the
    limit a step's reads are held to; on a shared machine the median moved 13-21 GB/s run to run)."""
    n = int(gib * (1 << 30)) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / min(times)


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def expert_bytes(w) -> int:
    """Bytes of one expert of a stack (data + scales)."""
    return (w.data[0].numel() * w.data.element_size() + w.scale[0].numel() * w.scale.element_size()) \
        if hasattr(w, "scale") else w[0].numel() * w.element_size()


SLICES = {  # per --model: default dir, JSON, the weights' names, MoE layers, how routed experts are counted
    "v4": {"dir": "/tmp/deepinfer_real_shapes", "out": "real_shapes.json", "experts": ".mlp.experts.",
           "embed": "model.embed_tokens.weight", "layer0": "model.layers.0.", "moe_layers": len(LAYERS),
           "title": "V4-Flash"},
    "v41": {"dir": "/tmp/deepinfer_real_shapes_v41", "out": "real_shapes_v41.json", "experts": ".ffn.experts.",
            "embed": "embed.weight", "layer0": "layers.0.", "moe_layers": 2, "title": "V4.1-Flash"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SLICES), default="v4",
                        help="v4: the V4-Flash slice (module doc); v41: the V4.1-Flash slice (real_shapes_v41.py)")
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (v4 ~9 GB, v41 ~12 GB)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    parser.add_argument("--warmup", type=int, default=16, help="decode steps before timing (step graphs record)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    parser.add_argument("--engram-rows", type=int, default=16 << 20,
                        help="v41: rows of the Engram table written (released: 384,006,168)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sl = SLICES[args.model]
    v41 = args.model == "v41"
    out_path = args.out or str(HERE / "results" / sl["out"])

    from deepinfer.backends.cpu import CpuKernelAccelerator, kernels
    from deepinfer.core.engine import EngineConfig, LLMEngine
    from deepinfer.core.tokenizer import Tokenizer
    from deepinfer.sampling_params import SamplingParams

    ckpt = Path(args.dir or sl["dir"])
    t0 = time.perf_counter()
    if (ckpt / "WRITTEN").exists():
        written = json.loads((ckpt / "WRITTEN").read_text())
    elif v41:
        import real_shapes_v41

        written = real_shapes_v41.write_checkpoint(ckpt, args.engram_rows, Writer)
    else:
        written = write_checkpoint(ckpt)
    write_s = time.perf_counter() - t0
    facts = {}
    if v41:
        import real_shapes_v41

        facts = real_shapes_v41.slice_facts(written["engram_rows"])
        written = written["bytes"]
    table_file = ckpt / "model-engram-table.safetensors"
    table_bytes = table_file.stat().st_size if v41 else 0
    file_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert kernels.load(), "the cpu kernels must build"
    bandwidth = copy_bandwidth()

    class Counting(CpuKernelAccelerator):
        """The cpu kernels, counting the distinct experts each MoE layer reads (the roofline's bytes):
        V4 in its moe_experts op, V4.1 (whose routed experts run per expert hit) at its router."""

        hits: list[int] = []

        def moe_experts(self, x, weights, ids, gate_up, down, limit):
            if not v41:
                Counting.hits.append(int(ids.unique().numel()))
            return super().moe_experts(x, weights, ids, gate_up, down, limit)

        def route_topk(self, x, gate, bias, top_k, scaling):
            weights, ids = super().route_topk(x, gate, bias, top_k, scaling)
            if v41:
                Counting.hits.append(int(ids.unique().numel()))
            return weights, ids

    accel = Counting()
    if v41:
        real_shapes_v41.evict(table_file)
    # what a tokenizer holds, measured on one kept alive beside the engine's own (subtracted from
    # the RSS after load: it is not weights)
    rss_tok = rss()
    tokenizer = Tokenizer(ckpt) if (ckpt / "tokenizer.json").exists() else None
    tokenizer_bytes = rss() - rss_tok
    rss0 = rss()
    t0 = time.perf_counter()
    engine = LLMEngine(str(ckpt), accel, EngineConfig(max_num_seqs=max(args.batches), max_model_len=256,
                                                      max_num_batched_tokens=max(args.batches) * args.prompt))
    load_s = time.perf_counter() - t0
    print(f"loaded in {load_s:.1f} s", flush=True)
    rss_loaded = rss()
    del tokenizer
    table_loaded = real_shapes_v41.engram_resident(table_file) if v41 else 0
    report = engine.memory
    # the weights' share of the RSS after load: less the cache pool, the tokenizer and the Engram
    # table's resident pages, against the files but the table's (memory-mapped, not read)
    rss_weights = rss_loaded - rss0 - report.cache["total"] - tokenizer_bytes - table_loaded
    rss_weights_over_file = rss_weights / (file_bytes - table_bytes)
    w = engine.model.w
    experts = {k: v for k, v in w.items() if sl["experts"] in k}
    # one expert of one layer: its gate_up and down slices (every layer's experts are alike)
    per_expert = sum(expert_bytes(v) for k, v in experts.items() if k.startswith(sl["layer0"]))
    dense = sum((v.nbytes if hasattr(v, "scale") else v.numel() * v.element_size())
                for k, v in w.items() if sl["experts"] not in k and k != sl["embed"])
    # V4.1: each token reads 3 x 8 Engram rows (256 FP8 values + 8 scales each)
    engram_per_token = 24 * facts["engram_row_bytes"] if v41 else 0

    results = []
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 1, ignore_eos=True)
    moe_layers = sl["moe_layers"]
    vocab = engine.model_config.vocab_size
    for batch in args.batches:
        prompts = [torch.randint(3, vocab, (args.prompt,), generator=gen).tolist() for _ in range(batch)]
        reqs = [engine.add_request(p, params) for p in prompts]
        Counting.hits.clear()
        # prefill, then warm-up decode steps: the engine records each step bucket (eagerly, so the
        # Counting override sees their routing) before it replays it from C++, where no Python runs
        while any(len(r.output_token_ids) <= args.warmup or r.pending for r in reqs):
            engine.step()
        print(f"batch {batch}: prefilled and warmed up", flush=True)
        eager_steps = len(Counting.hits) / moe_layers - 1  # the prefill step's calls included
        hit_per_step = (sum(Counting.hits) - sum(Counting.hits[:moe_layers])) / max(eager_steps, 1)
        done = sum(len(r.output_token_ids) for r in reqs)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        decode_s = time.perf_counter() - t
        steps = (sum(len(r.output_token_ids) for r in reqs) - done) // batch  # multi-step calls run several
        engine.pop_finished()
        # distinct experts read per step, summed over layers
        step_bytes = dense + hit_per_step * per_expert + batch * engram_per_token
        tok_s = batch * steps / decode_s
        roofline = batch * bandwidth / step_bytes
        results.append({"batch": batch, "decode_steps": steps, "decode_seconds": decode_s, "tokens_per_s": tok_s,
                        "experts_read_per_step": hit_per_step, "bytes_read_per_step": step_bytes,
                        "roofline_tokens_per_s": roofline, "fraction_of_roofline": tok_s / roofline,
                        "achieved_GBps": step_bytes * steps / decode_s / 1e9})

    rss_served = rss()
    table_served = real_shapes_v41.engram_resident(table_file) if v41 else 0
    load_avg = os.getloadavg()
    out = {
        "model": sl["title"], **({"slice": facts} if facts else {}),
        "checkpoint": {"dir": str(ckpt), "file_bytes": file_bytes, "written_bytes_by_kind": written,
                       "write_seconds": write_s},
        "load_seconds": load_s,
        "resident": {"rss_before": rss0, "rss_after_load": rss_loaded, "rss_after_decode": rss_served,
                     "rss_growth": rss_served - rss0, "rss_growth_over_file": (rss_served - rss0) / file_bytes,
                     "weight_bytes": report.weight_bytes, "weights_by_kind": report.weights,
                     "weights_over_file": report.weight_bytes / file_bytes, "cache_bytes": report.cache["total"],
                     "tokenizer_bytes": tokenizer_bytes, "rss_weights_after_load": rss_weights,
                     "rss_weights_after_load_over_file": rss_weights_over_file},
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "dense_bytes_per_step": dense, "bytes_per_expert": per_expert,
        "decode": results,
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "load_average": load_avg},
    }
    if v41:  # the Engram table apart: its file against the pages of it this process has resident
        rest = file_bytes - table_bytes
        out["resident"].update(
            engram_table_file_bytes=table_bytes, engram_table_resident_after_load=table_loaded,
            engram_table_resident_after_decode=table_served,
            engram_table_resident_fraction=table_served / table_bytes,
            other_file_bytes=rest, rss_growth_without_table=rss_served - rss0 - table_served,
            rss_growth_without_table_over_other_files=(rss_served - rss0 - table_served) / rest,
            engram_bytes_per_token=engram_per_token)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(out, indent=2))

    gb = 1e9
    print(f"\n{sl['title']} real shapes, 2 layers, cpu backend ({torch.get_num_threads()} threads, "
          f"load average {load_avg[0]:.2f})")
    print(f"checkpoint            {file_bytes / gb:.2f} GB on disk ({', '.join(f'{k}: {v / gb:.2f}' for k, v in written.items())})")
    print(f"load                  {load_s:.1f} s")
    print(f"weights in memory     {report.weight_bytes / gb:.2f} GB = {report.weight_bytes / file_bytes:.3f}x the files; "
          f"process RSS grew {(rss_served - rss0) / gb:.2f} GB = {(rss_served - rss0) / file_bytes:.3f}x once served "
          f"({(rss_loaded - rss0) / gb:.2f} GB after loading)")
    print(f"resident after load   {rss_weights / gb:.2f} GB = {rss_weights_over_file:.3f}x the files"
          f"{' but the Engram table' if v41 else ''} (RSS less the cache pool"
          f"{', the tokenizer and the table pages' if v41 else ' and the tokenizer'})")
    if v41:
        r = out["resident"]
        print(f"Engram table          {table_bytes / gb:.2f} GB file ({facts['engram_rows']:,} rows = "
              f"{facts['engram_rows_fraction_of_released']:.1%} of the released), memory-mapped: "
              f"{table_loaded / 1e6:.1f} MB resident after load, {table_served / 1e6:.1f} MB after decoding; "
              f"the rest: RSS grew {r['rss_growth_without_table'] / gb:.2f} GB for "
              f"{r['other_file_bytes'] / gb:.2f} GB of files")
        print(f"experts               {facts['experts_per_layer']} of the released "
              f"{facts['released_experts_per_layer']} per layer (each at its released shape)")
    print(f"copy bandwidth        {bandwidth / gb:.1f} GB/s (read + write)")
    print(f"{'batch':>5} {'tok/s':>8} {'experts/step':>13} {'GB/step':>8} {'GB/s':>6} {'roofline tok/s':>15} {'of roofline':>12}")
    for r in results:
        print(f"{r['batch']:>5} {r['tokens_per_s']:>8.2f} {r['experts_read_per_step']:>13.1f} "
              f"{r['bytes_read_per_step'] / gb:>8.3f} {r['achieved_GBps']:>6.2f} {r['roofline_tokens_per_s']:>15.2f} "
              f"{r['fraction_of_roofline']:>11.1%}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
