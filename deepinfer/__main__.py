"""Command line: `python -m deepinfer generate --prompt "def fib"` streams a completion."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=1)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seq_seed=args.seq_seed)
    if llm.tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    engine = llm.engine
    req = engine.add_request(llm.tokenizer.encode(args.prompt), params, args.prompt)
    if args.echo:
        sys.stdout.write(args.prompt)
    shown = 0
    while not req.is_finished:
        engine.step()
        sys.stdout.write(req.text[shown:])
        sys.stdout.flush()
        shown = len(req.text)
    engine.pop_finished()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of one prompt to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", default=None, help="model directory (default: the shipped tiny DeepSeek-V4)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seq-seed", type=int, default=None)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
