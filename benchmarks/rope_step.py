"""RoPE of DSpark's drafting and verify steps: a device table of every position against cos/sin
computed per step from the position tensors (RopeConfig.rotations), in one run.

V4.1's drafter looked its cos/sin up by position tensors in a table of every position up to
max_model_len + a block, kept on the device outside the memory plan. It now computes them per step
from its [blocks x block size] positions: an int->float, a multiply by the 32 rates, a cos and a sin.
This prints and stores (benchmarks/results/rope_step.json):
1. the bytes of that table at DeepSeek-V4.1-Flash's released RoPE (64 rotated channels, float32
   cos + sin) for max_model_len 8K / 128K / 1M, against the rates the per-step path keeps;
2. the bits: per-step values against the table for every position up to 1M + a block, both released
   RoPEs (theta 1e4, and 160000 with YaRN), in shuffled batches of a drafting step's sizes;
3. the time per drafting step of each (the table's two gathers against the computation) at batch
   1 / 8 / 32 blocks of 5, each recorded and replayed as the engine replays drafting steps, beside
   a whole drafter block of the shipped tiny-dsv41 (DSparkDrafter.draft_block) at the same batch,
   for scale, replayed where the step graphs replay it (the table says which ran eagerly, and why). A drafting engine step computes RoPE twice (the block, and absorbing the
   accepted context rows).

    python benchmarks/rope_step.py [--positions 1048581] [--reps 2000]   # with other work paused
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepinfer.core.graphs import StepGraphs  # noqa: E402
from deepinfer.models.rope import RopeConfig  # noqa: E402

BLOCK = 5  # DSpark's block size at the released config
RELEASED = {"main (theta 1e4, DSpark)": RopeConfig(10000.0, 64),
            "compress (160000, YaRN 16/65536)": RopeConfig(160000.0, 64, {"factor": 16,
                                                                          "original_max_position_embeddings": 65536,
                                                                          "beta_fast": 32, "beta_slow": 1})}


def table_bytes(max_model_len: int, rope: RopeConfig) -> int:
    return 2 * (max_model_len + BLOCK) * (rope.dim // 2) * 4  # cos + sin, float32


def table(rope: RopeConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The removed device table of positions 0 .. n - 1, built as it was (one computation over all)."""
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * rope.inv_freq()
    return freqs.cos(), freqs.sin()


def bits(n: int) -> dict:
    out = {}
    for name, rope in RELEASED.items():
        cos, sin = table(rope, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        differ = checked = 0
        for size in (BLOCK, 8 * BLOCK, 32 * BLOCK):
            for index in order[: n if size == 32 * BLOCK else n // 8].split(size):
                c, s = rope.rotations(index)
                differ += int((c != cos[index]).sum() + (s != sin[index]).sum())
                checked += 2 * c.numel()
        out[name] = {"positions": n, "values_checked": checked, "values_differing": differ}
        print(f"  {name}: {differ} of {checked} values differ from the table")
    return out


def median_us(fn, reps: int) -> float:
    """The median of `reps` calls in microseconds, after 20 warm-up calls (the planner's time_call)."""
    from deepinfer.core.speculative.planner import time_call

    for _ in range(19):
        fn()
    return time_call(fn, reps) * 1e6


def drafter():
    os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", "3")
    from deepinfer import LLM

    llm = LLM(model=os.path.join(ROOT, "deepinfer", "assets", "tiny-dsv41"), max_num_seqs=32)
    return llm.engine.spec.drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=(1 << 20) + BLOCK, help="max_model_len + a block")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "rope_step.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"threads": 1, "cpu": "this machine's cpu backend"}

    rope = RELEASED["main (theta 1e4, DSpark)"]
    print("1. V4.1's drafter RoPE table (removed) at the released config, per engine:")
    result["bytes"] = []
    for length in (8192, 131072, 1 << 20):
        row = {"max_model_len": length, "table_bytes_before": table_bytes(length, rope),
               "bytes_after": rope.inv_freq().numel() * 4}
        result["bytes"].append(row)
        print(f"  max_model_len {length:>8}: table {row['table_bytes_before'] / 2**20:8.2f} MiB -> "
              f"{row['bytes_after']} bytes of rates")

    print(f"2. bits of per-step cos/sin against the table, positions 0 .. {args.positions - 1}:")
    result["bits"] = bits(args.positions)

    print("3. time per drafting step (us, median), each recorded and replayed as the engine runs drafting steps "
          "(core/graphs.py): the table's gathers vs the per-step computation, and tiny-dsv41's whole drafter block")
    cos, sin = table(rope, args.positions)
    d = drafter()
    graphs = StepGraphs(d.accel, max_tokens=1 << 12)
    g = torch.Generator().manual_seed(1)
    result["time"] = []
    print(f"  {'blocks':>6} {'positions':>9} {'table us':>9} {'compute us':>10} {'delta us':>9} "
          f"{'draft step us':>13} {'delta/step':>10}")
    for blocks in (1, 8, 32):
        positions = torch.randint(0, args.positions - BLOCK, (blocks * BLOCK,), generator=g)
        anchors = torch.randint(3, 8000, (blocks,), generator=g)
        slots, anchor_pos = torch.arange(blocks), torch.randint(0, 4000, (blocks,), generator=g)
        steps = {"table": (lambda ins: (cos[ins[0]], sin[ins[0]]), [positions]),
                 "compute": (lambda ins: rope.rotations(ins[0]), [positions]),
                 "draft": (lambda ins: d.draft_block(*ins), [anchors, slots, anchor_pos])}
        us = {}
        for name, (fn, inputs) in steps.items():
            key = (name, blocks)
            run = lambda fn=fn, inputs=inputs, key=key: graphs.run(key, lambda: fn(inputs), inputs, fn)  # noqa: E731
            us[name] = median_us(run, args.reps if name != "draft" else max(50, args.reps // 10))
        # the rope steps always replay; the drafter block stays eager where a call reads data into Python
        # (recorded in the JSON: at 8 blocks and more, tiny-dsv41's stage experts take the composite path)
        draft_mode = next(b.eager or "replayed" for k, b in graphs.buckets.items() if k[:2] == ("draft", blocks))
        assert all(b.eager is None for k, b in graphs.buckets.items() if k[0] != "draft")
        delta = us["compute"] - us["table"]
        row = {"blocks": blocks, "positions": blocks * BLOCK, "table_gather_us": us["table"],
               "per_step_compute_us": us["compute"], "delta_us": delta, "tiny_dsv41_draft_step_us": us["draft"],
               "draft_step": draft_mode, "delta_share_of_draft_step": delta / us["draft"]}
        result["time"].append(row)
        print(f"  {blocks:>6} {blocks * BLOCK:>9} {us['table']:>9.2f} {us['compute']:>10.2f} {delta:>9.2f} "
              f"{us['draft']:>13.1f} {row['delta_share_of_draft_step']:>10.2%}  (draft step {draft_mode})")
    result["graphs"] = dict(graphs.stats)
    result["load_average_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json} (load average {result['load_average_after']})")


if __name__ == "__main__":
    main()
