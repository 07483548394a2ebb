"""Time the nvidia backend's Triton kernels against the cpu reference, op by op.

Prints a table and writes JSON (never asserts on time). On a GPU it uses DeepSeek-V4-Flash-like
shapes; without one it runs tiny shapes through the Triton interpreter (a smoke run, not a speed
measurement).

    python benchmarks/gpu_kernels.py [--tokens 64] [--out gpu_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deepinfer.backends import get_accelerator  # noqa: E402


def _shapes(gpu: bool) -> dict:
    if gpu:
        return dict(hidden=4096, heads=64, head_dim=512, rope=64, experts=256, top_k=6, inter=2048,
                    kv_pool=8192, index_k=512, vocab=129280)
    return dict(hidden=64, heads=4, head_dim=32, rope=8, experts=8, top_k=2, inter=32, kv_pool=64,
                index_k=16, vocab=512)


def _cases(t: int, s: dict, device) -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    ids = torch.stack([torch.randperm(s["experts"], generator=g)[:s["top_k"]] for _ in range(t)]).to(device)
    idx = torch.randint(0, s["kv_pool"], (t, s["index_k"]), generator=g).to(device)
    angle = r(t, s["rope"] // 2)
    return {
        "rms_norm": (r(t, s["hidden"]), r(s["hidden"]), 1e-6),
        "rope": (r(t, s["heads"], s["head_dim"]), angle.cos(), angle.sin()),
        "linear": (r(t, s["hidden"]), r(s["hidden"], s["hidden"], scale=0.02)),
        "sparse_attention": (r(t, s["heads"], s["head_dim"]), r(s["kv_pool"], s["head_dim"]), idx,
                             r(s["heads"]), s["head_dim"] ** -0.5),
        "moe_experts": (r(t, s["hidden"]), torch.rand(t, s["top_k"], generator=g).to(device), ids,
                        r(s["experts"], 2 * s["inter"], s["hidden"], scale=0.02),
                        r(s["experts"], s["hidden"], s["inter"], scale=0.02), 10.0),
        "sample": (r(t, s["vocab"]), torch.ones(t, device=device), torch.zeros(t, dtype=torch.int64, device=device),
                   torch.ones(t, device=device), torch.arange(t, device=device), torch.arange(t, device=device)),
    }


def _time(fn, args, acc, reps: int) -> float:
    fn(*args)
    acc.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    acc.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="gpu_kernels.json")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    nv, cpu = get_accelerator("nvidia"), get_accelerator("cpu")
    reps = 20 if gpu else 1
    rows = []
    for op, op_args in _cases(args.tokens, _shapes(gpu), nv.device).items():
        ms = _time(getattr(nv, op), op_args, nv, reps)
        cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in op_args)
        ref_ms = _time(getattr(cpu, op), cpu_args, cpu, reps)
        rows.append(dict(op=op, tokens=args.tokens, nvidia_ms=ms, cpu_ms=ref_ms))
    mode = "GPU" if gpu else "Triton interpreter (smoke run, times are not meaningful)"
    print(f"nvidia kernels, {mode}, T={args.tokens}")
    print(f"{'op':18s} {'nvidia ms':>10s} {'cpu ms':>10s}")
    for row in rows:
        print(f"{row['op']:18s} {row['nvidia_ms']:10.3f} {row['cpu_ms']:10.3f}")
    with open(args.out, "w") as f:
        json.dump(dict(mode=mode, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
