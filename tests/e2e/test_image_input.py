"""Image input through LLM.generate: the request shapes (vLLM's prompt dicts, upstream's
multi_modal_data argument), and every bad input refused with an error that names it while the engine
keeps serving. On a text-only model (a tiny DeepSeek-V4) images are refused as such."""

from __future__ import annotations

import io

import pytest

from deepinfer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def png(w: int = 30, h: int = 20) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color=(200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def text_llm(tiny_model_dir):
    path, _ = tiny_model_dir
    return LLM(path, max_num_seqs=4, max_num_batched_tokens=256, num_cache_pages=32)


def _still_serves(llm) -> None:
    out = llm.generate([{"prompt": "def fib(n):"}, "import os"], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages and not llm.engine.requests


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(prompts=[{"prompt": "a <image> b", "multi_modal_data": {"image": png()}}]), ValueError,
     r"prompt 0: multi_modal_data was given, but this model \(DeepseekV4Model\) takes text only"),
    (dict(prompts=["a <image>"], multi_modal_data=[{"image": png()}]), ValueError, "takes text only"),
    (dict(prompt_token_ids=[[5, 6]], multi_modal_data={"image": png()}), ValueError, "takes text only"),
    (dict(prompts=["a", "b"], multi_modal_data={"image": png()}), ValueError,
     "multi_modal_data has 1 entries for 2 prompts"),
    (dict(prompts=[{"prompt": "a", "multi_modal_data": {"image": png()}}], multi_modal_data=[{"image": png()}]),
     ValueError, "in its dict and in the multi_modal_data argument"),
    (dict(prompts=[{"prompt": "a", "prompt_token_ids": [1]}]), ValueError, "needs one of 'prompt'"),
    (dict(prompts=[{"text": "a"}]), ValueError, r"unknown keys \['text'\]"),
    (dict(prompts=[{"prompt": ""}]), ValueError, "must be a non-empty string"),
    (dict(prompts=[3]), TypeError, "expected str or dict"),
])
def test_bad_multimodal_requests_are_refused_and_the_engine_keeps_serving(text_llm, kwargs, error, match):
    with pytest.raises(error, match=match):
        text_llm.generate(sampling_params=GREEDY, use_tqdm=False, **kwargs)
    _still_serves(text_llm)


def test_text_prompt_dicts_equal_strings(text_llm):
    as_str = text_llm.generate(["def fib(n):"], GREEDY, use_tqdm=False)[0]
    as_dict = text_llm.generate({"prompt": "def fib(n):"}, GREEDY, use_tqdm=False)[0]
    as_ids = text_llm.generate([{"prompt_token_ids": as_str.prompt_token_ids, "multi_modal_data": None}], GREEDY,
                               use_tqdm=False)[0]
    assert as_str.outputs[0].token_ids == as_dict.outputs[0].token_ids == as_ids.outputs[0].token_ids
