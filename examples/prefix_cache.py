"""Multi-turn generation with the prefix cache: every turn resends the whole conversation, and
the engine restores the compressed state of what it has already seen instead of recomputing it.

    python examples/prefix_cache.py [--model DIR]

DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=off makes every turn an exact full recompute (compare the
prefill counts); compact (the default) replays only the last DEEPINFER_YOCO_PREFILL_KEEP_TOKENS
tokens before the cached prefix ends.
"""

import argparse
import inspect
import json.decoder

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="HF-format DeepSeek-V4 directory (default: the shipped model)")
    args = parser.parse_args()
    llm = LLM(args.model)
    # a long shared context (the shipped model writes Python), then one request per turn
    conversation = inspect.getsource(json.decoder)[:3000]
    turns = ["\n\ndef parse_header(line):\n", "\n\nclass Reader:\n    def __init__(self",
             "\n\ndef main():\n", "\n\nif __name__ == '__main__':\n"]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    for i, user in enumerate(turns):
        conversation += user
        out = llm.generate(conversation, params, use_tqdm=False)[0]
        conversation += out.outputs[0].text
        stats = llm.stats()
        print(f"--- turn {i + 1}: {len(out.prompt_token_ids)} prompt tokens, "
              f"ttft {out.time_to_first_token * 1e3:.0f} ms, cached so far {stats['prefix_cache_hit_tokens']} "
              f"tokens, replayed {stats['prefix_cache_replayed_tokens']}")
        print(user + out.outputs[0].text)
    print("stats:", llm.stats())


if __name__ == "__main__":
    main()
