"""Prometheus metrics of a server (`GET /metrics`), named like vLLM's with a `deepinfer:` prefix.

Request-level series (finish reasons, token counts, latency histograms) are updated by the
engine thread as it publishes outputs; engine state (running/waiting, cache pages, prefix
cache, DSpark acceptance) is a snapshot the same thread takes after every step, so a scrape
never reads the engine while it changes. Each server has its own registry. A few gauges are
repeated under the names routers read (SGLang's and vLLM's, _router_aliases).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds; TPOT buckets are finer (a decode step is milliseconds)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        kw = dict(registry=self.registry, labelnames=list(labels))
        self.finished = Counter("deepinfer:request_success", "Finished requests by finish reason",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("deepinfer:prompt_tokens", "Prompt tokens of accepted requests", **kw)
        self.generation_tokens = Counter("deepinfer:generation_tokens", "Generated tokens", **kw)
        self.ttft = Histogram("deepinfer:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, **kw)
        self.tpot = Histogram("deepinfer:time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TPOT, **kw)
        self.e2e = Histogram("deepinfer:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY, **kw)
        self.snapshot: dict = {}
        self.registry.register(_EngineCollector(self))

    # engine thread
    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(**self._labels).inc(num_prompt_tokens)

    def on_progress(self, live, delta, now: float) -> None:
        """A delta of one request was published at `now` (perf_counter seconds)."""
        if delta.token_ids:
            self.generation_tokens.labels(**self._labels).inc(len(delta.token_ids))
            if live.sent_tokens == len(delta.token_ids):  # its first tokens
                self.ttft.labels(**self._labels).observe(now - live.arrival)
        if delta.finished:
            self.finished.labels(finished_reason=delta.finish_reason or "abort", **self._labels).inc()
            self.e2e.labels(**self._labels).observe(now - live.arrival)
            if live.first_token_time is not None and live.sent_tokens > 1:
                self.tpot.labels(**self._labels).observe((now - live.first_token_time) / (live.sent_tokens - 1))

    def update_engine(self, engine, num_waiting: int, stats: dict | None = None) -> None:
        self.snapshot = engine_snapshot(engine, num_waiting, stats)

    def set_snapshot(self, snapshot: dict) -> None:
        """Engine state taken elsewhere (the ranks of a data-parallel instance, summed)."""
        self.snapshot = snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_snapshot(engine, num_waiting: int, stats: dict | None = None) -> dict:
    """The engine state the gauges show, read by the thread that steps `engine` (`stats`: its
    engine.stats() when the caller has them, as every step's publishing does for engine_load too)."""
    cache = engine.cache
    free = len(cache.free_pages)
    cached = len(cache.prefix.idle) if cache.prefix is not None else 0
    stats = engine.stats() if stats is None else stats
    return {
        "running": len(engine.scheduler.running), "waiting": num_waiting,
        "pages_total": cache.num_pages, "pages_free": free, "pages_cached": cached,
        "pages_used": cache.num_pages - free - cached,
        "slots_total": cache.max_seqs, "slots_free": cache.num_free_slots,
        "preemptions": stats.get("num_preemptions", 0),
        "prefix_query_tokens": stats.get("prefix_cache_query_tokens", 0),
        "prefix_hit_tokens": stats.get("prefix_cache_hit_tokens", 0),
        "prefix_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),
        "spec_verified": stats.get("spec_verified", 0), "spec_accepted": stats.get("spec_accepted", 0),
        **{key: value for key, value in stats.items() if key.startswith("kv_store_")},
    }


def engine_load(engine, dp_rank: int, num_waiting: int, prompt_tokens_total: int, stats: dict | None = None) -> dict:
    """One data-parallel rank's load as SGLang's /v1/loads reports it (its `core` fields), read by the
    thread that steps `engine`. Tokens are cache pages x page size: pages held by running sequences
    count as used, idle prefix-cache pages do not (they are free to evict)."""
    cache = engine.cache
    idle = len(cache.prefix.idle) if cache.prefix is not None else 0
    used = (cache.num_pages - len(cache.free_pages) - idle) * cache.page_tokens
    total = cache.num_pages * cache.page_tokens
    stats = engine.stats() if stats is None else stats
    return {"dp_rank": dp_rank, "num_running_reqs": len(engine.scheduler.running), "num_waiting_reqs": num_waiting,
            "num_used_tokens": used, "max_total_num_tokens": total, "token_usage": used / total if total else 0.0,
            "cache_hit_rate": stats.get("prefix_cache_hit_rate", 0.0), "max_running_requests": cache.max_seqs,
            "cached_tokens_total": int(stats.get("prefix_cache_hit_tokens", 0)),
            "prompt_tokens_total": prompt_tokens_total}


def combine_snapshots(snapshots: list[dict]) -> dict:
    """Several engines' snapshots as one: counts summed, the hit rate recomputed from the sums."""
    if not snapshots:
        return {}
    total = {key: sum(s[key] for s in snapshots) for key in snapshots[0]}
    queried = total["prefix_query_tokens"]
    total["prefix_hit_rate"] = total["prefix_hit_tokens"] / queried if queried else 0.0
    return total


def _router_aliases(gauge, s: dict):
    """The same engine state under the names routers read, and only those: smg reads SGLang's gauges
    when a worker's /v1/loads does not answer (worker/monitor.rs); llm-d's endpoint picker (and smg's
    vLLM path, and KEDA recipes) read vLLM's."""
    usage = s["pages_used"] / s["pages_total"] if s["pages_total"] else 0.0
    yield gauge("sglang:num_running_reqs", "Requests in the running batch (SGLang's name)", s["running"])
    yield gauge("sglang:num_queue_reqs", "Accepted requests not running (SGLang's name)", s["waiting"])
    yield gauge("sglang:token_usage", "Fraction of cache pages held by sequences (SGLang's name)", usage)
    yield gauge("sglang:cache_hit_rate", "Prefix cache hit tokens / queried tokens (SGLang's name)",
                s["prefix_hit_rate"])
    yield gauge("vllm:num_requests_running", "Requests in the running batch (vLLM's name)", s["running"])
    yield gauge("vllm:num_requests_waiting", "Accepted requests not running (vLLM's name)", s["waiting"])
    yield gauge("vllm:kv_cache_usage_perc", "Fraction of cache pages held by sequences (vLLM's name)", usage)


class _EngineCollector:
    """Engine state from the last snapshot, read at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.snapshot
        if not s:
            return
        names = list(self.metrics._labels)
        values = list(self.metrics._labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("deepinfer:num_requests_running", "Requests in the running batch", s["running"])
        yield gauge("deepinfer:num_requests_waiting", "Accepted requests not running (queued, compiling a "
                    "grammar, preempted)", s["waiting"])
        pages = GaugeMetricFamily("deepinfer:cache_pages", "Decode-state cache pages by state: used (held by a "
                                  "sequence), cached (idle, in the prefix cache), free", labels=names + ["state"])
        for state in ("used", "cached", "free"):
            pages.add_metric(values + [state], s[f"pages_{state}"])
        yield pages
        yield gauge("deepinfer:cache_pages_total", "Decode-state cache pages", s["pages_total"])
        yield gauge("deepinfer:cache_usage_perc", "Fraction of cache pages held by sequences",
                    s["pages_used"] / s["pages_total"] if s["pages_total"] else 0.0)
        yield gauge("deepinfer:sequence_slots_free", "Free sequence slots", s["slots_free"])
        yield gauge("deepinfer:sequence_slots_total", "Sequence slots", s["slots_total"])
        yield counter("deepinfer:num_preemptions", "Preemptions", s["preemptions"])
        yield counter("deepinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s["prefix_query_tokens"])
        yield counter("deepinfer:prefix_cache_hits", "Prompt tokens found in the prefix cache", s["prefix_hit_tokens"])
        yield gauge("deepinfer:prefix_cache_hit_rate", "Prefix cache hit tokens / queried tokens since start",
                    s["prefix_hit_rate"])
        yield from _router_aliases(gauge, s)
        yield counter("deepinfer:spec_decode_num_draft_tokens", "DSpark draft tokens verified", s["spec_verified"])
        yield counter("deepinfer:spec_decode_num_accepted_tokens", "DSpark draft tokens accepted", s["spec_accepted"])
        if "kv_store_l3_bytes" in s:
            yield from _kv_store_metrics(s, names, values, counter)
        yield gauge("deepinfer:spec_decode_acceptance_rate", "DSpark accepted / verified draft tokens since start",
                    s["spec_accepted"] / s["spec_verified"] if s["spec_verified"] else 0.0)


def _kv_store_metrics(s: dict, names: list, values: list, counter):
    """The tiered prefix store's series (deepinfer/kv, docs/kv-store.md): hits per tier (L1 the cache
    pool, L2 host memory, L3 the page store), fetches, integrity and store sizes."""
    l2, l3 = s["kv_store_l2_hit_tokens"], s["kv_store_l3_hit_tokens"]
    hits = CounterMetricFamily("deepinfer:kv_store_hit_tokens", "Prompt tokens served from each tier (L1 the cache "
                               "pool, L2 host memory, L3 the page store)", labels=names + ["tier"])
    for tier, value in (("L1", max(s["prefix_hit_tokens"] - l2 - l3, 0)), ("L2", l2), ("L3", l3)):
        hits.add_metric(values + [tier], value)
    yield hits
    hit_bytes = CounterMetricFamily("deepinfer:kv_store_hit_bytes", "Page bytes loaded into the cache pool from "
                                    "each lower tier", labels=names + ["tier"])
    for tier in ("L2", "L3"):
        hit_bytes.add_metric(values + [tier], s[f"kv_store_{tier.lower()}_hit_bytes"])
    yield hit_bytes
    size = GaugeMetricFamily("deepinfer:kv_store_bytes", "Bytes each lower tier holds", labels=names + ["tier"])
    size.add_metric(values + ["L2"], s["kv_store_l2_bytes"])
    size.add_metric(values + ["L3"], s["kv_store_l3_bytes"])
    yield size
    yield counter("deepinfer:kv_store_fetches", "Page-store lookups started on admission", s["kv_store_l3_lookups"])
    yield counter("deepinfer:kv_store_fetch_seconds", "Seconds spent in page-store fetches (lookup, read, "
                  "verify), summed", s["kv_store_fetch_seconds"])
    yield counter("deepinfer:kv_store_written_pages", "Pages written to the page store", s["kv_store_written_pages"])
    yield counter("deepinfer:kv_store_bad_records", "Page records rejected (corrupt, truncated, another model's, "
                  "vanished) and recomputed", s["kv_store_bad_records"])
    errors = CounterMetricFamily("deepinfer:kv_store_errors", "Page-store operations that failed (unreachable, "
                                 "full, read-only); pages dropped by a writer that fell behind count as write",
                                 labels=names + ["op"])
    errors.add_metric(values + ["read"], s["kv_store_read_errors"])
    errors.add_metric(values + ["write"], s["kv_store_write_errors"] + s["kv_store_dropped_writes"])
    yield errors
