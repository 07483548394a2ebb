"""The nvidia backend's kernels, op by op: checked against the cpu reference, then timed.

Each row prints the max relative error (max |nvidia - cpu| / max |cpu|; for tokens, the fraction
that differ) next to the op's stated tolerance and a FAIL column; on a GPU also the median of
--reps CUDA-event timings (L2 flushed before each), and the achieved GB/s and TFLOP/s (bytes and
flops counted from the shapes: compulsory traffic, fp32 storage, fp8 weights at 1 byte) against
this device's ceilings, measured first (a 1 GiB copy; an 8192^3 bf16 matmul).

On a GPU the shapes are DeepSeek-V4-Flash's (32 of the 256 experts are allocated: only hit
experts cost time); about a minute on an H200 (its run: benchmarks/results/gpu_kernels_h200.json). Without a GPU it
is a smoke run: tiny shapes through the Triton interpreter, times not meaningful. Exits 1 if any
row FAILs; never asserts on time.

    python benchmarks/gpu_kernels.py [--tokens 64] [--prefill 2048] [--reps 50] [--out gpu_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deepinfer.backends import get_accelerator  # noqa: E402
from deepinfer.backends import reference as ref  # noqa: E402
from deepinfer.backends.nvidia import cuda_ext  # noqa: E402
from deepinfer.backends.quant import FP8, ActQuant, QuantizedWeight  # noqa: E402
from deepinfer.backends.triton import attention  # noqa: E402
from deepinfer.backends.triton.fp8 import FP8_DOT_TOL  # noqa: E402


@dataclass(slots=True)
class Case:
    name: str
    fn: object  # the nvidia kernel
    ref: object  # the cpu reference
    args: tuple  # on the nvidia device
    tol: float
    bytes: float
    flops: float


def _shapes(gpu: bool) -> dict:
    if gpu:
        return dict(hidden=4096, heads=64, head_dim=512, rope=64, experts=32, top_k=6, inter=2048,
                    kv_pool=8192, index_k=512, vocab=129280)
    return dict(hidden=160, heads=4, head_dim=32, rope=8, experts=8, top_k=2, inter=32, kv_pool=64,
                index_k=16, vocab=512)


def _cases(nv, t: int, prefill: int, s: dict) -> list[Case]:
    dev, gpu = nv.device, nv.device.type == "cuda"
    g = torch.Generator(dev).manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=dev) * scale

    d, h, hd, e, k, i = s["hidden"], s["heads"], s["head_dim"], s["experts"], s["top_k"], s["inter"]
    ids = torch.rand(t, e, generator=g, device=dev).argsort(-1)[:, :k]
    idx = torch.randint(0, s["kv_pool"], (t, s["index_k"]), generator=g, device=dev)
    angle = r(t, s["rope"] // 2)
    kv = r(s["kv_pool"], hd)
    w = r(d, d, scale=0.02)
    # DeepSeek's FP8 layout (128x128 blocks, float32 scales), its GEMM quantizing activations per
    # 1 x 128 (stated as the weight's act, so the reference linear computes the same math)
    w_q, w_s = ref.fp8_block_quant(w.cpu(), (128, 128))
    w_fp8 = QuantizedWeight(w_q, w_s, FP8, (128, 128), ActQuant(128, pow2=False)).to(dev)
    fp8_tol = FP8_DOT_TOL if gpu else 1e-5
    attn_bytes = 4 * (2 * t * h * hd + t * s["index_k"] * hd) + 8 * t * s["index_k"]
    cases = [
        Case("rms_norm", nv.rms_norm, ref.rms_norm, (r(t, d), r(d), 1e-6), 1e-5, 4 * (2 * t * d + d), 4 * t * d),
        Case("rope", nv.rope, ref.rope, (r(t, h, hd), angle.cos(), angle.sin()), 1e-6,
             4 * (2 * t * h * hd + t * s["rope"]), 3 * t * h * s["rope"]),
        Case("sample", nv.sample, ref.sample,
             (r(t, s["vocab"]), torch.ones(t, device=dev), torch.zeros(t, dtype=torch.int64, device=dev),
              torch.ones(t, device=dev), torch.arange(t, device=dev), torch.arange(t, device=dev)),
             0.0, 4 * t * s["vocab"], 0),
        Case("sparse_attention[triton]", attention.sparse_attention, ref.sparse_attention,
             (r(t, h, hd), kv, idx, r(h), hd ** -0.5), 1e-5, attn_bytes, 4 * t * h * s["index_k"] * hd),
        Case("moe_experts", nv.moe_experts, ref.moe_experts,
             (r(t, d), torch.rand(t, k, generator=g, device=dev), ids, r(e, 2 * i, d, scale=0.02),
              r(e, d, i, scale=0.02), 10.0),
             1e-5, 4 * (ids.unique().numel() * 3 * i * d + 2 * t * d), 6 * t * k * i * d),
    ]
    if cuda_ext.load() is not None:
        q, sinks = r(t, h, hd), r(h)
        cases.append(Case("sparse_attention[cuda]", cuda_ext.sparse_decode_attention, ref.sparse_attention,
                          (q, kv, idx, sinks, hd ** -0.5), 1e-5, attn_bytes, 4 * t * h * s["index_k"] * hd))
        kv16 = kv.bfloat16()
        cases.append(Case("sparse_attention[cuda,bf16kv]", cuda_ext.sparse_decode_attention,
                          lambda q, kv, *a: ref.sparse_attention(q, kv.float(), *a), (q, kv16, idx, sinks, hd ** -0.5),
                          1e-5, attn_bytes - 2 * t * s["index_k"] * hd, 4 * t * h * s["index_k"] * hd))
    for rows in (t, prefill):
        x = r(rows, d)
        cases.append(Case(f"linear[T={rows}]", nv.linear, ref.linear, (x, w), 1e-5,
                          4 * (rows * d + d * d + rows * d), 2 * rows * d * d))
        cases.append(Case(f"linear[fp8,T={rows}]", nv.linear, ref.linear, (x, w_fp8), fp8_tol,
                          4 * rows * d + d * d + 4 * w_s.numel() + 4 * rows * d, 2 * rows * d * d))
    return cases


def _rel_err(out, expected) -> float:
    if isinstance(expected, tuple):
        return max(_rel_err(o, e) for o, e in zip(out, expected))
    out = out.cpu()
    if not expected.is_floating_point():
        return float((out != expected).float().mean())
    if out.isnan().any():
        return float("inf")
    return float((out - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def _time_ms(fn, args, reps: int, flush: torch.Tensor | None = None) -> float:
    fn(*args)  # compile / warm up
    if not torch.cuda.is_available():  # interpreter: one wall-clock run
        start = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()  # evict the operands from L2 so small weights do not time as cache hits
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _ceilings(reps: int) -> tuple[float, float]:
    """(GB/s of a 1 GiB device copy counting read + write, TFLOP/s of an 8192^3 bf16 matmul)."""
    src = torch.empty(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _time_ms(dst.copy_, (src,), reps)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _time_ms(torch.matmul, (a, a), reps)
    return 2 * (1 << 30) / copy_ms / 1e6, 2 * 8192 ** 3 / mm_ms / 1e9


def _num(value, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value else f"{'-':>{width}s}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=None, help="decode step size (GPU 64, smoke 7)")
    parser.add_argument("--prefill", type=int, default=None, help="rows of the prefill GEMM rows (GPU 2048, smoke 33)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default="gpu_kernels.json")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    t = args.tokens or (64 if gpu else 7)
    prefill = args.prefill or (2048 if gpu else 33)
    nv = get_accelerator("nvidia")
    if gpu:
        gbps_peak, tflops_peak = _ceilings(args.reps)
        flush = torch.empty(64 << 20, device="cuda")  # 256 MiB > L2
        mode = f"GPU {torch.cuda.get_device_name()}: copy {gbps_peak:.0f} GB/s, bf16 matmul {tflops_peak:.0f} TFLOP/s"
    else:
        gbps_peak = tflops_peak = flush = None
        mode = "Triton interpreter (smoke run: errors are real, times are not)"
    cuda_note = "loaded" if cuda_ext.load() is not None else "not loaded (not built, or no sm_90/sm_100 GPU)"
    print(f"nvidia kernels, {mode}; csrc/cuda {cuda_note}")
    head = (f"{'op':30s} {'max rel err':>11s} {'tol':>7s} {'':4s} {'ms':>9s} {'GB/s':>7s} {'%copy':>6s} "
            f"{'TFLOP/s':>8s} {'%bf16mm':>7s}")
    print(head)
    rows, failed = [], 0
    for case in _cases(nv, t, prefill, _shapes(gpu)):
        try:
            out = case.fn(*case.args)
            cpu_args = tuple(a.to("cpu") if isinstance(a, (torch.Tensor, QuantizedWeight)) else a for a in case.args)
            err = _rel_err(out, case.ref(*cpu_args))
            ms = _time_ms(case.fn, case.args, args.reps, flush)
        except Exception as exc:  # a kernel that fails to compile or launch is a FAIL row, not the end of the run
            print(f"{case.name:30s} ERROR {type(exc).__name__}: {str(exc)[:400]}")
            rows.append(dict(op=case.name, error=f"{type(exc).__name__}: {exc}"[:2000], ok=False))
            failed += 1
            continue
        ok = err <= case.tol
        failed += not ok
        gbps, tflops = case.bytes / ms / 1e6, case.flops / ms / 1e9
        row = dict(op=case.name, max_rel_err=err, tol=case.tol, ok=ok, ms=ms, gb_s=gbps, tflop_s=tflops)
        rows.append(row)
        print(f"{case.name:30s} {err:11.2e} {case.tol:7.0e} {'ok' if ok else 'FAIL':4s} {ms:9.3f} "
              f"{_num(gbps, 7, 1)} {_num(gbps_peak and 100 * gbps / gbps_peak, 6, 1)} "
              f"{_num(case.flops and tflops, 8, 2)} "
              f"{_num(case.flops and tflops_peak and 100 * tflops / tflops_peak, 7, 1)}")
    with open(args.out, "w") as f:
        json.dump(dict(mode=mode, tokens=t, prefill=prefill, ceilings=dict(gb_s=gbps_peak, tflop_s=tflops_peak),
                       rows=rows), f, indent=2)
    print(f"{failed} FAIL" if failed else "all within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
