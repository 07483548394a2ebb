"""The cpu backend on stored weights: quantized vs float32 decode, and the GEMV / widen-then-GEMM
crossover. Prints tables and writes benchmarks/results/quant_kernels.json.

    python benchmarks/quant_kernels.py                # decode at batch 1: tiny FP8/FP4 test configs
    python benchmarks/quant_kernels.py --crossover    # where widening + MKL beats the GEMV kernels
    python benchmarks/quant_kernels.py --fp8-qdq      # V4.1's FP8 activation quantization: kernel vs torch ops
    python benchmarks/quant_kernels.py --experts-crossover   # V4.1's routed experts: where the kernel widens

Decode: each tiny test config (tests/tiny_models.py) stored as V4-Flash stores it (FP4 experts,
FP8 dense projections, bf16 router / embedding / head: tests/quant_checks.py) against the same
weights dequantized to a float32 checkpoint, both served by the engine (LLMEngine) at batch 1; the
time of decode steps only. Both run as the engine runs them (decode steps replayed from their
recordings, core/graphs.py), and the float32 model also eagerly (DEEPINFER_ENFORCE_EAGER=1: the
Python graph op by op), which shows what the replay saves. The shipped model, stored in bf16, is
measured the same way against a float32 copy of itself at batch 1 and 32.

Crossover: quant_kernels.linear's GEMV kernels against its GEMM path (the weight widened one
cache-sized tile at a time, MKL's GEMM per tile), by rows per call (T), at V4-Flash shapes (bf16
LM-head rows, FP8 projection, FP4 expert); the peer is the GEMM path before tiles (8 MB row chunks
widened into memory, then one GEMM each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))


def crossover(repeats: int) -> dict:
    from deepinfer.backends.cpu import kernels
    from deepinfer.backends.cpu import quant_kernels as qk
    from deepinfer.backends.quant import quantize_fp4, quantize_fp8
    from deepinfer.core.speculative.planner import time_call  # median after a warm-up call, as the planner times

    kernels.load()
    gen = torch.Generator().manual_seed(0)
    shapes = {"bf16 [16384, 4096] (LM-head rows)": torch.randn(16384, 4096, generator=gen).bfloat16(),
              "fp8 [4096, 4096] 128x128": quantize_fp8(torch.randn(4096, 4096, generator=gen) * 0.02, ue8m0=True),
              "fp4 [4096, 2048] (expert down)": quantize_fp4(torch.randn(4096, 2048, generator=gen) * 0.02)}
    def chunked(x, w):  # the peer: the GEMM path before tiles, the weight widened in 8 MB row chunks
        args, (n, k) = qk.weight_args(w), w.shape
        step, out = max(1, (8 << 20) // (4 * k)), x.new_empty(x.shape[0], n)
        for start in range(0, n, step):
            out[:, start:start + step] = torch.nn.functional.linear(
                x, torch.ops.deepinfer_cpu.widen_rows(*args, start, min(n, start + step)))
        return out

    rows = {}
    print(f"{'weight':<34} {'T':>4} {'GEMV ms':>9} {'tiles+GEMM ms':>14} {'chunks+GEMM ms':>15}")
    for label, w in shapes.items():
        k = w.shape[-1]
        rows[label] = []
        for t in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(t, k, generator=gen)
            gemv = time_call(lambda: qk.linear(x, w, max_tokens=1 << 30), repeats)
            wide = time_call(lambda: qk.linear(x, w, max_tokens=0), repeats)
            chunks = time_call(lambda: chunked(x, w), repeats)
            rows[label].append({"tokens": t, "gemv_s": gemv, "widen_gemm_s": wide, "chunked_widen_gemm_s": chunks})
            print(f"{label:<34} {t:>4} {gemv * 1e3:>9.2f} {wide * 1e3:>14.2f} {chunks * 1e3:>15.2f}")
    return rows


def experts_crossover(repeats: int) -> list[dict]:
    """Routed experts on FP4 stacks by rows per expert, where the kernel's own switch
    (MOE_GEMM_FROM_ROWS) belongs: the kernel with every expert on the GEMV tiles against the kernel
    with every expert on widened tiles + MKL, for DeepSeek-V4's moe_experts (the shipped model's
    experts, 8 of 256 x 256) and DeepSeek-V4.1's moe_experts_bf16 (FP8 inputs per 32; tiny-dsv41's
    experts and four at V4.1-Flash's shape, hidden 5120, intermediate 2304), the latter also against
    the base class's composite (a loop over the experts in Python; its GEMMs the quantized linear's,
    GEMV up to 16 rows)."""
    import math

    from deepinfer.backends.base import Accelerator
    from deepinfer.backends.cpu import CpuKernelAccelerator, kernels
    from deepinfer.backends.quant import quantize_fp4
    from deepinfer.core.speculative.planner import time_call

    kernels.load()
    acc = CpuKernelAccelerator()
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'experts':<28} {'rows/expert':>11} {'GEMV tiles ms':>14} {'widened+MKL ms':>15} {'composite ms':>13}")
    for label, e, d, inter, per_expert in (("V4 moe_experts 8 x 256x256", 8, 256, 256, (4, 8, 16, 32, 64, 128)),
                                           ("tiny-dsv41 8 x 256x256", 8, 256, 256, (4, 8, 16, 32, 64, 128)),
                                           ("V4.1-Flash 4 x 5120x2304", 4, 5120, 2304, (4, 16, 32, 64))):
        v4 = label.startswith("V4 ")
        gu = quantize_fp4(torch.randn(e, 2 * inter, d, generator=gen) * 0.02)
        dn = quantize_fp4(torch.randn(e, d, inter, generator=gen) * 0.02)
        for n in per_expert:
            t = n * e // 2  # top-2, every expert the same load
            x = torch.randn(t, d, generator=gen)
            ids = torch.arange(2 * t).view(t, 2) % e
            w = torch.rand(t, 2, generator=gen)

            def kernel(gemm_from):
                if v4:
                    return lambda: kernels.moe_experts(x, w, ids, gu, dn, 10.0, reference=None,
                                                       max_qrows_per_expert=gemm_from)
                return lambda: kernels.moe_experts_bf16(x, w, ids, gu, dn, 10.0, 32, reference=None,
                                                        gemm_from_rows=gemm_from)
            reps = repeats if d < 1024 or n <= 16 else 2
            gemv = time_call(kernel(math.inf), reps)
            wide = time_call(kernel(0), reps)
            composite = None if v4 else \
                time_call(lambda: Accelerator.moe_experts_bf16(acc, x, w, ids, gu, dn, 10.0, 32), reps)
            rows.append({"experts": label, "rows_per_expert": n, "tokens": t, "gemv_tiles_s": gemv,
                         "widened_gemm_s": wide, "composite_s": composite})
            shown = "-" if composite is None else f"{composite * 1e3:.2f}"
            print(f"{label:<28} {n:>11} {gemv * 1e3:>14.2f} {wide * 1e3:>15.2f} {shown:>13}")
    return rows


def fp8_qdq_timing(repeats: int) -> list[dict]:
    """DeepSeek-V4.1's FP8 activation quantization (fp8_qdq, per 32): the cpu kernel (quant_ops.cpp)
    against the reference's torch ops, at the shapes a V4.1-Flash GEMM input has (hidden 4096, LoRA
    ranks 1024, expert intermediate 2048) at batch 1 and 32."""
    from deepinfer.backends import reference as ref
    from deepinfer.backends.cpu import kernels
    from deepinfer.core.speculative.planner import time_call

    kernels.load()
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'x':<14} {'kernel us':>10} {'torch ops us':>13} {'speed-up':>9}")
    for t in (1, 32):
        for k in (1024, 2048, 4096):
            x = torch.randn(t, k, generator=gen)
            assert torch.equal(kernels.fp8_qdq(x, 32), ref.fp8_qdq(x, 32))
            kernel = time_call(lambda: kernels.fp8_qdq(x, 32), repeats)
            torch_ops = time_call(lambda: ref.fp8_qdq(x, 32), repeats)
            rows.append({"shape": [t, k], "kernel_s": kernel, "reference_s": torch_ops})
            print(f"{str([t, k]):<14} {kernel * 1e6:>10.1f} {torch_ops * 1e6:>13.1f} {torch_ops / kernel:>8.1f}x")
    return rows


def _decode_rate(model_dir: str, steps: int, prompts: list[list[int]]) -> float:
    """Decode tokens/s of `prompts` as one batch (decode steps only; median of 3 runs)."""
    from deepinfer.backends import get_accelerator
    from deepinfer.core.engine import EngineConfig, LLMEngine
    from deepinfer.sampling_params import SamplingParams

    engine = LLMEngine(model_dir, get_accelerator("cpu"), EngineConfig(
        max_num_seqs=len(prompts), max_num_batched_tokens=max(256, sum(map(len, prompts))),
        num_cache_pages=4 * len(prompts)))
    rates = []
    for _ in range(3):
        reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
                for p in prompts]
        while any(not r.output_token_ids or r.pending for r in reqs):
            engine.step()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        rates.append(len(prompts) * steps / (time.perf_counter() - t0))
        engine.pop_finished()
    engine.close()
    return sorted(rates)[1]


def _graph_only(fn):
    """fn() with step graphs off: the Python graph runs op by op."""
    os.environ["DEEPINFER_ENFORCE_EAGER"] = "1"
    try:
        return fn()
    finally:
        del os.environ["DEEPINFER_ENFORCE_EAGER"]


def shipped(steps: int) -> list[dict]:
    """The shipped model (stored in bf16) as stored vs widened to a float32 copy, batch 1 and 32."""
    import shutil

    from safetensors.torch import load_file, save_file

    from deepinfer.llm import TINY_DSV4_DIR

    rows = []
    print(f"{'shipped model':<16} {'batch':>5} {'bf16 tok/s':>11} {'float32 tok/s':>14} {'float32, eager':>25}")
    with tempfile.TemporaryDirectory() as tmp:
        fdir = Path(tmp, "float32")
        shutil.copytree(TINY_DSV4_DIR, fdir)
        for f in fdir.glob("*.safetensors"):
            save_file({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(f)).items()}, str(f))
        gen = torch.Generator().manual_seed(2)
        for batch in (1, 32):
            prompts = [torch.randint(3, 1000, (64,), generator=gen).tolist() for _ in range(batch)]
            bf16 = _decode_rate(TINY_DSV4_DIR, steps, prompts)
            f32 = _decode_rate(str(fdir), steps, prompts)
            f32_graph = _graph_only(lambda: _decode_rate(str(fdir), steps, prompts))
            rows.append({"batch": batch, "bf16_tok_s": bf16, "float32_tok_s": f32, "float32_graph_tok_s": f32_graph})
            print(f"{'tiny-dsv4':<16} {batch:>5} {bf16:>11.1f} {f32:>14.1f} {f32_graph:>25.1f}")
    return rows


def decode(steps: int) -> list[dict]:
    from quant_checks import dequantized, flash_layout, save_upstream
    from safetensors.torch import save_file
    from tiny_models import CONFIGS, make_hf_model

    from deepinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
    from deepinfer.models.deepseek_v4.weights import checkpoint_source

    rows = []
    print(f"{'config':<16} {'stored tok/s':>12} {'float32 tok/s':>14} {'float32, eager':>25}")
    for name in CONFIGS:
        hf, hfc = make_hf_model(name, seed=0)
        cfg = DeepseekV4Config.from_dict(hfc.to_dict())
        stored = flash_layout(hf.state_dict(), DeepseekV4Model.checkpoint_tensors(cfg))
        with tempfile.TemporaryDirectory() as tmp:
            qdir, fdir = Path(tmp, "stored"), Path(tmp, "float32")
            for d in (qdir, fdir):
                d.mkdir()
                hfc.save_pretrained(d)
            save_upstream(stored, qdir, checkpoint_source)
            save_file({k: v.contiguous() for k, v in dequantized(stored).items()}, str(fdir / "model.safetensors"))
            prompt = [torch.randint(2, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()]
            quant = _decode_rate(str(qdir), steps, prompt)
            f32 = _decode_rate(str(fdir), steps, prompt)
            f32_graph = _graph_only(lambda: _decode_rate(str(fdir), steps, prompt))
        rows.append({"config": name, "stored_tok_s": quant, "float32_tok_s": f32, "float32_graph_tok_s": f32_graph,
                     "weight_bytes_stored": sum(v.nbytes for v in stored.values()),
                     "weight_bytes_float32": sum(v.nbytes for v in dequantized(stored).values())})
        print(f"{name:<16} {quant:>12.1f} {f32:>14.1f} {f32_graph:>25.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--fp8-qdq", action="store_true", help="time the FP8 activation quantization only")
    parser.add_argument("--experts-crossover", action="store_true",
                        help="V4.1's routed experts: GEMV tiles vs widened + MKL vs the composite, by rows per expert")
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "quant_kernels.json"))
    args = parser.parse_args()
    out_path = Path(args.out)
    data = json.loads(out_path.read_text()) if out_path.exists() else {}
    torch.set_num_threads(int(os.environ.get("DEEPINFER_CPU_THREADS", "0")) or torch.get_num_threads())
    if args.fp8_qdq:
        data["fp8_qdq"] = {"rows": fp8_qdq_timing(args.repeats), "threads": torch.get_num_threads(),
                           "load_average": os.getloadavg()}
    elif args.experts_crossover:
        data["experts_crossover"] = {"rows": experts_crossover(args.repeats), "threads": torch.get_num_threads(),
                                     "load_average": os.getloadavg()}
    elif args.crossover:
        data["crossover"] = {"rows": crossover(args.repeats), "threads": torch.get_num_threads(),
                             "load_average": os.getloadavg()}
    else:
        data["decode_batch1"] = {"rows": decode(args.steps), "load_average": os.getloadavg(),
                                 "cpus": os.cpu_count()}
        data["shipped"] = {"rows": shipped(args.steps), "load_average": os.getloadavg()}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(data, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
