"""The pieces of E/P/D's encode protocol on their own (kv/encode_protocol.py, kv/encode_client.py,
DeepSeek-V4.1's pack_image / ImageEncoder): bodies frame and unframe; the embedding arena hands out,
merges back and makes a caller wait (bounded) when full; rendezvous hashing keeps an image on its
encoder when another encoder goes; an image's encoder input survives the trip bit for bit and a
damaged one is refused; the vision tower loaded alone encodes exactly as the whole model does."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from deepinfer.kv.encode_client import Arena, EncodeError, EncoderClient
from deepinfer.kv.encode_protocol import frame, unframe
from v41_goldens import VL_CONFIG, VL_SKIP_REASON, checkpoint_dir, vision_pngs, vl_registered

needs_vl = pytest.mark.skipif(not vl_registered(), reason=VL_SKIP_REASON)


def test_frame_round_trip_and_damaged_bodies():
    header, payload = unframe(frame({"items": [1, 2]}, [b"ab", b"cde"]))
    assert header == {"items": [1, 2]} and bytes(payload) == b"abcde"
    body = frame({"a": 1}, b"")
    with pytest.raises(ValueError, match="claims"):
        unframe(body[:-2])
    with pytest.raises(ValueError, match="shorter"):
        unframe(b"\x00")


def test_arena_hands_out_merges_back_and_waits_when_full():
    arena = Arena(100)
    a, b, c = arena.alloc(30, 0), arena.alloc(30, 0), arena.alloc(40, 0)
    assert sorted([a, b, c]) == [0, 30, 60] and arena.free_bytes == 0
    with pytest.raises(EncodeError, match="no room for 10 bytes"):
        arena.alloc(10, 0.05)
    arena.release(b, 30)
    arena.release(a, 30)
    assert arena.alloc(60, 0) == 0  # the two freed neighbours merged into one range

    got = []
    waiter = threading.Thread(target=lambda: got.append(arena.alloc(40, 5)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting for room
    arena.release(c, 40)
    waiter.join(5)
    assert got == [60]
    with pytest.raises(EncodeError, match="more than the whole encoder arena"):
        arena.alloc(101, 0)


def test_rendezvous_keeps_images_on_their_encoder_when_another_goes():
    def order(urls, digest):
        client = EncoderClient.__new__(EncoderClient)  # only the URL list: no transfer engine needed
        client.urls = urls
        return client.order(digest)

    urls = [f"http://127.0.0.1:{8000 + i}" for i in range(3)]
    digests = [os.urandom(16) for _ in range(300)]
    first = {d: order(urls, d)[0] for d in digests}
    assert {u: sum(f == u for f in first.values()) for u in urls} == pytest.approx({u: 100 for u in urls}, abs=40)
    fewer = urls[:1] + urls[2:]
    for d in digests:
        if first[d] != urls[1]:  # only the gone encoder's images move
            assert order(fewer, d)[0] == first[d]
        else:
            assert order(fewer, d)[0] == order(urls, d)[1]  # to the next in their order, as failover does


@needs_vl
def test_an_image_survives_the_trip_and_a_damaged_one_is_refused():
    from deepinfer.models.deepseek_v41.image_processor import process_image
    from deepinfer.models.deepseek_v41.multimodal import ImageEncoder, pack_image
    from deepinfer.models.registry import load_config

    cfg, _ = load_config(checkpoint_dir(VL_CONFIG))
    image = process_image(vision_pngs()[0], cfg.vision)
    header, payload = pack_image(image)
    encoder = ImageEncoder.__new__(ImageEncoder)  # unpack needs the config only
    encoder.cfg = cfg.vision
    back = encoder.unpack(header, payload)
    assert back.grid == image.grid and back.digest == image.digest and torch.equal(back.patches, image.patches)
    damaged = bytearray(payload)
    damaged[100] ^= 0x40
    with pytest.raises(ValueError, match="do not match its digest"):
        encoder.unpack(header, bytes(damaged))
    with pytest.raises(ValueError, match="takes .* bytes, got"):
        encoder.unpack(header, payload[:-2])


@needs_vl
def test_the_tower_loaded_alone_encodes_as_the_whole_model():
    from deepinfer import LLM
    from deepinfer.core.loader import load_checkpoint
    from deepinfer.models.registry import load_config

    model_dir = checkpoint_dir(VL_CONFIG)
    llm = LLM(model_dir, max_model_len=512, num_cache_pages=32)
    try:
        engine = llm.engine
        ids = [5, engine.multimodal_placeholders["<image>"], 6, engine.multimodal_placeholders["<image>"]]
        _, items = engine.process_multimodal(ids, {"image": vision_pngs()})
        whole = engine.model.encode_multimodal(items)
        accel = llm.accel
    finally:
        llm.close()
    cfg, cls = load_config(model_dir)
    weights, _ = load_checkpoint(model_dir, cls.encoder_tensors(cfg), cls, subset=True)
    alone = cls.make_encoder(cfg, weights, accel).encode([item.data for item in items])
    assert len(alone) == 2 and all(torch.equal(a, w) for a, w in zip(alone, whole))
    assert set(weights) == set(cls.encoder_tensors(cfg))  # the tower's tensors, nothing of the language model
