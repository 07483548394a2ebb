"""The file store's byte budget (kv/file_store.py): `file:///dir?max_bytes=N` evicts the least
recently used records past it and says which (the tiered store turns them into KV events), and a
bad budget is an error naming the field."""

from __future__ import annotations

import os

import pytest

from deepinfer.kv.page_store import open_page_store


def test_records_past_the_budget_go_least_recently_used_first(tmp_path):
    store = open_page_store(f"file://{tmp_path}?max_bytes=350")
    assert store.batch_put(["k1", "k2", "k3"], [b"a" * 100] * 3) == []
    now = os.path.getmtime(store._path("k1"))
    for age, key in ((90, "k1"), (60, "k2"), (30, "k3")):  # written in this order
        os.utime(store._path(key), (now - age, now - age))
    store.batch_get(["k1"])  # read: the most recently used
    assert store.batch_put(["k4"], [b"b" * 100]) == ["k2"]  # 400 > 350: down to 90% of it
    assert store.batch_exists(["k1"]) == 1 and store.batch_exists(["k2"]) == 0
    assert store.size_bytes() == 300


@pytest.mark.parametrize("url, field", [("file:///tmp/x?max_bytes=-1", "max_bytes"),
                                        ("file:///tmp/x?max_bytes=8G", "max_bytes"),
                                        ("file:///tmp/x?budget=1", "max_bytes")])
def test_a_bad_budget_names_the_field(url, field):
    with pytest.raises(ValueError, match=field):
        open_page_store(url)
