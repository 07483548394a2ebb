"""Encode/prefill/decode disaggregation on 127.0.0.1 with DeepSeek-V4.1's vision checkpoint
(tests/goldens/v41/mini6vl): two encoder workers (--disaggregation-mode encode, the vision tower
alone), a prefill worker sending its images to them (--encoder-urls), a decode worker, smg
--pd-disaggregation in front; with each transfer engine. Image chats through E/P/D equal colocated
LLM.generate (greedy and seeded, whole and streamed), every image is encoded by an encoder worker
and none by prefill, the embedding bytes are the spans' by the model's width and the KV bytes the
cache spec's; an image goes to the same encoder every time. Faults: an encoder killed -9 is failed
over, with none left the request is a 503 naming them and the worker serves on with its arena
whole; a worker that cannot take part refuses at start or names the mismatch."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

from conftest import http, running_server
from pd import TRANSFER_TIMEOUT_S, disagg_stats, pd_args, running_pd_smg, running_prefill, settled
from v41_goldens import VL_CONFIG, VL_SKIP_REASON, checkpoint_dir, vision_pngs, vl_registered

from deepinfer.llm import TINY_DSV4_DIR

pytestmark = pytest.mark.skipif(not vl_registered(), reason=VL_SKIP_REASON)

VL_DIR = str(checkpoint_dir(VL_CONFIG))
ARGS = ("--model", VL_DIR, "--served-model-name", "mini6vl", "--max-model-len", "512", "--num-cache-pages", "32")
GREEDY = {"temperature": 0.0, "max_tokens": 6}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 6, "seed": 1234}


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def messages(images: list[bytes], words: list[str]) -> list[dict]:
    parts = []
    for word, image in zip(words, images):
        parts += [{"type": "text", "text": word}, image_part(image)]
    return [{"role": "user", "content": parts}]


# (messages, the prompt LLM.generate takes for them: the plain chat format joins parts by newlines)
TWO = (messages(vision_pngs(), ["Compare", "with"]), "Compare\n<image>\nwith\n<image>\n", vision_pngs())
ONE = (messages(vision_pngs()[1:], ["Describe"]), "Describe\n<image>\n", vision_pngs()[1:])


def encoder_args(backend: str) -> tuple[str, ...]:
    return ("--model", VL_DIR, "--disaggregation-mode", "encode", "--disaggregation-transfer-backend", backend,
            "--disaggregation-transfer-timeout", str(TRANSFER_TIMEOUT_S))


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def epd(request):
    backend = request.param
    with running_server(*encoder_args(backend)) as e1, running_server(*encoder_args(backend)) as e2, \
            running_prefill(*ARGS, "--encoder-urls", e1.url, e2.url, backend=backend) as prefill, \
            running_server(*ARGS, *pd_args("decode", backend=backend)) as decode, \
            running_pd_smg(prefill, decode) as router:
        yield SimpleNamespace(encoders=[e1, e2], prefill=prefill, decode=decode, router=router, backend=backend)


@pytest.fixture(scope="module")
def vl_llm():
    from deepinfer import LLM

    llm = LLM(VL_DIR, max_model_len=512, num_cache_pages=32)
    yield llm
    llm.close()


def _reference(llm, prompt: str, images: list[bytes], sampling: dict):
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0),
                            max_tokens=sampling["max_tokens"], seq_seed=sampling.get("seed"), top_logprobs=1)
    return llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], params, use_tqdm=False)[0]


def _chat(router, msgs, sampling: dict, stream: bool) -> tuple[str, int | None, list[float] | None]:
    """(text, prompt tokens, the sampled tokens' logprobs); the last two for whole replies only."""
    client = router.client()
    if not stream:
        out = client.chat.completions.create(model="mini6vl", messages=msgs, logprobs=True, **sampling)
        return (out.choices[0].message.content, out.usage.prompt_tokens,
                [t.logprob for t in out.choices[0].logprobs.content])
    chunks = client.chat.completions.create(model="mini6vl", messages=msgs, stream=True, **sampling)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None, None


def test_roles_reported(epd):
    for server in epd.encoders:
        info = json.loads(http(server.url + "/server_info")[1])
        assert info["disaggregation_mode"] == "encode"
        status, raw = http(server.url + "/v1/chat/completions", b"{}", {"content-type": "application/json"})
        assert status == 404 and b"encoder worker" in raw  # generation goes elsewhere, said so
    assert disagg_stats(epd.prefill)["encoders"]["urls"] == [e.url for e in epd.encoders]


@pytest.mark.parametrize("case", [TWO, ONE], ids=["two-images", "one-image"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_images_through_epd_equal_colocated(epd, vl_llm, case, sampling):
    msgs, prompt, images = case
    ref = _reference(vl_llm, prompt, images, sampling)
    span_positions = list(ref.prompt_token_ids).count(vl_llm.engine.multimodal_placeholders["<image>"])
    hidden = vl_llm.engine.model_config.hidden_size
    cache = vl_llm.engine.cache
    for stream in (False, True):
        before = [disagg_stats(e) for e in epd.encoders]
        kv_before = disagg_stats(epd.decode)
        text, prompt_tokens, logprobs = _chat(epd.router, msgs, sampling, stream)
        after = [disagg_stats(e) for e in epd.encoders]
        kv_after = disagg_stats(epd.decode)
        assert text == ref.outputs[0].text, (stream, text, ref.outputs[0].text)
        if prompt_tokens is not None:
            assert prompt_tokens == len(ref.prompt_token_ids)  # the spans count as prompt tokens
            # the embeddings are the colocated encoder's: the sampled tokens' logprobs agree too
            expected = [lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
            assert logprobs == pytest.approx(expected, abs=1e-4)
        # every image went to an encoder worker, its span's embeddings (bf16) written to prefill
        assert sum(a["items"] - b["items"] for a, b in zip(after, before)) == len(images)
        assert sum(a["bytes"] - b["bytes"] for a, b in zip(after, before)) == span_positions * hidden * 2
        # the prompt's state moved to decode as the cache spec says (less pages decode already held)
        pages = cache.pages_for(len(ref.prompt_token_ids))
        sent = kv_after["pages"] - kv_before["pages"]
        skipped = kv_after["skipped_pages"] - kv_before["skipped_pages"]
        assert kv_after["transfers"] - kv_before["transfers"] == 1 and sent + skipped == pages
        assert kv_after["bytes"] - kv_before["bytes"] == cache.bytes_per_slot() + sent * cache.bytes_per_page()
    prefill = disagg_stats(epd.prefill)["encoders"]
    assert prefill["encoded_locally"] == 0 and prefill["failed"] == 0
    assert prefill["arena_free_bytes"] == prefill["arena_bytes"] and prefill["quarantined_bytes"] == 0
    settled(epd.prefill, epd.decode)


def test_an_image_goes_to_the_same_encoder(epd):
    """Rendezvous hashing on the image's digest: the same encoder gets it every time (where its
    caches stay warm)."""
    msgs = ONE[0]
    counts = []
    for _ in range(3):
        before = [disagg_stats(e)["items"] for e in epd.encoders]
        _chat(epd.router, msgs, GREEDY, stream=False)
        counts.append(tuple(disagg_stats(e)["items"] - b for e, b in zip(epd.encoders, before)))
    assert len(set(counts)) == 1 and sorted(counts[0]) == [0, 1], counts


WORDS = "cache page router worker token prefix replica engine request stream latency batch decode".split()
LONG_TEXT = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(90))


def test_a_later_turn_does_not_resend_a_cached_image(epd, vl_llm):
    """The same image-led conversation twice (a chat's next turn re-sends its images): the second
    time the prefill's prefix cache holds the image's pages, so no encoder is called for it, and
    the text equals colocated serving's second run (the same prefix-cache hit)."""
    from deepinfer import SamplingParams

    image = vision_pngs()[0]
    msgs = [{"role": "user", "content": [image_part(image), {"type": "text", "text": LONG_TEXT}]}]
    prompt = {"prompt": "<image>\n" + LONG_TEXT + "\n", "multi_modal_data": {"image": [image]}}
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"])
    colocated = [vl_llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2)]
    assert len(colocated[0].prompt_token_ids) > 300
    served, sent = [], []
    for _ in range(2):
        before = disagg_stats(epd.prefill)["encoders"]
        served.append(_chat(epd.router, msgs, GREEDY, stream=False)[0])
        after = disagg_stats(epd.prefill)["encoders"]
        sent.append((after["items"] - before["items"], after["cached"] - before["cached"]))
    assert sent == [(1, 0), (0, 1)]
    assert served == [c.outputs[0].text for c in colocated]
    assert disagg_stats(epd.prefill)["encoders"]["encoded_locally"] == 0
    settled(epd.prefill, epd.decode)


def _kill(server) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)


def test_encoder_killed_is_failed_over_then_named_and_nothing_is_stranded():
    """Colocated prefill+decode with two encoder workers: kill the image's encoder -9 and the other
    serves it (same text); kill that one too and the request is a 503 naming both, within the
    timeout, while text requests are served and the embedding arena is whole again."""
    msgs, prompt, images = ONE
    with running_server(*encoder_args("mooncake")) as e1, running_server(*encoder_args("mooncake")) as e2, \
            running_server(*ARGS, "--encoder-urls", e1.url, e2.url) as worker:
        client = worker.client()
        first = client.chat.completions.create(model="mini6vl", messages=msgs, **GREEDY).choices[0].message.content
        used = [e for e in (e1, e2) if disagg_stats(e)["items"] == 1]
        assert len(used) == 1
        chosen, other = used[0], (e2 if used[0] is e1 else e1)
        _kill(chosen)
        again = client.chat.completions.create(model="mini6vl", messages=msgs, **GREEDY).choices[0].message.content
        assert again == first and disagg_stats(other)["items"] == 1
        assert disagg_stats(worker)["encoders"]["failovers"] >= 1
        _kill(other)
        import openai

        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="mini6vl", messages=msgs, **GREEDY)
        assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S + 5
        assert err.value.status_code == 503
        message = err.value.body["message"]
        assert "no encoder worker could be reached" in message and e1.url in message and e2.url in message
        text = client.chat.completions.create(model="mini6vl", messages=[{"role": "user", "content": "hello"}],
                                              **GREEDY)
        assert text.choices[0].finish_reason in ("stop", "length")
        stats = disagg_stats(worker)["encoders"]
        assert stats["arena_free_bytes"] == stats["arena_bytes"] and stats["quarantined_bytes"] == 0
        assert stats["encoded_locally"] == 0 and stats["failed"] == 1


def test_mismatched_transfer_engines_are_named():
    with running_server(*encoder_args("mooncake")) as encoder, \
            running_server(*ARGS, "--encoder-urls", encoder.url, "--disaggregation-transfer-backend", "nixl") as worker:
        status, body = worker.post("/v1/chat/completions", {"model": "mini6vl", "messages": ONE[0], **GREEDY})
        assert status == 503
        assert "moves embeddings with 'mooncake', this worker with 'nixl'" in body["error"]["message"]
        assert disagg_stats(encoder)["items"] == 0


@pytest.mark.parametrize("args,match", [
    (("--model", TINY_DSV4_DIR, "--disaggregation-mode", "encode"), "takes text only"),
    (("--model", TINY_DSV4_DIR, "--encoder-urls", "http://127.0.0.1:9"), "--encoder-urls: this model takes text only"),
    (("--model", VL_DIR, "--disaggregation-mode", "decode", "--encoder-urls", "http://127.0.0.1:9"),
     "a decode worker never encodes images"),
], ids=["encoder-of-a-text-model", "prefill-of-a-text-model", "decode-with-encoders"])
def test_workers_that_cannot_take_part_refuse_at_start(args, match):
    with pytest.raises(AssertionError, match=match):
        with running_server(*args, startup_timeout=60):
            pass
