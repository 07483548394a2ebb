"""Talk to `deepinfer serve` with the official openai client: list models, a chat reply, a
streamed completion, a JSON-schema reply, and deepinfer's own sampling fields via extra_body.

    deepinfer serve &                # the shipped tiny model on http://127.0.0.1:8000
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="what the server's --api-key is, if it has one")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print("model:", model)

    # the shipped model writes Python and was never trained to chat: its chat format is each
    # message's text on its own line, so a chat reads like a completion of that text
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "def fibonacci(n):"}],
                                           max_tokens=48, temperature=0.0)
    print("chat:", repr(reply.choices[0].message.content), reply.usage)

    print("stream: ", end="")
    for chunk in client.completions.create(model=model, prompt="import os\n\n\ndef main():", max_tokens=48,
                                           temperature=0.8, seed=1, stream=True):
        print(chunk.choices[0].text, end="", flush=True)
    print()

    # bounded fields, so the object always closes within max_tokens
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "line": {"type": "integer", "minimum": 1, "maximum": 9999}},
              "required": ["name", "line"], "additionalProperties": False}
    record = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "# a function and where it starts"}], max_tokens=96,
        seed=0, response_format={"type": "json_schema", "json_schema": {"name": "location", "schema": schema}})
    print("json:", json.loads(record.choices[0].message.content))

    # deepinfer's own fields: top_k, ignore_eos, stop_token_ids, so_args (regex / EBNF / JSON)
    code = client.completions.create(model=model, prompt="VERSION = ", max_tokens=16, temperature=1.0, seed=3,
                                     extra_body={"top_k": 20, "so_args": {"schema_type": "regex",
                                                                          "schema": r'"[0-9]{1,2}\.[0-9]{1,2}"'}})
    print("regex:", code.choices[0].text)


if __name__ == "__main__":
    main()
