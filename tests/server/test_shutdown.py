"""SIGTERM: the server stops accepting, a request that can finish within --shutdown-timeout
finishes, one that cannot is aborted (its stream still ends properly), then the process exits."""

from __future__ import annotations

import signal
import threading

import pytest

from conftest import SHIPPED, running_server


def _consume(client, max_tokens: int, out: dict, started: threading.Event):
    stream = client.completions.create(model=SHIPPED, prompt="def main():", temperature=0.0, max_tokens=max_tokens,
                                       stream=True, extra_body={"ignore_eos": True})
    text, reason = "", None
    for chunk in stream:
        started.set()
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    out.update(text=text, reason=reason)


def test_sigterm_finishes_what_it_can_aborts_the_rest_and_exits():
    with running_server("--max-num-seqs", "4", "--shutdown-timeout", "2") as server:
        client = server.client()
        results = {"short": {}, "long": {}}
        # the short one needs well under the grace period; the long one (the whole context) far more
        events = {name: threading.Event() for name in results}
        threads = [threading.Thread(target=_consume, args=(client, n, results[name], events[name]))
                   for name, n in (("short", 200), ("long", 2000))]
        for t in threads:
            t.start()
        for e in events.values():
            assert e.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert results["short"]["reason"] == "length"
        assert results["long"]["reason"] == "abort" and results["long"]["text"]
        assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
        with pytest.raises(OSError):
            server.get("/health")
        log = server.log()
        assert "Application shutdown complete" in log and "Traceback" not in log
