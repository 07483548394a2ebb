"""The tiny DeepSeek-V4.1 shipped in deepinfer/assets/tiny-dsv41 (tools/train_tiny_v41.py): it loads
through LLM with nothing downloaded, continues held-out code exactly as DeepSeek's reference code
does (tests/goldens/tiny_dsv41_greedy.json, written by tools/v41_trained_vs_reference.py: prompts
where the reference's top-2 gap stays wide at every token, so a flip means a real difference), and
its DSpark stages draft losslessly."""

from __future__ import annotations

import json
import os

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.llm import TINY_DSV41_DIR

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSET = TINY_DSV41_DIR
GOLDEN = os.path.join(REPO, "tests", "goldens", "tiny_dsv41_greedy.json")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(ASSET, "model.safetensors")),
                                reason="tiny-dsv41 has not been trained into deepinfer/assets yet")


def golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]


def test_the_shipped_v41_is_a_trained_v41():
    llm = LLM(ASSET, max_num_seqs=4)
    cfg = llm.engine.model_config
    assert type(llm.engine.model).__name__ == "DeepseekV41Model"
    assert cfg.engram_layer_ids and cfg.num_nextn_predict_layers == 3
    text = llm.generate(["def main(argv):\n    "], SamplingParams(temperature=0.0, max_tokens=24),
                        use_tqdm=False)[0].outputs[0].text
    assert text.strip(), text


def test_llm_defaults_to_the_shipped_model_of_lowest_heldout_perplexity():
    """LLM() with no model is tiny-dsv41 because it is the better of the two shipped models on held-out code
    (tests/heldout.py: each held-out file, its first 1024 tokens); retraining either one re-checks that."""
    from heldout import heldout_perplexity

    from deepinfer.llm import DEFAULT_MODEL_DIR, TINY_DSV4_DIR

    ppl = {path: heldout_perplexity(LLM(path, max_num_seqs=16, max_num_batched_tokens=4096))["perplexity"]
           for path in (TINY_DSV4_DIR, ASSET)}
    print({os.path.basename(p): round(v, 3) for p, v in ppl.items()})
    assert DEFAULT_MODEL_DIR == min(ppl, key=ppl.get), ppl
    assert type(LLM(max_num_seqs=1).engine.model).__name__ == "DeepseekV41Model"


def test_greedy_equals_deepseeks_reference():
    g = golden()
    assert len(g["cases"]) >= 4
    llm = LLM(ASSET, max_num_seqs=8)
    got = greedy(llm, [c["prompt"] for c in g["cases"]], g["new_tokens"])
    for case, tokens in zip(g["cases"], got):
        assert tokens == case["tokens"], (case["prompt"][:8], tokens, case["tokens"])


def test_trained_drafts_are_lossless(monkeypatch):
    """Three drafts every step (fixed length) verified by the backbone: the reference's tokens still.
    Batch-invariant ops: a verify step holds more rows than a decode step (tests/e2e/test_v41_engine.py)."""
    g = golden()
    prompts = [c["prompt"] for c in g["cases"][:4]]
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    llm = LLM(ASSET, max_num_seqs=4)
    assert greedy(llm, prompts, g["new_tokens"]) == [c["tokens"] for c in g["cases"][:4]]
    stats = llm.stats()
    assert stats["spec_verified"] > 0, stats
