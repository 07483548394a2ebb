#!/usr/bin/env python
"""Where DeepSeek's reference code disagrees with itself on one greedy token of the trained tiny
DeepSeek-V4.1: its decode (prefill of the prompt, then one token per step, as its generate.py)
against one prefill of the same tokens, layer by layer, at one generated position.

    PYTHONPATH=. python tools/v41_routing_flip.py --prompt 58 --position 28

Prompts are cut as tools/v41_trained_vs_reference.py cuts them (60 held-out prompts, bos + 48
tokens); the tokens fed are the reference's own greedy continuation. For every layer it prints the
relative difference of the attention, FFN and layer outputs (last position) between the two
schedules, and for each MoE whose routed experts differ, the selection scores (score + bias) of
both: a near-tied expert choice that bf16 noise flips shows there as a jump in that layer's FFN
output. Ends with the top tokens of both schedules. The reference is an oracle only, imported as
tools/v41_goldens.py imports it; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import v41_trained_vs_reference as trained  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "deepinfer" / "assets" / "tiny-dsv41")
    ap.add_argument("--reference", help="the deepseek_v41 reference folder (default as tools/v41_goldens.py)")
    ap.add_argument("--prompt", type=int, default=58, help="index into the 60 held-out prompts")
    ap.add_argument("--position", type=int, default=28, help="generated token whose step is compared")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tool = trained.goldens_tool()
    ref = tool.import_reference(tool.find_reference(a.reference))
    docs = trained.heldout_docs(tool.hf_tokenizer(a.model / "tokenizer.json"), 1024)
    prompt = trained.greedy_prompts(docs, 64, 48)[a.prompt]
    runner = trained.reference_runner(tool, ref, a.model, len(prompt) + a.position + 16)
    tokens, _ = trained.reference_greedy(tool, runner, prompt, a.position + 1)
    seq = torch.tensor([prompt + tokens])
    query = len(prompt) - 1 + a.position  # the step that produces generated token `position`

    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            o = out[0] if isinstance(out, tuple) else out
            seen[name] = o[0, -1].float().clone()
        return hook

    def keep_route(name):
        def hook(gate, args, out):
            x = args[0][-1:].float()
            scores = torch.nn.functional.softplus(x @ gate.weight.float().t() / gate.gate_temp).sqrt()
            seen[name + ".selection"] = (scores + gate.bias)[0]
            seen[name + ".experts"] = out[1][-1].sort().values
        return hook

    model = runner.model
    for i, layer in enumerate(model.layers):
        layer.attn.register_forward_hook(keep(f"layer {i} attention"))
        layer.ffn.register_forward_hook(keep(f"layer {i} ffn"))
        layer.register_forward_hook(keep(f"layer {i}"))
        layer.ffn.gate.register_forward_hook(keep_route(f"layer {i} gate"))

    prefill_logits, _ = runner.forward(seq[:, :query + 1], 0)
    prefill = dict(seen)
    runner.forward(seq[:, :len(prompt)], 0)
    for t in range(len(prompt), query):
        runner.forward(seq[:, t:t + 1], t)
    decode_logits, _ = runner.forward(seq[:, query:query + 1], query)
    decode = dict(seen)

    print(f"prompt {a.prompt}, generated token {a.position} (query position {query}): decode vs prefill")
    for name, x in prefill.items():
        if name.endswith(".experts"):
            if not torch.equal(x, decode[name]):
                base = name.removesuffix(".experts")
                fmt = lambda t: " ".join(f"{v:.4f}" for v in t.tolist())  # noqa: E731
                print(f"  {base}: experts {x.tolist()} (prefill) vs {decode[name].tolist()} (decode)")
                print(f"    selection scores, prefill: {fmt(prefill[base + '.selection'])}")
                print(f"    selection scores, decode:  {fmt(decode[base + '.selection'])}")
        elif not name.endswith(".selection"):
            rel = float((x - decode[name]).norm() / x.norm())
            print(f"  {name:18s} relative difference {rel:.4f}")
    for label, logits in (("prefill", prefill_logits[0, -1]), ("decode", decode_logits[0, -1])):
        top = logits.double().log_softmax(-1).topk(4)
        print(f"  {label} top tokens: " + ", ".join(f"{i} ({v:.3f})" for v, i in zip(top.values.tolist(),
                                                                                  top.indices.tolist())))


if __name__ == "__main__":
    main()
