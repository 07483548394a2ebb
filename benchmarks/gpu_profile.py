"""Where a decode step's time goes on a GPU: torch.profiler over a few steady-state decode steps of
the shipped model at one batch size; prints the top host-side and device-side entries, the kernel
launches per step and the share of the step the GPU is busy (a launch-bound engine shows a low one).

    python benchmarks/gpu_profile.py [--batch 32] [--steps 8] [--out gpu_profile.json]

Needs a CUDA GPU (the nvidia backend); on a CPU machine it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="gpu_profile.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to profile")
        return 0
    from torch.profiler import ProfilerActivity, profile

    from deepinfer import LLM, SamplingParams
    from deepinfer.llm import TINY_DSV4_DIR

    llm = LLM(TINY_DSV4_DIR, accelerator="nvidia", max_num_seqs=args.batch)  # issue 21's "shipped model" goal
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, engine.model_config.vocab_size, (args.batch, 32), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)
    for _ in range(6):  # prefill + warm-up decodes (compiles every kernel)
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / args.steps
    launches = sum(e.count for e in events if e.self_device_time_total > 0) / args.steps
    print(f"batch {args.batch}: {wall * 1e3:.1f} ms per decode step (profiled), GPU busy "
          f"{device_us / 1e3:.2f} ms ({100 * device_us / 1e3 / (wall * 1e3):.0f}%), ~{launches:.0f} kernels per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    with open(args.out, "w") as f:
        json.dump(dict(batch=args.batch, ms_per_step=wall * 1e3, gpu_busy_ms=device_us / 1e3,
                       kernels_per_step=launches), f, indent=2)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
