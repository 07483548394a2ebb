"""Image content parts in /v1/chat/completions against a server process running the tiny DeepSeek-V4.1
with a vision tower (tests/goldens/v41/mini6vl): data: URIs give the same reply as LLM.generate with the
same images, streamed or whole; URLs, paths and undecodable images are 400s naming the part, and the
server keeps serving. (Its tokenizer has no chat markers: the plain chat format, parts joined by newlines.)"""

from __future__ import annotations

import base64

import openai
import pytest

from conftest import running_server
from v41_goldens import VL_CONFIG, VL_SKIP_REASON, checkpoint_dir, vision_pngs, vl_registered

GREEDY = dict(model="mini6vl", temperature=0.0, max_tokens=6)

pytestmark = pytest.mark.skipif(not vl_registered(), reason=VL_SKIP_REASON)


def image_part(data: bytes, kind: str = "png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64," + base64.b64encode(data).decode()}}


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(vision_pngs()[0]),
                                         {"type": "text", "text": "with"}, image_part(vision_pngs()[1])]}]


@pytest.fixture(scope="module")
def vl_server():
    with running_server("--model", str(checkpoint_dir(VL_CONFIG)), "--served-model-name", "mini6vl",
                        "--max-model-len", "512", "--num-cache-pages", "32") as s:
        yield s


@pytest.fixture(scope="module")
def client(vl_server):
    with vl_server.client() as c:
        yield c


def test_chat_with_images_equals_generate(client):
    from deepinfer import LLM, SamplingParams

    whole = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(messages=MESSAGES, stream=True, **GREEDY) if c.choices)
    llm = LLM(checkpoint_dir(VL_CONFIG), max_model_len=512, num_cache_pages=32)
    prompt = {"prompt": "Compare\n<image>\nwith\n<image>\n", "multi_modal_data": {"image": vision_pngs()}}
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert whole.choices[0].message.content == streamed == out.outputs[0].text
    assert whole.usage.prompt_tokens == len(out.prompt_token_ids)  # the spans count as prompt tokens


@pytest.mark.parametrize("part,param,match", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "messages[0].content[1].image_url.url",
     "does not fetch URLs"),
    ({"type": "image_url", "image_url": {"url": "/etc/hostname"}}, "messages[0].content[1].image_url.url",
     "does not fetch URLs or read local files"),
    (image_part(b"certainly not a png"), "messages", "multi_modal_data image 0 .* is not an image Pillow can decode"),
    ({"type": "image_url", "image_url": {"url": "data:text/html;base64,PGI+aGk8L2I+"}},
     "messages[0].content[1].image_url.url", "media type"),
])
def test_bad_image_parts_are_400s_and_the_server_keeps_serving(client, part, param, match):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.chat.completions.create(messages=messages, **GREEDY)
    assert err.value.body["param"] == param
    ok = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_placeholder_in_the_text_is_counted(client):
    """Text that spells the placeholder itself adds a place without an image: a 400, not a silent shift."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "<image> and"}, image_part(vision_pngs()[0])]}]
    with pytest.raises(openai.BadRequestError, match=r"2 image placeholder\(s\) .* has 1 image"):
        client.chat.completions.create(messages=messages, **GREEDY)
