#!/usr/bin/env python
"""What a fresh engine pays for its step graphs' shape buckets: the same greedy batch generated
several times on one `LLM`, the first call recording and compiling every decode bucket it meets
(two eagerly run recorded steps, the tape's compile and, where the process has cores to choose
from, a timed first replay per bucket: core/graphs.py, backends/cpu/replay.py), the later calls
replaying them.

    python benchmarks/bucket_warmup.py --model deepinfer/assets/tiny-dsv41 --batch 32 --new-tokens 256

Writes JSON (--json): seconds per call, the step-graph counters after each, and the first call's
excess over the median of the later ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "deepinfer" / "assets" / "tiny-dsv41"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    from deepinfer import LLM, SamplingParams

    llm = LLM(a.model, max_num_seqs=a.batch)
    vocab = llm.engine.model_config.vocab_size
    prompts = torch.randint(3, vocab, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    calls = []
    for _ in range(a.calls):
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        graphs = llm.engine.graphs  # None under DEEPINFER_ENFORCE_EAGER=1: what the first call costs anyway
        calls.append(dict(seconds=round(time.perf_counter() - start, 3),
                          graphs=dict(graphs.stats) if graphs is not None else None))
        print(calls[-1], flush=True)
    later = statistics.median(c["seconds"] for c in calls[1:])
    first = calls[0]["seconds"]
    buckets = calls[0]["graphs"]["compiled"] if calls[0]["graphs"] else 0
    eager = os.environ.get("DEEPINFER_ENFORCE_EAGER", "")
    result = dict(command=(f"DEEPINFER_ENFORCE_EAGER={eager} " if eager else "") + "python "
                  + " ".join(["benchmarks/bucket_warmup.py"] + os.sys.argv[1:]),
                  model=a.model if not a.model.startswith(str(REPO)) else os.path.relpath(a.model, REPO),
                  batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                  step_threads=llm.accel.step_threads, calls=calls, first_s=first, later_median_s=later,
                  first_over_later=first / later, buckets_compiled_in_first_call=buckets,
                  excess_per_bucket_s=(first - later) / buckets if buckets else None,
                  load_average=os.getloadavg())
    print(f"first call {first:.2f} s, later calls {later:.2f} s (median): {first / later:.2f}x; "
          f"{buckets} buckets compiled in the first, {result['excess_per_bucket_s'] or 0:.2f} s each")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    llm.engine.close()


if __name__ == "__main__":
    main()
