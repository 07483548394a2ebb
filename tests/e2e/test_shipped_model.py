"""The tiny DeepSeek-V4 shipped in deepinfer/assets/tiny-dsv4: loads offline, has learned Python,
generates through the CLI, and agrees with transformers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.llm import ASSETS_DIR, TINY_DSV4_DIR

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(TINY_DSV4_DIR, "model.safetensors")),
                                reason="the shipped model has not been trained into deepinfer/assets yet")


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_DSV4_DIR, max_num_seqs=8, max_num_batched_tokens=2048)


# Perplexity per token over the first 1024 tokens of each of the 16 held-out files, each file on
# its own (bos + text): 56.5 measured with deepinfer and with transformers (they agree to 1e-3).
# The training run's packed-stream evaluation (train_log.json) gives 36.2 because there every
# token sees up to 512 tokens of context; here the first tokens of each file see almost none.
HELDOUT_PPL = 56.5
HELDOUT_PPL_BOUND = 1.1 * HELDOUT_PPL


def test_heldout_perplexity_beats_unigram(llm):
    from heldout import heldout_perplexity

    m = heldout_perplexity(llm)
    print(f"held-out ppl {m['perplexity']:.2f} over {m['tokens']} tokens, unigram {m['unigram_perplexity']:.2f}")
    assert m["perplexity"] < HELDOUT_PPL_BOUND
    assert m["perplexity"] < 0.25 * m["unigram_perplexity"]


def test_greedy_equals_transformers(llm):
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, top_logprobs=1),
                        use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(TINY_DSV4_DIR, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    gc = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=2)
    for out in outs:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([out.prompt_token_ids]), generation_config=gc)[0]
        ref = ref[len(out.prompt_token_ids):].tolist()
        ours = out.outputs[0].token_ids
        if ours != ref:
            i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            lp = out.outputs[0].logprobs[i]
            assert abs(lp[ours[i]] - lp.get(ref[i], -math.inf)) < 1e-3, f"diverged at {i}: not a near-tie"


def test_cli_generates_python():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "deepinfer", "generate", "--prompt", "def fib(n):",
                           "--max-tokens", "32"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the CLI printed no completion"
    assert "\ufffd" not in proc.stdout


def test_cli_reports_bad_model_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "deepinfer", "generate", "--prompt", "x", "--model",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.slow
def test_non_editable_install_ships_the_model(tmp_path):
    """`pip install .` (not editable) must carry the model files as package data."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # The new venv reads its dependencies (torch, ...) from the environment running this test, whatever
    # that is (a venv or not): a plain path line, so that environment's own .pth files (an editable
    # deepinfer among them) are not processed and the copy installed below is the one imported.
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "parent_env.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", REPO],
                   check=True, timeout=600)
    code = ("import deepinfer, json, os; from deepinfer.llm import ASSETS_DIR as d; "
            "print(d); print(json.dumps({m: sorted(os.listdir(os.path.join(d, m))) for m in os.listdir(d)}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on it would shadow the install
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True, env=env)
    location, models = proc.stdout.splitlines()
    assert location.startswith(str(venv)) and "site-packages" in location
    models = json.loads(models)
    assert sorted(models) == sorted(os.listdir(ASSETS_DIR))  # both shipped models, the default among them
    for files in models.values():
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert name in files


def test_bfloat16_state_cache(llm):
    """dtype='bfloat16' stores the decode state in bf16 (half the bytes) and stays close to fp32."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, top_logprobs=1)
    half = LLM(TINY_DSV4_DIR, dtype="bfloat16", max_num_seqs=2)
    assert all(pool.data.dtype == torch.bfloat16 for pool in half.engine.cache.pools.values())
    assert half.engine.cache.bytes_per_slot() * 2 == llm.engine.cache.bytes_per_slot()
    ref = llm.generate(["def fib(n):"], params, use_tqdm=False)[0].outputs[0]
    out = half.generate(["def fib(n):"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16
    first = ref.token_ids[0]
    assert out.token_ids[0] == first
    assert abs(out.logprobs[0][first] - ref.logprobs[0][first]) < 0.05
