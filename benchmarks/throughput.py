"""Offline batch throughput: deepinfer vs transformers' generate, same model, prompts and
greedy settings, in one run. Prints a table and writes JSON.

    python benchmarks/throughput.py                      # tiny random V4 from the tests
    python benchmarks/throughput.py --vocab deepseek     # the same with DeepSeek's 129,280-token vocabulary
    python benchmarks/throughput.py --model deepinfer/assets/tiny-dsv4
    python benchmarks/throughput.py --batches 32 --cores 2    # both engines on 2 cores
    python benchmarks/throughput.py --baseline main           # + the engine as built on main

Each engine gets the same CPU cores (--cores, default 1): transformers as intra-op threads (its
way of using several cores); deepinfer, with --layout dp (the default), as data-parallel ranks of
one thread each, with --layout threads as one process that gives each call of a replayed step
one thread or all of its cores, whichever measured faster (both pinned to the first --cores cores).
--baseline REF adds deepinfer as built at a git ref (benchmarks/baseline.py: REF's files exported once,
run in a subprocess with this script's measuring code), in the same run, on the same prompts. A model
transformers has no class for (DeepSeek-V4.1) needs one: the baseline is then the peer.

    python benchmarks/throughput.py --model deepinfer/assets/tiny-dsv41 --baseline main

On a CUDA machine both engines run on the GPU (deepinfer's nvidia backend, transformers with the
model moved to cuda), both in float32.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _cpu_isa() -> dict:
    """The instruction set torch (and with it deepinfer's cpu kernels) dispatched to, and the settings
    that hold a run on an AVX-512 machine to AVX2 (as most laptops run)."""
    return {"torch_capability": torch.backends.cpu.get_cpu_capability(),
            **{k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
               if k in os.environ}}


def _temp_dir() -> str:
    """A directory for a generated model, removed when this process exits (each is ~200 MB)."""
    path = tempfile.mkdtemp(prefix="deepinfer_bench_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _model_dir(args) -> str:
    """--model, else the tiny test config (with DeepSeek's real vocabulary and tokenizer when
    --vocab deepseek: the LM head and embedding of a real model, the layers of a tiny one)."""
    if args.model:
        return args.model
    from tiny_models import DEEPSEEK_VOCAB, make_hf_model, write_deepseek_tokenizer

    if args.tiny_config.startswith("v3/"):  # a tiny DeepSeek-V3 (tests/tiny_models_v3.py), e.g. v3/bench
        import tiny_models_v3

        hf, _ = tiny_models_v3.make_hf_model(args.tiny_config.removeprefix("v3/"), seed=0)
        path = _temp_dir()
        tiny_models_v3.save_hf_layout(hf, path)
        return path
    real_vocab = getattr(args, "vocab", "test") == "deepseek"
    hf, _ = make_hf_model(args.tiny_config, seed=0, **({"vocab_size": DEEPSEEK_VOCAB} if real_vocab else {}))
    path = _temp_dir()
    hf.save_pretrained(path, safe_serialization=True)
    if real_vocab:
        write_deepseek_tokenizer(path)
    return path


def model_label(args) -> str:
    if args.model:
        return args.model
    return f"test config {args.tiny_config}" + (", DeepSeek vocabulary" if args.vocab == "deepseek" else "")


def add_model_args(parser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: a tiny random V4 of the tests)")
    parser.add_argument("--tiny-config", default="mixed_hc4_yarn",
                        help="a tiny V4 config of tests/tiny_models.py, or v3/<name> of tests/tiny_models_v3.py "
                             "(v3/bench: issue 20's peers model)")
    parser.add_argument("--vocab", choices=("test", "deepseek"), default="test",
                        help="the tiny config's vocabulary: its own 512 tokens, or DeepSeek's 129,280")


def transformers_runs(config: dict) -> bool:
    """Whether transformers has a model class for this checkpoint (not for DeepSeek-V4.1: then a
    --baseline build of deepinfer is the peer)."""
    from transformers import AutoConfig

    try:
        AutoConfig.for_model(config.get("model_type", ""))
    except ValueError:
        return False
    return True


def _prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab, (batch, length), generator=gen).tolist()


def timed(fn, repeats: int = 1):
    """Run fn() `repeats` times: (median seconds, every run's seconds, the last run's result).
    The median, because other processes share this machine's cores."""
    runs, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs), runs, out


def run_deepinfer(model_dir: str, prompts, new_tokens: int, cores: int = 1, repeats: int = 1,
                  layout: str = "dp") -> dict:
    from deepinfer import LLM, SamplingParams

    # one single-threaded rank per core, or one process (a replayed step's calls take 1 or `cores` threads)
    parallel = dict(data_parallel_size=cores) if cores > 1 and layout == "dp" else {}
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity is not None:
        os.sched_setaffinity(0, sorted(affinity)[:cores])
    try:
        llm = LLM(model_dir, max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=4096, **parallel)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        # warm-up on the whole batch: kernels built, and a build with step graphs records this batch
        # size's decode steps (one step and several per call) before the timed runs
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=16,
                                                                               ignore_eos=True), use_tqdm=False)
        seconds, runs, outs = timed(lambda: llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False), repeats)
        weights = resident_weights(llm)
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
    llm.close()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sum(o.time_to_first_token for o in outs) / len(outs)
    tpot = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
    return dict(seconds=seconds, runs_s=runs, output_tokens=n, tok_s=n / seconds, ttft_s=ttft,
                tpot_s=sum(tpot) / max(len(tpot), 1), tokens=[o.outputs[0].token_ids for o in outs],
                weight_bytes=weights and sum(weights.values()), weights_by_kind=weights)


def resident_weights(llm) -> dict | None:
    """Bytes by storage kind of the weights the model and its drafter hold once built (after any
    widening or fusing at construction; memory-mapped tables apart); None for a parallel LLM, or for
    a --baseline build older than core/memory.py (before the quantized-weights issue)."""
    try:
        from deepinfer.core.memory import weights_by_kind
    except ImportError:
        return None

    engine = llm.engine
    if engine is None:
        return None
    drafter = getattr(engine.spec, "drafter", None)
    return weights_by_kind(getattr(engine.model, "w", {}), getattr(drafter, "w", {}))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_transformers(model_dir: str, prompts, new_tokens: int, cores: int = 1, repeats: int = 1) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(cores)  # intra-op threads: how one transformers process uses several cores
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    model.generation_config.eos_token_id = None  # ignore eos like deepinfer's ignore_eos=True
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding, so both engines see the same inputs
    with torch.no_grad():
        model.generate(ids[:1], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False,
                                                                      eos_token_id=None, pad_token_id=0))
        _sync()
        first = time.perf_counter()
        model(ids, logits_to_keep=1)  # time to first token ~ one prefill forward (last-position logits, as generate)
        _sync()
        ttft = time.perf_counter() - first

        def generate():
            out = model.generate(ids, generation_config=gc)
            _sync()
            return out

        seconds, runs, out = timed(generate, repeats)
    gen = out[:, ids.shape[1]:]
    n = gen.numel()
    # a separate prefill forward can take longer than generate's own (long prompts): no TPOT then
    tpot = (seconds - ttft) / max(new_tokens - 1, 1) if seconds > ttft else None
    return dict(seconds=seconds, runs_s=runs, output_tokens=n, tok_s=n / seconds, ttft_s=ttft, tpot_s=tpot,
                tokens=gen.tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", default="benchmarks/results/throughput.json")
    parser.add_argument("--cores", type=int, default=1,
                        help="CPU cores each engine may use: transformers as that many intra-op threads, deepinfer "
                             "as --layout says")
    parser.add_argument("--layout", choices=("dp", "threads"), default="dp",
                        help="deepinfer on several cores: data-parallel ranks of one thread, or one process whose "
                             "replayed steps give their large calls every core")
    parser.add_argument("--baseline", default=None, metavar="REF[,REF...]",
                        help="also run deepinfer as built at these git refs (e.g. main), same prompts, same run")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per engine and batch (median)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = os.path.abspath(_model_dir(args))  # the baseline runs from its own directory
    config = json.load(open(os.path.join(model_dir, "config.json")))
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]  # V4.1 nests its text config
    peer = transformers_runs(config)
    if not peer and not args.baseline:
        parser.error(f"transformers has no model class for {config.get('model_type')!r}: "
                     "give --baseline REF as the peer")
    load = os.getloadavg()  # other work on the cores skews every figure: recorded with them
    engines = ["deepinfer"]
    refs = args.baseline.split(",") if args.baseline else []
    labels = {"deepinfer": "deepinfer", "transformers": "transformers"}
    if refs:
        from baseline import call, describe

        for i, ref in enumerate(refs):
            key = "baseline" if i == 0 else f"baseline{i + 1}"  # the first keeps the key older JSON has
            labels[key] = f"deepinfer @ {describe(ref)}"
            engines.append(key)
    if peer:
        engines.append("transformers")
    ref_engine = "transformers" if peer else engines[1]  # the "vs" column's denominator
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = _prompts(vocab, batch, args.prompt_len)
        run = (model_dir, prompts, args.new_tokens, args.cores, args.repeats)
        row = dict(batch=batch, deepinfer=run_deepinfer(*run, layout=args.layout))
        for key, ref in zip(engines[1:], refs):
            row[key] = call(ref, "throughput", "run_deepinfer", *run, args.layout)
        if peer:
            row["transformers"] = run_transformers(*run)
        row["load_average_after"] = os.getloadavg()
        expected = row[ref_engine]["tokens"]
        for name in engines:
            row[name][f"identical_to_{ref_engine}"] = f"{sum(map(list.__eq__, row[name]['tokens'], expected))}/{batch}"
        for name in engines:
            row[name].pop("tokens")
        rows.append(row)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"cpu, {args.cores} core(s) per engine" + (
            "" if args.cores == 1 else f" (deepinfer data_parallel_size={args.cores})" if args.layout == "dp"
            else " (deepinfer one process, threads per call)")
    print(f"model: {model_label(args)} ({model_dir})  prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"greedy, {where}; load average before {load[0]:.2f}; median of {args.repeats}")
    print(f"| batch | engine | output tok/s | TTFT (s) | TPOT (ms) | vs {labels[ref_engine]} | "
          f"identical to {labels[ref_engine]} |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for name in engines:
            m = r[name]
            label = labels[name]
            tpot = "n/a" if m["tpot_s"] is None else f"{m['tpot_s'] * 1e3:.1f}"
            print(f"| {r['batch']} | {label} | {m['tok_s']:.1f} | {m['ttft_s']:.3f} | {tpot} | "
                  f"{m['tok_s'] / r[ref_engine]['tok_s']:.2f}x | "
                  f"{'' if name == ref_engine else m[f'identical_to_{ref_engine}']} |")
    for name in engines:
        held = rows[0][name].get("weight_bytes")
        if held:
            kinds = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in rows[0][name]["weights_by_kind"].items())
            print(f"{labels[name]}: weights held {held / 1e6:.2f} MB ({kinds})")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(model=model_label(args), vocab_size=vocab, device=where, cores=args.cores, layout=args.layout,
                       repeats=args.repeats,
                       baseline=labels.get("baseline"), baselines={k: v for k, v in labels.items() if k.startswith("baseline")},
                       prompt_len=args.prompt_len,
                       new_tokens=args.new_tokens, load_average=load, cpu_isa=_cpu_isa(), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
