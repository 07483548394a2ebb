"""Prefill/decode disaggregation for the other families' caches, behind smg: DeepSeek-V4.1 (the
shipped tiny model: its own pools) and DeepSeek-V3 (a tiny random model: MLA latent pages, no rings).
The tokens through the P/D pair equal colocated LLM.generate, whole and streamed, for a prompt of
more than one page; the bytes moved are one slot's ring rows plus the prompt's pages by the cache
spec (V3: pages only); with each transfer engine, Mooncake's and NIXL's. Slow: two workers per case
start."""

from __future__ import annotations

import json
import shutil

import pytest

import tiny_models_v3
from conftest import http, running_server
from pd import disagg_stats, pd_args, running_pd_smg, running_prefill

from deepinfer.llm import TINY_DSV4_DIR, TINY_DSV41_DIR

pytestmark = pytest.mark.slow
PROMPT_IDS = [2 + (i * 37) % 500 for i in range(200)]  # token ids every tiny vocabulary has; > one page
SAMPLING = {"temperature": 0.0, "max_new_tokens": 10}


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    """A tiny random DeepSeek-V3 in the hub's layout, with a tokenizer to serve it (the prompts are ids)."""
    hf, _ = tiny_models_v3.make_hf_model("v3_yarn_groups", seed=11)
    path = tmp_path_factory.mktemp("pd_v3")
    tiny_models_v3.save_hf_layout(hf, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_DSV4_DIR}/{name}", path / name)
    return str(path)


def _generate(url: str, stream: bool) -> list[int]:
    body = json.dumps({"input_ids": PROMPT_IDS, "sampling_params": SAMPLING, "stream": stream}).encode()
    status, raw = http(url + "/generate", body, {"content-type": "application/json"}, timeout=120)
    assert status == 200, raw
    if stream:
        raw = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")][-1]
    return json.loads(raw)["output_ids"]


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize("family", ["v41", "v3"])
def test_family_through_pd_equals_colocated(family, backend, request):
    from deepinfer import LLM, SamplingParams

    model = TINY_DSV41_DIR if family == "v41" else request.getfixturevalue("v3_dir")
    llm = LLM(model, max_num_seqs=1)
    try:
        expected = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=SamplingParams(
            temperature=0.0, max_tokens=SAMPLING["max_new_tokens"]), use_tqdm=False)[0].outputs[0].token_ids
        cache = llm.engine.cache
        per_request = cache.bytes_per_slot() + cache.pages_for(len(PROMPT_IDS)) * cache.bytes_per_page()
        rings = cache.bytes_per_slot()
    finally:
        llm.close()
    if family == "v3":
        assert rings == 0  # an MLA latent cache is all pages
    args = ("--model", model, "--max-num-seqs", "2")
    with running_prefill(*args, backend=backend) as prefill, \
            running_server(*args, *pd_args("decode", backend=backend)) as decode, \
            running_pd_smg(prefill, decode) as router:
        before = disagg_stats(decode)
        whole = _generate(router.url, stream=False)
        moved = disagg_stats(decode)["bytes"] - before["bytes"]
        streamed = _generate(router.url, stream=True)
    assert whole == list(expected) and streamed == list(expected)
    assert moved == per_request
