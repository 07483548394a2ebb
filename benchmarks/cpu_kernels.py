"""The cpu backend's fused C++ kernels vs the reference ops they replace, same inputs, one run:
microseconds per call at decode shapes of the largest test model (32 tokens, hidden 64, 4 streams)
and the relative difference of the outputs. Prints a table.

    python benchmarks/cpu_kernels.py [--tokens 32] [--candidates 256]
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer.backends.cpu import kernels, ops


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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=256, help="indexer candidates per token")
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    if not kernels.load():
        raise SystemExit("the cpu kernels did not build (see the warning)")
    torch.set_num_threads(1)
    print(f"{args.tokens} tokens, 1 thread")
    print("| op | reference us | fused us | speedup | max rel diff |")
    print("|---|---|---|---|---|")
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


if __name__ == "__main__":
    main()
