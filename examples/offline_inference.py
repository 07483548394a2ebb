"""Offline batch inference on the shipped tiny DeepSeek-V4 (or any V4 checkpoint directory).

    python examples/offline_inference.py [--model DIR]
"""

import argparse

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="HF-format DeepSeek-V4 directory (default: the shipped model)")
    args = parser.parse_args()
    llm = LLM(args.model)
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n", "class Stack:\n"]
    params = [SamplingParams(temperature=0.0, max_tokens=48),  # greedy
              SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seq_seed=7),  # seeded sampling
              SamplingParams(temperature=0.8, top_k=40, max_tokens=48, stop=["\n\n"])]
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        print(f"--- {out.prompt!r} -> finish={completion.finish_reason}, "
              f"ttft={out.time_to_first_token * 1e3:.1f} ms")
        print(out.prompt + completion.text)


if __name__ == "__main__":
    main()
