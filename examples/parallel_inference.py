"""Expert + data parallelism (and EPLB) over worker processes on one machine, or under torchrun.

    python examples/parallel_inference.py [--model DIR] [--ep 2] [--dp 2]
    torchrun --standalone --nproc-per-node 2 examples/parallel_inference.py --ep 2 --dp 2

Spawned: this process drives one worker per rank. Under torchrun every process is a rank and
every rank gets (and prints) all the outputs.
"""

import argparse
import os

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="HF-format DeepSeek-V4 directory (default: the shipped model)")
    parser.add_argument("--ep", type=int, default=2, help="expert_parallel_size")
    parser.add_argument("--dp", type=int, default=2, help="data_parallel_size")
    args = parser.parse_args()
    llm = LLM(args.model, expert_parallel_size=args.ep, data_parallel_size=args.dp,
              num_redundant_experts=args.ep, eplb_window_size=16, eplb_step_interval=16)
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n", "class Stack:\n"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=48, seq_seed=7))
    if os.environ.get("RANK", "0") == "0":
        for out in outputs:
            print(f"--- {out.prompt!r}\n{out.prompt + out.outputs[0].text}")
    llm.close()


if __name__ == "__main__":
    main()
