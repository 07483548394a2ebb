"""Image content parts of chat messages. Only `data:` URIs are taken: the server never fetches a URL
or reads a local path named in a request. Each image part becomes the model's placeholder text where
it stood (parts of a message are joined by newlines, as text parts are); the images go to the model's
family (the engine's process_multimodal) in order; a worker with encoder workers (--encoder-urls)
has them encoded there (kv/encode_client.py)."""

from __future__ import annotations

import asyncio
import base64
import binascii

from deepinfer.entrypoints.serving import APIError
from deepinfer.kv.encode_client import EncodeError


def data_uri_bytes(url: str, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URI; anything else is a 400 naming `param`."""
    if not url.startswith("data:"):
        raise APIError(400, f"{param} must be a data: URI (data:image/png;base64,...): this server does not "
                            "fetch URLs or read local files", param)
    header, comma, payload = url[len("data:"):].partition(",")
    fields = header.split(";")
    if not comma or fields[-1] != "base64":
        raise APIError(400, f"{param} must carry base64 data (data:<image type>;base64,<data>)", param)
    if fields[0] and not fields[0].startswith("image/"):
        raise APIError(400, f"{param} has media type {fields[0]!r}; give an image (image/png, image/jpeg, ...)", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: the base64 data is not valid base64", param) from None


def place_images(messages: list[dict], placeholder: str | None) -> tuple[list[dict], list[bytes]]:
    """(messages with each image part replaced by `placeholder`, the images' bytes in order).
    placeholder None: the model takes text only, and an image part is a 400."""
    images, out = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part["type"] == "text":
                    texts.append(part["text"])
                    continue
                if placeholder is None:
                    raise APIError(400, f"messages[{i}].content[{j}] is an image, but this model takes text only "
                                        "(it has no vision encoder)", f"messages[{i}].content[{j}]")
                images.append(data_uri_bytes(part["image_url"]["url"], f"messages[{i}].content[{j}].image_url.url"))
                texts.append(placeholder)
            message = dict(message, content="\n".join(texts))
        out.append(message)
    return out, images


async def lay_out_images(state, ids: list[int], images: list[bytes], field: str) -> tuple[list[int], list]:
    """(prompt ids with each image's span, the MultimodalItems), laid out off the event loop; with
    encoder workers, the embeddings of images the prefix cache does not hold are fetched too (a 503
    naming the encoders when none can)."""
    try:
        return await asyncio.to_thread(_lay_out, state.engine.engine, state.engine.encoders, ids, images, field)
    except ValueError as exc:
        raise APIError(400, str(exc), field) from None
    except EncodeError as exc:
        raise APIError(503, f"the images of {field} could not be encoded: {exc}", field,
                       code="encoder_unavailable", type="server_error") from None


def _lay_out(engine, encoders, ids: list[int], images: list[bytes], field: str) -> tuple[list[int], list]:
    ids, items = engine.process_multimodal(ids, {"image": images}, field)
    if encoders is not None:  # images the prefix cache holds are not sent (a chat's later turns)
        encoders.encode(items, engine.cached_multimodal(ids, items))
    return ids, items
