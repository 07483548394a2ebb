"""Load: 128 concurrent streaming chats, 16 of whose clients disconnect mid-stream. Every other
stream completes; the 16 are aborted; afterwards nothing runs or waits, every cache page is
free or cached, every slot is free, and the server logged no error."""

from __future__ import annotations

import asyncio

from conftest import SHIPPED, wait_until

CLIENTS, LEAVING = 128, 16


async def _chat(client, i: int):
    leaves = i % (CLIENTS // LEAVING) == 0
    stream = await client.chat.completions.create(
        model=SHIPPED, messages=[{"role": "user", "content": f"def helper_{i}(value):"}], temperature=0.0,
        max_tokens=1500 if leaves else 8, stream=True, extra_body={"ignore_eos": True})
    text, reason = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
        if leaves and text:  # mid-stream: it has content and more than a thousand tokens to go
            await stream.close()
            return "left", text, reason
    return "done", text, reason


async def _run(server):
    async with server.async_client() as client:
        return await asyncio.gather(*[_chat(client, i) for i in range(CLIENTS)])


def test_concurrent_streams_with_disconnects_leave_nothing_behind(server):
    aborted = 'deepinfer:request_success_total{finished_reason="abort"}'
    before = server.metrics().get(aborted, 0)
    results = asyncio.run(_run(server))
    done = [r for r in results if r[0] == "done"]
    left = [r for r in results if r[0] == "left"]
    assert len(done) == CLIENTS - LEAVING and len(left) == LEAVING
    assert all(reason == "length" and text for _, text, reason in done)
    assert all(reason is None for _, _, reason in left)

    def settled():
        m = server.metrics()
        return m if m["deepinfer:num_requests_running"] == 0 and m.get(aborted, 0) == before + LEAVING else None

    m = wait_until(settled, 60, "the disconnected requests to be aborted")
    assert m["deepinfer:num_requests_waiting"] == 0
    assert m['deepinfer:cache_pages{state="used"}'] == 0
    assert m['deepinfer:cache_pages{state="free"}'] + m['deepinfer:cache_pages{state="cached"}'] == \
        m["deepinfer:cache_pages_total"]
    assert m["deepinfer:sequence_slots_free"] == m["deepinfer:sequence_slots_total"]
    assert "Traceback" not in server.log() and "ERROR" not in server.log()
