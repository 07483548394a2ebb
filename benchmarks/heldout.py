"""Held-out perplexity of a model on the shipped models' held-out CPython files (tests/heldout.py:
each file on its own, its first 1024 tokens, scored through prompt_logprobs), next to a unigram
baseline of the same tokenizer. Quality, not speed: the figure the README and model cards quote.

    python benchmarks/heldout.py [--model DIR]    # default: the shipped model
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None, help="default: benchmarks/results/heldout_<model dir name>.json")
    args = parser.parse_args()
    from heldout import heldout_perplexity

    from deepinfer import LLM
    from deepinfer.llm import default_model

    model = args.model or default_model()
    m = heldout_perplexity(LLM(model, max_num_seqs=16, max_num_batched_tokens=4096))
    print(f"{model}: held-out perplexity {m['perplexity']:.2f}/token over {m['tokens']} tokens of {m['files']} files "
          f"(unigram {m['unigram_perplexity']:.1f})")
    path = args.json or f"benchmarks/results/heldout_{os.path.basename(os.path.normpath(model))}.json"
    with open(path, "w") as f:
        json.dump(dict(model=os.path.relpath(model), **m), f, indent=2)


if __name__ == "__main__":
    main()
