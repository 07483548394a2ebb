"""DSpark speculative decoding A/B on this machine: concurrency x {off, fixed-5, dynamic}.

Per cell: at least --min-requests requests, `concurrency` at a time; mean verified length (drafts verified per request-step), mean accepted length
(accepted drafts per request-step), tokens per request-step (accepted + the target's own
token), output tokens/s, and dynamic vs fixed-5. Greedy decoding of held-out code (the
shipped model's held-out stdlib files: prompts are 64-token windows of them), so every
mode produces the same tokens (the JSON records whether they did). Prints a table, writes
JSON and, when matplotlib is installed, a plot.

    python benchmarks/dspark.py                       # shipped model, concurrency 1 4 16 32 64
    python benchmarks/dspark.py --concurrency 1 4 --new-tokens 32
    python benchmarks/dspark.py --model deepinfer/assets/tiny-dsv41 --baseline main   # + main's build

--baseline REF runs every cell with deepinfer as built at a git ref as well (benchmarks/baseline.py),
right after this build's run of the same cell: same prompts, same measuring code, one row each; then
each build's cells run in a fresh process of their own (an engine leaves state behind in its process:
in one process with the earlier cells this build's `off` ran up to 1.2x slower than the baseline's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

MODES = {"off": ("0", "0"), "fixed-5": ("5", "0"), "dynamic": ("5", "1")}


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    from train_tiny import collect_corpus

    _, _, held = collect_corpus()
    ids = []
    for _, text in held:
        ids += tokenizer.encode(text)
    step = max((len(ids) - length) // count, 1)
    return [ids[i * step:i * step + length] for i in range(count)]


def run(model: str, mode: str, prompts, concurrency: int, new_tokens: int, perf_dir: str, repeats: int):
    from deepinfer import LLM, SamplingParams

    os.environ["DEEPINFER_USE_NEXTN_DECODE"], os.environ["DEEPINFER_ENABLE_MTP_VARLEN"] = MODES[mode]
    os.environ["DEEPINFER_DECODE_PERF_CACHE_DIR"] = perf_dir
    llm = LLM(model, max_num_seqs=max(64, concurrency), max_num_batched_tokens=1024)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up
    spec = llm.engine.spec
    best, first = None, None
    for _ in range(repeats):  # the fastest of a few runs: the cores are shared, slow runs are noise
        if spec is not None:
            spec.stats.update(steps=0, verified=0, accepted=0)
        start = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), concurrency):  # `concurrency` requests at a time
            outs += llm.generate(prompt_token_ids=prompts[i:i + concurrency], sampling_params=params, use_tqdm=False)
        seconds = time.perf_counter() - start
        first = seconds if first is None else first
        stats = dict(spec.stats) if spec is not None else {"steps": 0}
        if best is None or seconds < best[0]:
            best = (seconds, outs, stats)
    seconds, outs, stats = best
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(len(t) for t in tokens)
    steps = stats["steps"]
    # first_seconds: the first timed run (captured steps: with most of their buckets' recordings)
    out = dict(mode=mode, concurrency=concurrency, requests=len(prompts), seconds=round(seconds, 3),
               first_seconds=round(first, 3), output_tokens=n,
               tok_s=round(n / seconds, 2),
               mean_verified_len=round(stats["verified"] / steps, 3) if steps else 0.0,
               mean_accepted_len=round(stats["accepted"] / steps, 3) if steps else 0.0)
    llm.engine.close()
    return out, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "deepinfer", "assets", "tiny-dsv4"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per cell; the fastest is kept")
    parser.add_argument("--min-requests", type=int, default=8,
                        help="requests per cell at least (run as rounds of `concurrency` requests)")
    parser.add_argument("--perf-dir", default=os.environ.get("DEEPINFER_DECODE_PERF_CACHE_DIR", ""),
                        help="DEEPINFER_DECODE_PERF_CACHE_DIR for the dynamic planner's step-cost profile")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dspark.json"))
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the modes run (off first: the others' `vs off` and token check need it)")
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="also run every cell with deepinfer as built at this git ref (e.g. main), same run")
    parser.add_argument("--plot-only", metavar="JSON", help="redraw the plot of an earlier run's JSON and exit")
    args = parser.parse_args()
    modes = [m for m in MODES if m in args.modes]
    if modes[0] != "off":
        parser.error("--modes must include off")
    if args.plot_only:
        with open(args.plot_only) as f:
            data = json.load(f)
            return plot(data["rows"], args.plot_only, data["meta"]["model"])

    import torch
    from deepinfer.core.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.model)
    pool = heldout_prompts(tokenizer, max(args.concurrency + [args.min_requests]), args.prompt_len)
    load = os.getloadavg()  # other work on the cores skews every figure: recorded with them
    builds = {"deepinfer": None}
    if args.baseline:
        from baseline import call, describe

        builds[f"deepinfer @ {describe(args.baseline)}"] = args.baseline
    model = os.path.abspath(args.model)  # the baseline runs from its own directory
    rows, same = [], {}
    for c in args.concurrency:
        reference = None
        prompts = pool[:max(c, args.min_requests // c * c)]  # low concurrency: several rounds of c requests
        for mode in modes:
            for build, ref in builds.items():
                cell = (model, mode, prompts, c, args.new_tokens, args.perf_dir, args.repeats)
                row, tokens = run(*cell) if not args.baseline else call(ref, "dspark", "run", *cell)
                reference = tokens if reference is None else reference
                row.update(build=build, same_tokens_as_off=tokens == reference, load_average_after=os.getloadavg())
                rows.append(row)
                print(json.dumps(row), flush=True)
        same[c] = all(r["same_tokens_as_off"] for r in rows if r["concurrency"] == c)

    by = {(r["concurrency"], r["mode"], r["build"]): r for r in rows}
    header = ("| concurrency | mode | build | verified len | accepted len | tokens/step | output tok/s | vs off | "
              "dynamic vs fixed-5 |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for c in args.concurrency:
        for mode in modes:
            for build in builds:
                r, off = by[(c, mode, build)], by[(c, "off", build)]["tok_s"]
                tps = f"{r['mean_accepted_len'] + 1:.2f}" if mode != "off" else "1.00"
                dyn = ""
                if mode == "dynamic" and "fixed-5" in modes:
                    dyn = f"{100 * (r['tok_s'] / by[(c, 'fixed-5', build)]['tok_s'] - 1):+.1f}%"
                lines.append(f"| {c} | {mode} | {build} | {r['mean_verified_len']:.2f} | {r['mean_accepted_len']:.2f} "
                             f"| {tps} | {r['tok_s']:.1f} | {r['tok_s'] / off:.2f}x | {dyn} |")
    table = "\n".join(lines)
    print(table)
    meta = dict(model=os.path.relpath(args.model, ROOT), new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                repeats=args.repeats, min_requests=args.min_requests, modes=modes, builds=list(builds),
                load_average=load,
                greedy=True, torch=torch.__version__, threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                lossless_all_concurrency=same)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows, table=table), f, indent=1)
    plot(rows, args.out, meta["model"])


def plot(rows: list[dict], out: str, model: str) -> None:
    """Output tok/s per mode (and build) over concurrency, next to the JSON (`--plot-only JSON` redraws it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib to get benchmarks/results/dspark.png)")
        return
    concurrency = sorted({r["concurrency"] for r in rows})
    builds = list(dict.fromkeys(r.get("build", "deepinfer") for r in rows))  # runs before --baseline had none
    by = {(r["concurrency"], r["mode"], r.get("build", "deepinfer")): r for r in rows}
    fig, ax = plt.subplots(figsize=(6, 4))
    for build in builds:
        for mode in dict.fromkeys(r["mode"] for r in rows):
            label = mode if len(builds) == 1 else f"{mode}, {build}"
            ax.plot(concurrency, [by[(c, mode, build)]["tok_s"] for c in concurrency], marker="o", label=label,
                    linestyle="-" if build == builds[0] else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"DSpark on {os.path.basename(model)} (CPU, 1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(out)[0] + ".png", dpi=120)
    print("plot:", os.path.splitext(out)[0] + ".png")


if __name__ == "__main__":
    main()
