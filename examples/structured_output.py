"""Structured outputs: constrain generation to a JSON schema, a regex or an EBNF grammar.

    python examples/structured_output.py                 # the shipped tiny model
    python examples/structured_output.py /path/to/model  # any V4 model directory
"""

import json
import sys

from deepinfer import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else None  # None: the shipped tiny model
llm = LLM(model)

person = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
}
date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
call = r"""
root ::= name "(" arg ("," " " arg){0,3} ")"
name ::= "print" | "len" | "max" | "sorted"
arg ::= [0-9]{1,3} | "'" [a-z]{1,8} "'"
"""

requests = {
    "json": SamplingParams(max_tokens=96, seq_seed=1, so_args={"schema_type": "json", "schema": person}),
    "regex": SamplingParams(max_tokens=24, seq_seed=2, so_args={"schema_type": "regex", "schema": date}),
    "ebnf": SamplingParams(max_tokens=48, seq_seed=3, so_args={"schema_type": "ebnf", "schema": call}),
}


def token_ids(text: str) -> list[int]:
    ids = llm.tokenizer.encode(text)
    return ids[1:] if ids and ids[0] == llm.tokenizer.bos_token_id else ids


# Triggers: free text until the model writes the trigger tokens, then the grammar applies.
# With a bound token: once the model writes it, the trigger is forced, then the grammar.
newline = token_ids("\n")
requests["trigger"] = SamplingParams(max_tokens=96, seq_seed=4, so_args={
    "schema_type": "regex", "schema": r"    return [0-9]{1,4}\n", "trigger_token_ids": newline})
requests["bound"] = SamplingParams(max_tokens=96, seq_seed=5, so_args={
    "schema_type": "regex", "schema": r" [0-9]{1,4}\n", "trigger_token_ids": token_ids("    return"),
    "bound_token_id": newline[-1]})

prompts = {"json": "def person():\n    return ", "regex": "# released on ", "ebnf": "    ",
           "trigger": "def total(xs):\n    ", "bound": "def answer():\n    x = 1"}
outputs = llm.generate([prompts[k] for k in requests], list(requests.values()), use_tqdm=False)
for kind, out in zip(requests, outputs):
    c = out.outputs[0]
    print(f"--- {kind}: finish_reason={c.finish_reason} error={c.error}")
    print(c.text)
    if kind == "json" and c.finish_reason == "stop":
        print("parsed:", json.loads(c.text))
