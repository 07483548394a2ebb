"""Image parts of chat messages (entrypoints/chat_images.py): data: URIs only, each a 400 naming the
part when it is anything else; image parts become the model's placeholder where they stood."""

from __future__ import annotations

import base64

import pytest

from deepinfer.entrypoints.chat_images import data_uri_bytes, place_images
from deepinfer.entrypoints.serving import APIError

PNG = b"\x89PNG\r\n\x1a\nnot really, but bytes"
URI = "data:image/png;base64," + base64.b64encode(PNG).decode()


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_uris_decode():
    assert data_uri_bytes(URI, "p") == PNG
    assert data_uri_bytes("data:;base64," + base64.b64encode(PNG).decode(), "p") == PNG  # no media type


@pytest.mark.parametrize("url,match", [
    ("https://example.com/cat.png", "does not fetch URLs or read local files"),
    ("file:///etc/passwd", "does not fetch URLs or read local files"),
    ("/etc/passwd", "does not fetch URLs or read local files"),
    ("data:image/png,rawbytes", "must carry base64 data"),
    ("data:text/plain;base64,aGk=", "media type 'text/plain'"),
    ("data:image/png;base64,@@not base64@@", "not valid base64"),
])
def test_anything_but_a_base64_image_data_uri_is_a_400(url, match):
    with pytest.raises(APIError, match=match) as err:
        data_uri_bytes(url, "messages[1].content[0].image_url.url")
    assert err.value.status == 400 and err.value.param == "messages[1].content[0].image_url.url"


def test_image_parts_become_the_placeholder_in_order():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "compare"}, part(URI),
                                             {"type": "text", "text": "with"}, part(URI.replace("png", "jpeg"))]}]
    out, images = place_images(messages, "<｜deepseek_image｜>")
    assert out[0] == messages[0]
    assert out[1] == {"role": "user", "content": "compare\n<｜deepseek_image｜>\nwith\n<｜deepseek_image｜>"}
    assert images == [PNG, PNG]
    with pytest.raises(APIError, match=r"messages\[1\].content\[1\] is an image, but this model takes text only"):
        place_images(messages, None)
    with pytest.raises(APIError, match="does not fetch URLs") as err:
        place_images([{"role": "user", "content": [part("http://x/y.png")]}], "<image>")
    assert err.value.param == "messages[0].content[0].image_url.url"
