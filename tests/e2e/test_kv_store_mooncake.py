"""The Mooncake Store backend of the tiered KV store against a real `mooncake_master` (the PyPI
package's binary) on 127.0.0.1: a second engine reads the first one's pages through the store, and a
stopped master turns lookups into counted misses while requests are served as without a store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_kv_store import _doc, _kv, _llm, _run, _same

MASTER = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def master():
    if MASTER is None:
        pytest.fail("mooncake_master is missing: pip install -e '.[test]' installs mooncake-transfer-engine-non-cuda")
    port = _free_port()
    proc = subprocess.Popen([MASTER, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}",
                             f"--http_metadata_server_port={_free_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc, f"mooncake://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_pages_go_through_mooncake_store_and_a_stopped_master_is_a_miss(tiny_model_dir, master, monkeypatch):
    proc, url = master
    path = tiny_model_dir[0]
    doc = _doc(700, seed=40)
    a = _llm(path, monkeypatch, kv_store=url, max_num_seqs=1)
    _run(a, [doc[:600]])
    _run(a, [_doc(300, seed=41)])
    warm_a = _run(a, [doc[:650]])
    assert _kv(a)["written_pages"] >= 4
    b = _llm(path, monkeypatch, kv_store=url, max_num_seqs=1)  # A stays: its segment holds the records
    warm_b = _run(b, [doc[:650]])
    stats = _kv(b)
    page = b.engine.cache.page_tokens
    assert stats["l3_hit_tokens"] == (649 // page) * page and stats["bad_records"] == 0
    assert _same(warm_b, warm_a)

    proc.kill()
    proc.wait(timeout=30)
    other = _doc(300, seed=42)
    cold = _run(_llm(path, monkeypatch), [other])
    assert _run(b, [other]) == cold
    after = _kv(b)
    assert after["read_errors"] + after["write_errors"] >= 1
    a.close()
    b.close()
