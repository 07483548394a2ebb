"""Image input through LLM.generate: the request shapes (vLLM's prompt dicts, upstream's
multi_modal_data argument), and every bad input refused with an error that names it while the engine
keeps serving. On a text-only model (a tiny DeepSeek-V4) images are refused as such."""

from __future__ import annotations

import io

import pytest
import torch

from deepinfer import LLM, SamplingParams
from v41_goldens import VL_SKIP_REASON, vision_pngs, vl_registered

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


# ---------------------------------------------------------------- a model with a vision tower
# mini6vl: the tiny DeepSeek-V4.1 with a 2-layer ViT, against DeepSeek's reference (tests/goldens/v41,
# README "Image input"; the encoder alone is checked in tests/oracle/test_v41_vision.py).

vl = pytest.mark.skipif(not vl_registered(), reason=VL_SKIP_REASON)


def vl_llm(**kwargs) -> LLM:
    from v41_goldens import VL_CONFIG, checkpoint_dir

    args = dict(max_num_seqs=4, max_num_batched_tokens=512, num_cache_pages=32, max_model_len=512)
    return LLM(checkpoint_dir(VL_CONFIG), **{**args, **kwargs})


@pytest.fixture(scope="module")
def vl_model():
    return vl_llm()


def _prompt_logprobs(out) -> torch.Tensor:
    ids = out.prompt_token_ids
    return torch.tensor([out.prompt_logprobs[t][ids[t]] for t in range(1, len(ids))])


def _check_against_golden(out) -> None:
    """Prompt log-probs within the reference's own noise (twice its worst probe, mean and max), greedy
    tokens equal while the golden's top-2 gap exceeds the noise's largest flip gap."""
    from v41_goldens import load, vision_e2e_tolerance

    g, tol = load("vision"), vision_e2e_tolerance()
    assert out.prompt_token_ids == g["prompt.ids"].tolist()
    d = (_prompt_logprobs(out) - g["prompt.prefill.logprobs"]).abs()
    print(f"\n|d logprob| mean {d.mean():.4f} max {d.max():.4f} (tolerance {tol['mean']:.4f} / {tol['max']:.4f})")
    assert d.mean() <= tol["mean"] and d.max() <= tol["max"]
    for got, want, gap in zip(out.outputs[0].token_ids, g["prompt.greedy.tokens"].tolist(),
                              g["prompt.greedy.top2_gap"].tolist()):
        if gap <= tol["greedy_gap"]:
            break  # a legitimate flip may happen here and changes everything after it
        assert got == want


@vl
@pytest.mark.parametrize("shape", ["prompt_dict", "argument", "token_ids"])
def test_two_image_prompt_matches_the_reference(vl_model, shape):
    from v41_goldens import load

    g = load("vision")
    params = SamplingParams(max_tokens=g.meta["new_tokens"], temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    text, images = g.meta["prompt_text"], {"image": vision_pngs()}
    if shape == "prompt_dict":
        out = vl_model.generate([{"prompt": text, "multi_modal_data": images}], params, use_tqdm=False)[0]
    elif shape == "argument":  # upstream's multi_modal_data=, the alias placeholder
        out = vl_model.generate([text.replace("<｜deepseek_image｜>", "<image>")], params, use_tqdm=False,
                                multi_modal_data=[images])[0]
    else:
        ids = vl_model.tokenizer.encode(text)
        out = vl_model.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False,
                                multi_modal_data=images)[0]
    _check_against_golden(out)


@vl
def test_chunked_prefill_splits_spans_and_encodes_each_image_once():
    """Chunks of 16 positions cut both image spans: each image is still encoded once, and the result
    equals the unchunked run's."""
    from v41_goldens import load

    g = load("vision")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    prompt = [{"prompt": g.meta["prompt_text"], "multi_modal_data": {"image": vision_pngs()}}]
    whole = vl_llm().generate(prompt, params, use_tqdm=False)[0]
    chunked_llm = vl_llm(max_num_batched_tokens=16)
    chunked = chunked_llm.generate(prompt, params, use_tqdm=False)[0]
    assert chunked_llm.stats()["num_encoded_items"] == 2
    torch.testing.assert_close(_prompt_logprobs(chunked), _prompt_logprobs(whole), rtol=0, atol=1e-4)
    _check_against_golden(chunked)


@vl
def test_images_are_read(vl_model):
    """The embeddings reach the model: other images (or the same two swapped) change the log-probs;
    the same image as bytes, a PIL image or a path gives the same ones."""
    from PIL import Image
    from v41_goldens import load

    g = load("vision")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    a, b = vision_pngs()

    def run(images):
        prompt = {"prompt": g.meta["prompt_text"], "multi_modal_data": {"image": images}}
        return _prompt_logprobs(vl_model.generate([prompt], params, use_tqdm=False)[0])

    base = run([a, b])
    assert torch.equal(run([Image.open(io.BytesIO(a)), b]), base)
    flipped = png(150, 40)  # image 0's size: the same layout, other pixels
    assert not torch.allclose(run([flipped, b]), base, atol=1e-3)


@vl
@pytest.mark.parametrize("request_kwargs,match", [
    (dict(images=[b"not an image", "png"]), "prompt 0: multi_modal_data image 0 .* is not an image Pillow can decode"),
    (dict(images=["png"]), r"2 image placeholder\(s\) .* but multi_modal_data has 1 image"),
    (dict(images=["png", "/no/such.png"]), "multi_modal_data image 1: no file at '/no/such.png'"),
    (dict(images=[{"url": "http://x"}, "png"]), "multi_modal_data image 0 is a dict"),
    (dict(images=None), "holds the model's multimodal placeholder"),  # placeholders, no images
])
def test_bad_image_requests_are_refused_and_the_engine_keeps_serving(vl_model, request_kwargs, match):
    from v41_goldens import load

    text = load("vision").meta["prompt_text"]
    images = request_kwargs["images"]
    images = None if images is None else [png() if x == "png" else x for x in images]
    prompt = {"prompt": text} if images is None else {"prompt": text, "multi_modal_data": {"image": images}}
    with pytest.raises(ValueError, match=match):
        vl_model.generate([prompt], GREEDY, use_tqdm=False)
    _still_serves(vl_model)


@vl
def test_an_image_that_cannot_fit_the_context_is_refused():
    small = vl_llm(max_model_len=48)  # the prompt's two spans alone take 55 positions
    from v41_goldens import load

    prompt = {"prompt": load("vision").meta["prompt_text"], "multi_modal_data": {"image": vision_pngs()}}
    with pytest.raises(ValueError, match=r"prompt 0 has 102 tokens \(55 of them for its 2 multimodal item\(s\)\); "
                                         r"max_model_len=48 .* send fewer images"):
        small.generate([prompt], GREEDY, use_tqdm=False)
    _still_serves(small)


@vl
def test_prefix_cache_hits_only_for_the_same_image(monkeypatch):
    """A repeated image after the same text hits the prefix cache (and, with the image's span outside the
    replayed tail, is not encoded again); another image of the same size in the same place does not hit."""
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "40")  # >= window 32 + backtracking 6
    llm = vl_llm(max_num_seqs=1)
    a = vision_pngs()[0]
    text = "<｜deepseek_image｜> " + "def lookup(self, tokens):\n    return [self.table[t] for t in tokens]\n" * 12
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def run(image):
        before = llm.stats()
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], params, use_tqdm=False)[0]
        after = llm.stats()
        return out, {k: after[k] - before[k] for k in ("prefix_cache_hit_tokens", "num_encoded_items")}

    first, cold = run(a)
    assert len(first.prompt_token_ids) > 256 and cold == {"prefix_cache_hit_tokens": 0, "num_encoded_items": 1}
    again, warm = run(a)
    assert warm["prefix_cache_hit_tokens"] >= 256 and warm["num_encoded_items"] == 0
    assert again.prompt_token_ids == first.prompt_token_ids
    _, other = run(png(150, 40))  # same span length and place, other pixels
    assert other == {"prefix_cache_hit_tokens": 0, "num_encoded_items": 1}


@vl
def test_drafting_with_images_is_lossless(monkeypatch):
    """DSpark drafting (mini6vl carries a stage) over image prompts beside a text prompt: the greedy tokens
    equal those of plain decoding (the drafter reads the backbone's features of the image positions)."""
    from v41_goldens import load

    prompts = [{"prompt": load("vision").meta["prompt_text"], "multi_modal_data": {"image": vision_pngs()}},
               "def lookup(self, tokens):"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in vl_llm().generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    drafting = vl_llm()
    assert drafting.engine.spec is not None
    assert [o.outputs[0].token_ids for o in drafting.generate(prompts, params, use_tqdm=False)] == plain
    assert drafting.stats()["spec_verified"] > 0
