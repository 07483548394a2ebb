"""/metrics shows the tiered KV store's hits per tier (L1 = pool hits not loaded from below)."""

from deepinfer.entrypoints.metrics import ServerMetrics
from deepinfer.kv.tiered import KVStoreStats


def test_hits_are_split_by_tier():
    m = ServerMetrics("m")
    snap = {"running": 0, "waiting": 0, "pages_total": 1, "pages_free": 1, "pages_cached": 0, "pages_used": 0,
            "slots_total": 1, "slots_free": 1, "preemptions": 0, "prefix_query_tokens": 1000,
            "prefix_hit_tokens": 896, "prefix_hit_rate": 0.896, "spec_verified": 0, "spec_accepted": 0}
    stats = KVStoreStats(l2_hit_tokens=128, l3_hit_tokens=512, l3_hit_bytes=4096, bad_records=1, l3_bytes=9999)
    snap.update({f"kv_store_{k}": v for k, v in stats.as_dict().items()})
    m.set_snapshot(snap)
    text = m.render().decode()
    for line in ('deepinfer:kv_store_hit_tokens_total{model_name="m",tier="L1"} 256.0',
                 'deepinfer:kv_store_hit_tokens_total{model_name="m",tier="L3"} 512.0',
                 'deepinfer:kv_store_hit_bytes_total{model_name="m",tier="L3"} 4096.0',
                 'deepinfer:kv_store_bytes{model_name="m",tier="L3"} 9999.0',
                 'deepinfer:kv_store_bad_records_total{model_name="m"} 1.0'):
        assert line in text, line
