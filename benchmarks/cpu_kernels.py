"""The cpu backend's fused C++ kernels vs the reference ops they replace, same inputs, one run:
microseconds per call at decode shapes of the largest test model (32 tokens, hidden 64, 4 streams)
and the relative difference of the outputs. Prints a table.

    python benchmarks/cpu_kernels.py [--tokens 32] [--candidates 256]
    python benchmarks/cpu_kernels.py --crossover   # the small-batch kernels vs GEMMs over batch sizes
    python benchmarks/cpu_kernels.py --invariant-linear   # batch-invariant mode's linear: GEMV vs padded GEMM
    python benchmarks/cpu_kernels.py --linear-crossover   # the linear kernel vs MKL at real shapes, GF/s

As an AVX2 CPU without AVX-512 (most laptops) runs them, on a machine with AVX-512: the kernels built for
AVX2 (their register tiles 256 bits wide) against MKL and torch held to AVX2 as well:

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/cpu_kernels.py --linear-crossover --threads 1,2 --json benchmarks/results/cpu_linear_crossover_avx2.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from deepinfer.backends import reference as ops
from deepinfer.backends.cpu import kernels


def _time(fn, args, reps: int) -> float:
    for _ in range(5):
        fn(*args)
    start = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - start) / reps * 1e6


def _rel(a, b) -> float:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30)).item()
               for x, y in zip(a, b))


def cases(t: int, m: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    n, d, e = 4, 64, 8
    streams, fn, base, scale = rn(t, n, d), rn((2 + n) * n, n * d) * 0.05, rn((2 + n) * n), torch.rand(3, generator=g)
    _, post, comb = ops.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20)
    idx = torch.randint(0, 1000, (t, 40), generator=g)
    cand = torch.randint(0, 1000, (t, m), generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    return {
        "hc_pre": (streams, fn, base, scale, 1e-6, 1e-6, 20),
        "hc_post": (rn(t, d), streams, post, comb),
        "rms_norm": (rn(t, 200)[:, 10:74], rn(d), 1e-6),
        "rope": (rn(t, 4, 32), rn(t, 4), rn(t, 4), False),
        "sparse_attention": (rn(t, 4, 32), rn(1000, 32), idx, rn(4), 0.18),
        "indexer_topk": (rn(t, 16, 16), rn(t, 16), rn(1000, 16), cand, 8, 0.25),
        "moe_experts": (rn(t, d), torch.rand(t, 2, generator=g), ids, rn(e, 64, d) * 0.2, rn(e, d, 32) * 0.2, 7.0),
        "grouped_linear": (rn(t, 2, 64), rn(2 * 16, 64)),
        "route_topk": (rn(t, d), rn(e, d), rn(e), 2, 1.5),
        "route_hash": (rn(t, d), rn(e, d), ids, 1.5),
        "swiglu_mlp": (rn(t, d), rn(64, d) * 0.2, rn(d, 32) * 0.2, 7.0),
        # a CSA layer's kv compressor: the t // 4 windows (rate 4) that t decode tokens finish
        "compress_entries": (rn(1000, 4 * 32), torch.randint(0, 1000, (max(t // 4, 1), 8), generator=g), rn(4, 64),
                             True, rn(32), 1e-6, rn(max(t // 4, 1), 4), rn(max(t // 4, 1), 4)),
    }


# (hidden, experts, intermediate, top-k, output group width) of the test model, the shipped model
# and a 512-hidden model with 64 experts
CROSSOVER_SHAPES = {"test model": (64, 8, 32, 2, 64), "shipped": (256, 8, 256, 2, 128),
                    "512 hidden, 64 experts": (512, 64, 256, 6, 512), "v3 bench": (512, 16, 256, 2, 64)}


def isa() -> dict:
    """What the kernels and MKL were built / told to use: torch's capability (the kernels' -march follows
    it, kernels._FLAGS) and the settings that turn AVX-512 off for a run that stands in for an AVX2 CPU."""
    return {"torch_capability": kernels._CAPABILITY, "kernel_flags": kernels._FLAGS, "register_tiles": kernels._TILES,
            **{k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
               if k in os.environ}}


def crossover(reps: int, shapes: list[str] | None = None) -> list[dict]:
    """The projection kernels (GEMVs) against the reference GEMMs over batch sizes: where the
    limits in kernels.py (_GEMV_MAX_MACS, _MLP_MAX_TOKENS, _ROUTER_MAX_MACS, _MOE_MAX_MACS_PER_EXPERT) come from.
    The raw kernels are timed, whatever those limits would pick; '*' marks what kernels.py picks."""
    rows = []
    g = torch.Generator().manual_seed(0)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    k_ops = torch.ops.deepinfer_cpu
    for label, (d, e, inter, k, gk) in CROSSOVER_SHAPES.items():
        if shapes and label not in shapes:
            continue
        print(f"\n{label}: hidden {d}, {e} experts x {inter}, top-{k}; us per call, fused / reference")
        print("| tokens | moe_experts | swiglu_mlp | grouped_linear | route_topk |")
        print("|---|---|---|---|---|")
        gu, dn, sgu, sdn = rn(e, 2 * inter, d), rn(e, d, inter), rn(2 * inter, d), rn(d, inter)
        wg, gate, bias = rn(2 * 16, gk), rn(e, d), rn(e)
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            x, xg = rn(t, d), rn(t, 2, gk)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            w = torch.rand(t, k, generator=g)
            cells = []
            for name, args in (("moe_experts", (x, w, ids, gu, dn, 7.0)), ("swiglu_mlp", (x, sgu, sdn, 7.0)),
                               ("grouped_linear", (xg, wg)), ("route_topk", (x, gate, bias, k, 1.5))):
                fused, ref = _time(getattr(k_ops, name), args, reps), _time(getattr(ops, name), args, reps)
                mark = _picks_kernel(name, args)
                rows.append({"threads": torch.get_num_threads(), "shape": label, "tokens": t, "op": name,
                             "kernel_us": fused, "reference_us": ref, "kernel_picked": mark})
                cells.append(f"{fused:.1f}{'*' if mark else ''} / {ref:.1f}{'' if mark else '*'}")
            print(f"| {t} | " + " | ".join(cells) + " |")
    return rows

# (N, K) of plain float32 linears: the LM heads of DeepSeek's vocabulary at hidden 256 and of the
# v3 bench model (8,192 x 512), and that model's projections (hidden 512, q_lora 384, kv_lora 128,
# 8 heads of 64 + 32: q_a, q_b, kv_a, o_proj)
LINEAR_SHAPES = {"LM head 129280 x 256": (129280, 256), "LM head 8192 x 512": (8192, 512),
                 "q_a 384 x 512": (384, 512), "q_b 768 x 384": (768, 384), "kv_a 160 x 512": (160, 512),
                 "o_proj 512 x 512": (512, 512)}


def _best(fn, args, reps: int) -> float:
    """Seconds of the fastest of `reps` calls (after 2 warm-up calls): the least disturbed by the
    other work on a shared machine."""
    for _ in range(2):
        fn(*args)
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def linear_crossover(threads: list[int], json_path: str) -> None:
    """The linear kernel (GEMV for one token, register tiles of token pairs x weight rows beyond)
    against MKL (torch's F.linear, the reference) at real shapes, per thread count: GF/s of each, their
    ratio, and the kernel's share of MKL's large-GEMM rate (1024^3, the most this machine gives a
    float32 GEMM here). '*' marks what kernels.linear picks (_LINEAR_MAX_TOKENS)."""
    g = torch.Generator().manual_seed(0)
    k_op = torch.ops.deepinfer_cpu.linear
    rows = []
    load = os.getloadavg()
    print(f"load average {load[0]:.2f}; fastest of several calls")
    for nt in threads:
        torch.set_num_threads(nt)
        a, b = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
        peak = 2 * 1024 ** 3 / _best(ops.linear, (a, b), 10) / 1e9
        print(f"\n{nt} thread(s): MKL 1024^3 GEMM {peak:.0f} GF/s")
        print("| shape (N x K) | tokens | kernel us | MKL us | kernel GF/s | MKL GF/s | kernel / MKL speed | kernel / MKL peak |")
        print("|---|---|---|---|---|---|---|---|")
        for label, (n, k) in LINEAR_SHAPES.items():
            w = torch.randn(n, k, generator=g)
            for t in (1, 2, 4, 8, 16, 32, 64):
                x = torch.randn(t, k, generator=g)
                reps = max(5, min(200, int(2e8 / (t * n * k))))
                kern, mkl = _best(k_op, (x, w), reps), _best(ops.linear, (x, w), reps)
                flops = 2 * t * n * k
                picks = _picks_kernel("linear", (x, w))
                print(f"| {label} | {t} | {kern * 1e6:.1f}{'*' if picks else ''} | {mkl * 1e6:.1f}{'' if picks else '*'} | "
                      f"{flops / kern / 1e9:.1f} | {flops / mkl / 1e9:.1f} | {mkl / kern:.2f}x | {flops / kern / 1e9 / peak:.0%} |")
                rows.append({"threads": nt, "shape": label, "n": n, "k": k, "tokens": t, "kernel_us": kern * 1e6,
                             "mkl_us": mkl * 1e6, "kernel_gflops": flops / kern / 1e9, "mkl_gflops": flops / mkl / 1e9,
                             "mkl_peak_gflops": peak, "kernel_picked": picks})
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump({"load_average": load, "threads": threads, "timing": "fastest of several calls", **isa(),
                   "rows": rows}, f, indent=2)


def invariant_linear(reps: int) -> None:
    """Batch-invariant mode's linear on the kernels (the GEMV at every size) against invariant.py's
    row-padded fixed-block GEMM, with plain MKL (not batch-invariant) for scale: us per call."""
    from deepinfer.backends.cpu import invariant

    g = torch.Generator().manual_seed(0)
    print("| K x N | rows | GEMV kernel | invariant.py GEMM | MKL |")
    print("|---|---|---|---|---|")
    for k, n in ((64, 512), (128, 512), (256, 600), (256, 8192)):
        w = torch.randn(n, k, generator=g)
        for t in (1, 4, 16, 64, 256):
            x = torch.randn(t, k, generator=g)
            r = max(reps // t, 5)
            cells = [_time(f, (x, w), r) for f in (torch.ops.deepinfer_cpu.linear, invariant.linear, ops.linear)]
            print(f"| {k} x {n} | {t} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def _picks_kernel(name: str, args) -> bool:
    """Whether kernels.py sends these inputs to the fused kernel (its limits), not the reference."""
    picked = []
    getattr(kernels, name)(*args, reference=lambda *a: picked.append(False))
    return not picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=256, help="indexer candidates per token")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--crossover", action="store_true", help="projection kernels vs GEMMs over batch sizes")
    parser.add_argument("--invariant-linear", action="store_true", help="batch-invariant linear: GEMV vs padded GEMM")
    parser.add_argument("--linear-crossover", action="store_true", help="linear kernel vs MKL at real shapes, GF/s")
    parser.add_argument("--shape", action="append", choices=list(CROSSOVER_SHAPES),
                        help="--crossover: only this shape (repeatable; default: all)")
    parser.add_argument("--threads", default="1", help="intra-op threads, e.g. 1,2 (--crossover, --linear-crossover)")
    parser.add_argument("--json", default=None, help="where the table goes (default: benchmarks/results/cpu_kernels.json, "
                        "cpu_linear_crossover.json for --linear-crossover, cpu_crossover.json for --crossover)")
    args = parser.parse_args()
    if not kernels.load():
        raise SystemExit("the cpu kernels did not build (see the warning)")
    threads = [int(n) for n in args.threads.split(",")]
    if args.linear_crossover:
        return linear_crossover(threads, args.json or "benchmarks/results/cpu_linear_crossover.json")
    if args.crossover:
        rows, load = [], os.getloadavg()
        for n in threads:
            torch.set_num_threads(n)
            print(f"\n## {n} thread(s), load average {os.getloadavg()[0]:.2f}")
            rows += crossover(max(args.reps // 10, 10), args.shape)
        path = args.json or "benchmarks/results/cpu_crossover.json"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"load_average": load, "threads": threads, "timing": "mean of reps calls", **isa(), "rows": rows},
                      f, indent=2)
        return
    torch.set_num_threads(1)
    if args.invariant_linear:
        return invariant_linear(args.reps)
    load = os.getloadavg()  # other work on the cores inflates both columns: recorded with them
    print(f"{args.tokens} tokens, 1 thread, load average {load[0]:.2f}")
    print("| op | reference us | fused us | speedup | max rel diff |")
    print("|---|---|---|---|---|")
    rows = []
    for name, inputs in cases(args.tokens, args.candidates).items():
        ref_fn, fused_fn = getattr(ops, name), getattr(kernels, name)
        diff = ("same picks" if torch.equal(fused_fn(*inputs), ref_fn(*inputs)) else "picks differ") \
            if name == "indexer_topk" else f"{_rel(fused_fn(*inputs), ref_fn(*inputs)):.1e}"
        if name == "route_topk":  # topk(sorted=False): the reference's order is unspecified; compare sorted
            (fw, fi), (rw, ri) = fused_fn(*inputs), ref_fn(*inputs)
            fi, fo = fi.sort(-1)
            ri, ro = ri.sort(-1)
            diff = f"{_rel(fw.gather(1, fo), rw.gather(1, ro)):.1e}" if torch.equal(fi, ri) else "ids differ"
        ref_us, fused_us = _time(ref_fn, inputs, args.reps), _time(fused_fn, inputs, args.reps)
        print(f"| {name} | {ref_us:.1f} | {fused_us:.1f} | {ref_us / fused_us:.1f}x | {diff} |")
        rows.append(dict(op=name, reference_us=ref_us, fused_us=fused_us, speedup=ref_us / fused_us, max_rel_diff=diff))
    path = args.json or "benchmarks/results/cpu_kernels.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(tokens=args.tokens, candidates=args.candidates, reps=args.reps, threads=1, load_average=load,
                       rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
