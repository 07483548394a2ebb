"""The routes routers drive a worker with (docs/routers.md), against a server process: SGLang's
/server_info, /model_info, /v1/loads, /health_generate and native /generate; vLLM's /tokenize and
/detokenize; `data_parallel_rank`; X-Request-Id in and out; the router-named gauges; readiness
while the model loads."""

from __future__ import annotations

import json

from conftest import SHIPPED, http

JSON = {"content-type": "application/json"}


def _get(server, path: str) -> dict:
    status, raw = server.get(path)
    assert status == 200, raw
    return json.loads(raw)


def test_metadata_and_loads_in_sglangs_shapes(server):
    # the server listened while the model loaded, answering /health with 503 "loading"
    assert server.starting <= {(503, "loading")} and (503, "loading") in server.starting
    models = _get(server, "/v1/models")["data"]
    assert models[0]["owned_by"] == "sglang" and models[0]["id"] == SHIPPED
    info = _get(server, "/server_info")
    assert info == _get(server, "/get_server_info")
    assert info["served_model_name"] == SHIPPED and info["dp_size"] == 1 and info["disaggregation_mode"] == "null"
    assert info["context_length"] == models[0]["max_model_len"] and info["max_total_num_tokens"] > 0
    model = _get(server, "/model_info")
    assert model == _get(server, "/get_model_info")
    assert model["model_type"] == "deepseek_v41" and model["is_generation"]
    loads = _get(server, "/v1/loads?include=core,disagg,queues,memory")
    assert loads["dp_rank_count"] == 1
    rank = loads["loads"][0]
    assert rank["dp_rank"] == 0 and rank["max_total_num_tokens"] == info["max_total_num_tokens"]
    assert rank["memory"]["token_capacity"] == rank["max_total_num_tokens"] and rank["disaggregation"]["mode"] == "null"
    assert "memory" not in _get(server, "/v1/loads")["loads"][0]  # core only, by default
    status, raw = server.get("/v1/loads?include=core,gpu")
    assert status == 400 and json.loads(raw)["error"]["param"] == "include"
    assert _get(server, "/health_generate")["status"] == "ok" and _get(server, "/liveness")["status"] == "ok"


def test_generate_answers_in_sglangs_shape(server, client):
    greedy = {"max_new_tokens": 12, "temperature": 0}
    status, out = server.post("/generate", {"text": "def fib(n):", "sampling_params": greedy})
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    completion = client.completions.create(model=SHIPPED, prompt="def fib(n):", max_tokens=12, temperature=0.0)
    assert out["text"] == completion.choices[0].text and len(out["output_ids"]) == 12
    assert out["meta_info"]["prompt_tokens"] == completion.usage.prompt_tokens
    # token ids in; a list of prompts with n choices each comes back as a flat list, prompt-major
    ids = [[0, 479, 2056], [0, 479]]
    status, outs = server.post("/generate", {"input_ids": ids, "sampling_params": {**greedy, "max_new_tokens": 4,
                                                                                    "n": 2}})
    assert status == 200 and [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 2, 2]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]  # greedy choices agree
    # a stop string ends it, named in finish_reason
    stop = out["text"][4:7]
    status, stopped = server.post("/generate", {"text": "def fib(n):", "sampling_params": {**greedy, "stop": [stop]}})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # streamed: each event has the output so far; the last equals the whole
    status, raw = http(server.url + "/generate", json.dumps({"text": "def fib(n):", "sampling_params": greedy,
                                                             "stream": True}).encode(), JSON)
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert raw.decode().rstrip().endswith("data: [DONE]") and len(events) > 1
    assert all(a["text"] == b["text"][:len(a["text"])] for a, b in zip(events, events[1:]))
    assert events[-1]["text"] == out["text"] and events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_refusals_name_the_field(server):
    for body, param in [({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
                        ({"text": "x", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
                        ({"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
                        ({"text": "x", "return_logprob": True}, "return_logprob"),
                        ({"text": "x", "rid": "r1"}, "rid"),
                        ({"text": "x", "input_ids": [1]}, "text"),
                        ({"text": "x", "data_parallel_rank": 1}, "data_parallel_rank"),
                        # PD bootstrap fields: all three, and only on a prefill or decode worker
                        ({"text": "x", "bootstrap_room": 7}, "bootstrap_host"),
                        ({"text": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7},
                         "bootstrap_room")]:
        status, out = server.post("/generate", body)
        assert status == 400 and out["error"]["param"] == param, (body, out)
    # what smg adds to every /generate body is accepted
    status, out = server.post("/generate", {"text": "x", "model": "unknown", "log_metrics": True, "stream": False,
                                            "return_text_in_logprobs": False, "return_hidden_states": False,
                                            "sampling_params": {"max_new_tokens": 2}, "data_parallel_rank": 0})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2


def test_tokenize_is_what_the_routes_run(server, client, tokenizer):
    status, out = server.post("/tokenize", {"model": SHIPPED, "prompt": "def fib(n):", "return_token_strs": True})
    assert status == 200 and out["tokens"] == tokenizer.encode("def fib(n):") and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"][1:]) == "def fib(n):"
    messages = [{"role": "system", "content": "# utilities"}, {"role": "user", "content": "def fib(n):"}]
    status, chat = server.post("/tokenize", {"messages": messages})
    reply = client.chat.completions.create(model=SHIPPED, messages=messages, max_tokens=1, temperature=0.0)
    assert status == 200 and chat["count"] == reply.usage.prompt_tokens
    status, back = server.post("/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["prompt"] == "def fib(n):"
    status, bad = server.post("/detokenize", {"tokens": [1 << 30]})
    assert status == 400 and bad["error"]["param"] == "tokens"


def test_request_ids_and_data_parallel_rank(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model=SHIPPED, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "job-17.a"}, extra_body={"data_parallel_rank": 0})
    assert raw.headers["x-request-id"] == "job-17.a" and raw.parse().id == "chatcmpl-job-17.a"
    assert len(client.completions.with_raw_response.create(model=SHIPPED, prompt="x", max_tokens=1)
               .headers["x-request-id"]) >= 16  # made up when not sent
    status, out = server.post("/v1/completions", {"model": SHIPPED, "prompt": "x", "max_tokens": 1}, {"X-Request-Id": "a b"})
    assert status == 400 and out["error"]["param"] == "X-Request-Id"
    status, out = server.post("/v1/completions", {"model": SHIPPED, "prompt": "x", "max_tokens": 1,
                                                  "data_parallel_rank": 1})
    assert status == 400 and out["error"]["param"] == "data_parallel_rank"


def test_router_named_gauges_follow_deepinfers(server):
    m = server.metrics()
    assert m["sglang:num_running_reqs"] == m["vllm:num_requests_running"] == m["deepinfer:num_requests_running"]
    assert m["sglang:num_queue_reqs"] == m["vllm:num_requests_waiting"] == m["deepinfer:num_requests_waiting"]
    assert m["sglang:token_usage"] == m["vllm:kv_cache_usage_perc"] == m["deepinfer:cache_usage_perc"]
    assert m["sglang:cache_hit_rate"] == m["deepinfer:prefix_cache_hit_rate"]
