"""benchmarks/serve.py --peer llama-server without building llama.cpp or starting servers: its
arguments, its figures from the client's records, its greedy comparison and the result it writes,
on a fake run whose two "servers" stream known text at known times."""

import json

import pytest
from benchmark_modules import benchmarks_importable

with benchmarks_importable():
    import serve
    import serve_peer


@pytest.fixture(autouse=True)
def _benchmarks_importable():
    """The scripts import their siblings lazily (serve_peer: peers, real_shapes) during a test."""
    with benchmarks_importable():
        yield


def _parse(argv):
    parser = serve.build_parser()
    args = parser.parse_args(argv)
    serve_peer.check_arguments(parser, args)
    return args


@pytest.mark.parametrize("argv, field", [(["--engines", "llama-server,vllm"], "--engines"),
                                         (["--concurrency", "1,x"], "--concurrency"),
                                         (["--concurrency", "0,8"], "--concurrency")])
def test_bad_arguments_name_the_field(argv, field, capsys):
    with pytest.raises(SystemExit):
        _parse(["--peer", "llama-server", *argv])
    assert field in capsys.readouterr().err


def _record(sent: float, pieces: list[tuple[float, str]], tokens: int) -> dict:
    return dict(sent=sent, done=pieces[-1][0], tokens=tokens, chunks=pieces)


def test_figures_from_the_stream():
    # one request: sent at 0, pieces at 0.1 (1 token), 0.3 (2 tokens), 0.4 (1 token)
    records = [_record(0.0, [(0.1, "a"), (0.3, "bc"), (0.4, "d")], 4)]
    m = serve.summarize(records, seconds=0.5)
    assert m["ttft_p50"] == pytest.approx(0.1)
    assert m["itl_p50"] == pytest.approx(0.15)  # gaps 0.2 and 0.1: a piece of two tokens is one gap
    assert m["itl_p99"] == pytest.approx(0.199)
    assert m["tpot_p50"] == pytest.approx(0.1)  # 0.3 s after the first text over 3 tokens
    assert m["tok_s"] == pytest.approx(8.0)
    assert m["tokens_per_chunk"] == pytest.approx(4 / 3)


def test_greedy_comparison_says_where_texts_part():
    ref = [_record(0, [(1, "ab"), (2, "cd"), (3, "ef")], 3), _record(0, [(1, "x"), (2, "y")], 2)]
    other = [_record(0, [(1, "abc"), (2, "Xef")], 3), _record(0, [(1, "xy")], 2)]
    out = serve_peer.compare_greedy(ref, other)
    assert out["completions"] == 2 and out["equal"] == 1
    # "abcdef" vs "abcXef": character 3, in the reference's second piece (index 1), one piece per token
    assert out["first_differences"] == [dict(prompt=0, char=3, piece=1, token_exact=True)]
    # a completion that stops short departs where the shorter one ends
    assert serve_peer.first_difference(["ab", "cd"], "ab") == dict(char=2, piece=1)


def test_every_level_gets_its_own_prompts():
    warmup, prompts = serve_peer.level_prompts(8192, [1, 8, 32], num_prompts=8, prompt_len=16)
    assert len(warmup) == 32 and [len(prompts[c]) for c in (1, 8, 32)] == [8, 16, 64]
    every = [tuple(p) for p in warmup + prompts[1] + prompts[8] + prompts[32]]
    assert len(set(every)) == len(every)  # no prompt cache hit for either server


def test_fake_run_writes_the_comparison_and_the_goal(tmp_path, capsys):
    """Two fake servers on the same prompts: "llama-server" streams one token per piece every
    10 ms; "deepinfer" streams four tokens per piece, twice the throughput, one text different."""
    args = _parse(["--peer", "llama-server", "--engines", "llama-server,deepinfer", "--concurrency", "1,32",
                   "--max-tokens", "8", "--json", str(tmp_path / "out.json")])
    _, prompts = serve_peer.level_prompts(512, args.levels, args.num_prompts, 4)

    def fake(engine, level):
        pieces = 8 if engine == "llama-server" else 2
        gap = 0.01 if engine == "llama-server" else 0.02
        records = []
        for i, _ in enumerate(prompts[level]):
            text = "t" * 8 if engine == "llama-server" or i else "t" * 5 + "x" * 3
            records.append(_record(0.0, [(0.05 + gap * k, text[k * 8 // pieces:(k + 1) * 8 // pieces])
                                         for k in range(pieces)], 8))
        seconds = 1.0 if engine == "llama-server" else 0.5
        summary = serve.summarize(records, seconds)
        summary.update(cpu_ms_per_token=1.0, load_after=(0.0, 0.0, 0.0))
        return summary, records

    rows = serve_peer.measure(args, prompts, fake)
    assert [r["concurrency"] for r in rows] == [1, 32]
    deep = rows[1]["deepinfer"]
    assert deep["tok_s_vs_llama-server"] == pytest.approx(2.0)
    greedy = deep["greedy_vs_llama-server"]
    assert greedy["equal"] == 63 and greedy["first_differences"][0]["piece"] == 5
    goal = serve_peer.goal(rows, args.engine_list)
    assert goal["throughput_c32"] == dict(ratio=pytest.approx(2.0), met=True, against="llama-server")
    assert goal["itl_p50_c1_deepinfer"]["met"] is False  # 20 ms gaps against 10 ms
    serve_peer.print_table(dict(model="v4", prompt_len=4, max_tokens=8, request_rate="inf", threads=2,
                                copy_bandwidth_GBps=10.0, engines=args.engine_list, rows=rows, goal=goal))
    table = capsys.readouterr().out
    assert "| 32 | deepinfer | " in table and "63/64" in table and "NOT met" in table
    json.dumps(rows)  # what main() writes
