"""GET /metrics: Prometheus text with requests by finish reason, token counters, latency
histograms, cache pages and the prefix cache's hit rate, each moving as requests run."""

from __future__ import annotations

from conftest import SHIPPED


def test_metrics_follow_the_requests(server, client, tokenizer):
    status, raw = server.get("/metrics")
    assert status == 200 and b"# TYPE deepinfer:time_to_first_token_seconds histogram" in raw
    before = server.metrics()
    # a prompt of several full cache pages (128 tokens each), twice: the second finds them cached
    prompt = "".join(f"def function_{i}(argument):\n    return argument * {i}\n\n" for i in range(40))
    full_pages = (len(tokenizer.encode(prompt)) - 1) // 128  # a hit leaves at least the last token to compute
    assert full_pages >= 3
    for _ in range(2):
        client.completions.create(model=SHIPPED, prompt=prompt, max_tokens=5, temperature=0.0)
    stopped = client.completions.create(model=SHIPPED, prompt="def f(x):", max_tokens=40, temperature=0.0, stop=["\n"])
    assert stopped.choices[0].finish_reason == "stop"
    after = server.metrics()

    def grew(name, by=None):
        delta = after.get(name, 0) - before.get(name, 0)
        return delta == by if by is not None else delta > 0

    assert grew('deepinfer:request_success_total{finished_reason="length"}', 2)
    assert grew('deepinfer:request_success_total{finished_reason="stop"}', 1)
    n_prompt = 2 * len(tokenizer.encode(prompt)) + stopped.usage.prompt_tokens
    assert grew("deepinfer:prompt_tokens_total", n_prompt)
    assert grew("deepinfer:generation_tokens_total", 10 + stopped.usage.completion_tokens)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"deepinfer:{name}_count", 3) and grew(f"deepinfer:{name}_sum")
    # TPOT: per request with more than one token
    assert grew("deepinfer:time_per_output_token_seconds_count", 2 + (stopped.usage.completion_tokens > 1))
    assert grew("deepinfer:prefix_cache_hits_total", full_pages * 128)  # the second request's full pages
    assert 0 < after["deepinfer:prefix_cache_hit_rate"] <= 1
    assert after['deepinfer:cache_pages{state="cached"}'] >= full_pages  # idle, kept for the next hit
    pages = sum(after[f'deepinfer:cache_pages{{state="{s}"}}'] for s in ("used", "cached", "free"))
    assert pages == after["deepinfer:cache_pages_total"]
    assert after["deepinfer:num_requests_running"] == 0 and after["deepinfer:cache_usage_perc"] == 0
