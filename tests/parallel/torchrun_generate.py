"""Run by test_torchrun.py under `torchrun --standalone --nproc-per-node 2`: every rank runs
this same script (SPMD) and writes the outputs it got to <out_dir>/rank<r>.json."""

import json
import os
import sys

from parallel_helpers import PROMPTS, greedy_params

if __name__ == "__main__":
    from deepinfer import LLM

    model_dir, out_dir, layout = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model_dir, max_num_seqs=4, max_num_batched_tokens=64, **layout)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy_params(), use_tqdm=False)
    llm.close()
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump([[o.outputs[0].token_ids, [{str(t): v for t, v in lp.items()} for lp in o.outputs[0].logprobs]]
                   for o in outputs], f)
