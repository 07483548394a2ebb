"""Outputs of the shipped models under every way the engine can run a step, pinned before the model
runner refactor (issue 37) so that it changes no output: tools/record_runner_goldens.py writes
tests/goldens/runner_goldens.json with `run_all()`, tests/e2e/test_refactor_goldens.py compares.

Each mode is a set of DEEPINFER_* variables: step graphs on (the cpu tape) or off, multi-step greedy
decode on or off, zero-overhead scheduling, DSpark drafting forced on (fixed verify length, so the
drafts do not depend on step timings). Each runs one batch that mixes greedy and seeded sampling,
stop tokens and strings, top logprobs and prompt logprobs, and prompts of different lengths."""

from __future__ import annotations

import os
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "goldens", "runner_goldens.json")
MODELS = {"tiny-dsv41": os.path.join(REPO, "deepinfer", "assets", "tiny-dsv41"),
          "tiny-dsv4": os.path.join(REPO, "deepinfer", "assets", "tiny-dsv4")}
MODES = {
    "graphs": {},
    "eager": {"DEEPINFER_ENFORCE_EAGER": "1"},
    "single-step": {"DEEPINFER_MULTI_STEP_DECODE": "1"},
    "overlap": {"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1"},
    "dspark": {"DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "0"},
    "dspark-eager": {"DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "0",
                     "DEEPINFER_ENFORCE_EAGER": "1"},
}
PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n    path = argv[1]\n    ",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        ",
           "for i in range(10):\n"]
NEW_TOKENS = 20


@contextmanager
def environment(values: dict[str, str]):
    """The mode's DEEPINFER_* variables for the duration (the engine reads them when it is built)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def requests():
    """(prompt, SamplingParams) of the batch every mode runs: all-greedy first (the multi-step path),
    then a mixed batch (sampling, logprobs and stops force single steps)."""
    from deepinfer import SamplingParams

    greedy = [(p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)) for p in PROMPTS]
    greedy[1] = (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[201, 14]))
    greedy[3] = (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=["#\n#", "get_get"]))
    mixed = [
        (PROMPTS[0], SamplingParams(temperature=0.8, top_p=0.9, seq_seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(temperature=1.0, top_k=20, seq_seed=11, max_tokens=NEW_TOKENS, top_logprobs=2)),
        (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, top_logprobs=3, prompt_logprobs=2)),
        (PROMPTS[3], SamplingParams(temperature=0.7, seq_seed=3, max_tokens=NEW_TOKENS, stop=["\n"])),
    ]
    return greedy, mixed


def _summary(output) -> dict:
    out = output.outputs[0]
    row = {"token_ids": list(out.token_ids), "text": out.text, "finish_reason": out.finish_reason,
           "stop_reason": out.stop_reason}
    if out.logprobs is not None:  # a few: the first tokens' (token -> logprob as the engine gave them)
        row["logprobs"] = [{str(t): v for t, v in d.items()} for d in out.logprobs[:4]]
    if output.prompt_logprobs is not None:
        row["prompt_logprobs"] = [None if d is None else {str(t): v for t, v in d.items()}
                                  for d in output.prompt_logprobs[:4]]
    return row


def run_mode(model: str, mode: str) -> dict:
    """{"greedy": [...], "mixed": [...]}: per request its tokens, text, finish and (some) logprobs."""
    from deepinfer import LLM

    with environment(MODES[mode]):
        llm = LLM(MODELS[model], max_num_seqs=8, max_num_batched_tokens=512)
        try:
            out = {}
            for name, batch in zip(("greedy", "mixed"), requests()):
                prompts, params = zip(*batch)
                outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
                out[name] = [_summary(o) for o in outputs]
        finally:
            llm.engine.close()
    return out


def run_all() -> dict:
    return {model: {mode: run_mode(model, mode) for mode in MODES} for model in MODELS}
