#!/usr/bin/env python
"""What a fresh engine pays for its step graphs' shape buckets: the same greedy batch generated
several times on one `LLM`, the first call recording and compiling every decode bucket it meets
(two eagerly run recorded steps, the tape's compile and, where the process has cores to choose
from, a timed first replay per bucket: core/graphs.py, backends/cpu/replay.py), the later calls
replaying them. Side by side in one run, each cell a fresh process (benchmarks/baseline.py): this
build, this build with DEEPINFER_ENFORCE_EAGER=1 (no step graphs: what the first call costs
anyway), and deepinfer as built at each --baseline ref.

    python benchmarks/bucket_warmup.py --batch 32 --baseline 127d0b3

Writes JSON (--json): per cell, seconds per call, the step-graph counters after each, and the
first call against the median of the later ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(model: str, batch: int, prompt_len: int, new_tokens: int, calls: int, eager: bool) -> dict:
    """One engine, `calls` generate calls of the same batch (in the calling process)."""
    if eager:
        os.environ["DEEPINFER_ENFORCE_EAGER"] = "1"
    import torch

    from deepinfer import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch)
    vocab = llm.engine.model_config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        graphs = getattr(llm.engine, "graphs", None)  # None when eager
        out.append(dict(seconds=round(time.perf_counter() - start, 3),
                        graphs=dict(graphs.stats) if graphs is not None else None))
    llm.engine.close()
    first, later = out[0]["seconds"], statistics.median(c["seconds"] for c in out[1:])
    return dict(calls=out, first_s=first, later_median_s=later, first_over_later=first / later,
                buckets_compiled_in_first_call=out[0]["graphs"]["compiled"] if out[0]["graphs"] else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "deepinfer" / "assets" / "tiny-dsv41"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--baseline", default=None, metavar="REF[,REF...]", help="also deepinfer as built at these refs")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from baseline import call

    model = os.path.abspath(a.model)
    args = [model, a.batch, a.prompt_len, a.new_tokens, a.calls]
    cells = {"this build": (None, False), "this build, DEEPINFER_ENFORCE_EAGER=1": (None, True)}
    cells |= {f"deepinfer @ {ref}": (ref, False) for ref in (a.baseline.split(",") if a.baseline else [])}
    results = {}
    for name, (ref, eager) in cells.items():
        results[name] = call(ref, "bucket_warmup", "run", *args, eager)
        r = results[name]
        print(f"{name}: first call {r['first_s']:.2f} s, later calls {r['later_median_s']:.2f} s (median), "
              f"{r['first_over_later']:.2f}x; calls {[c['seconds'] for c in r['calls']]}; "
              f"{r['buckets_compiled_in_first_call']} buckets compiled in the first", flush=True)
    if a.json:
        rel = os.path.relpath(model, REPO)
        result = dict(command="python " + " ".join(["benchmarks/bucket_warmup.py"] + sys.argv[1:]),
                      model=rel if not rel.startswith("..") else model, batch=a.batch, prompt_len=a.prompt_len,
                      new_tokens=a.new_tokens, cells=results, load_average=os.getloadavg())
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
