"""Structured outputs (so_args) end to end on tiny random V4 and V3 models: random weights at
temperature 1.0 produce arbitrary tokens, so only the grammar keeps outputs valid."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest
import torch
import xgrammar as xgr

from deepinfer import LLM, SamplingParams
from deepinfer.core.structured import RequestGrammar

SEEDS = range(24)
PROMPT = [0, 17, 42, 99, 7]

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -50, "maximum": 5000},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "kind": {"enum": ["cat", "dog", 3, None]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "pts": {"type": "array", "items": {"type": "integer",
                                                                                          "minimum": 0,
                                                                                          "maximum": 99},
                                                                "maxItems": 2}},
            "required": ["ok"],
        },
    },
    "required": ["id", "name", "kind", "tags", "owner"],
}
REGEXES = [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no|maybe)( [A-Z]+)?", r"\(\d+(, \d+){0,3}\)", r"[a-f0-9]{8}"]
EBNF = r"""
root ::= "call " name "(" args? ")"
args ::= value ("," " "? value)*
value ::= number | string | list
list ::= "[" (number ("," number)*)? "]"
number ::= "-"? [0-9]+
string ::= "'" [a-z ]* "'"
name ::= [a-z_]+
"""
LARK = r"""
start: "call " NAME "(" [args] ")"
args: value ("," [" "] value)*
?value: NUMBER | STRING | list
list: "[" [NUMBER ("," NUMBER)*] "]"
NUMBER: /-?[0-9]+/
STRING: /'[a-z ]*'/
NAME: /[a-z_]+/
"""


def _huge_enum(n: int) -> dict:
    """Cheap to check, seconds to compile (every token against every word): a stand-in for the
    runaway compiles users hit with nested anyOf, but bounded, so the orphaned compile ends soon."""
    gen = torch.Generator().manual_seed(n)
    letters = torch.randint(0, 26, (n, 12), generator=gen).tolist()
    return {"enum": ["".join(chr(97 + c) for c in word) for word in letters]}


def _llm(path) -> LLM:
    return LLM(path, max_num_seqs=32, max_num_batched_tokens=512, num_cache_pages=96)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return _llm(tiny_model_dir[0])


@pytest.fixture(scope="module")
def family_llm(family_model_dir):
    """The outputs' validity depends on the grammar, not on the model: each family's tiny model."""
    return _llm(family_model_dir[0])


def _params(so_args=None, seed=0, max_tokens=200, **kw):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seq_seed=seed, so_args=so_args, **kw)


def _text(llm, out) -> str:
    """The generated text without the final stop token."""
    ids = [t for t in out.outputs[0].token_ids if t not in (1,)]
    return llm.tokenizer.decode(ids)


def test_json_schema_outputs_validate(family_llm):
    llm = family_llm
    outs = llm.generate(prompt_token_ids=[PROMPT] * len(SEEDS), use_tqdm=False,
                        sampling_params=[_params({"schema_type": "json", "schema": SCHEMA}, s) for s in SEEDS])
    as_string = llm.generate(prompt_token_ids=[PROMPT] * 4, use_tqdm=False,  # the schema as a JSON string
                             sampling_params=[_params({"schema_type": "json", "schema": json.dumps(SCHEMA)}, s)
                                              for s in SEEDS[:4]])
    assert [o.outputs[0].token_ids for o in as_string] == [o.outputs[0].token_ids for o in outs[:4]]
    seen_optional = set()
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text, c.error)
        assert c.token_ids[-1] == 1  # the grammar ended on eos
        # strict=False: xgrammar 0.2.8 lets raw control characters into maxLength strings
        value = json.loads(c.text, strict=False)
        jsonschema.validate(value, SCHEMA)
        skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text)  # no whitespace beyond ", " and ": "
        assert all(ch == " " and skeleton[i - 1] in ",:" for i, ch in enumerate(skeleton) if ch.isspace()), c.text
        seen_optional |= set(value) & {"score"} | set(value["owner"]) & {"pts"}
    assert seen_optional == {"score", "pts"}  # optional properties are generated too
    assert len({o.outputs[0].text for o in outs}) == len(outs)  # sampling did vary


def test_regex_outputs_fullmatch(llm):
    # V4 only: whether a random model ends an unbounded `[A-Z]+` within max_tokens is up to its weights
    params = [_params({"schema_type": "regex", "schema": rx}, s, max_tokens=64) for rx in REGEXES for s in SEEDS[:8]]
    outs = llm.generate(prompt_token_ids=[PROMPT] * len(params), sampling_params=params, use_tqdm=False)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        assert re.fullmatch(p.so_args["schema"], c.text), (p.so_args["schema"], c.text)
        assert c.text == _text(llm, out)


def test_ebnf_outputs_parse_with_lark(family_llm):
    llm = family_llm
    parser = lark.Lark(LARK, parser="earley")
    outs = llm.generate(prompt_token_ids=[PROMPT] * len(SEEDS), use_tqdm=False,
                        sampling_params=[_params({"schema_type": "ebnf", "schema": EBNF}, s) for s in SEEDS])
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= len(SEEDS) * 3 // 4  # arbitrarily long args may hit max_tokens; most end
    for c in stopped:
        parser.parse(c.text)
    for out in outs:  # a cut-off output is still a prefix of the language
        assert out.outputs[0].text.startswith("call ")


def test_mixed_batch_leaves_free_requests_untouched(family_llm):
    llm = family_llm
    free = [_params(None, 100 + s, max_tokens=24, ignore_eos=True) for s in range(4)]
    alone = llm.generate(prompt_token_ids=[PROMPT] * 4, sampling_params=free, use_tqdm=False)
    mixed_params = []
    for s in range(4):
        mixed_params += [free[s], _params({"schema_type": "regex", "schema": REGEXES[s]}, s, max_tokens=64),
                         _params({"schema_type": "json", "schema": SCHEMA}, s)]
    mixed = llm.generate(prompt_token_ids=[PROMPT] * len(mixed_params), sampling_params=mixed_params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[0::3]] == [o.outputs[0].token_ids for o in alone]
    for p, out in zip(mixed_params[1::3], mixed[1::3]):
        assert re.fullmatch(p.so_args["schema"], out.outputs[0].text)
    for out in mixed[2::3]:
        jsonschema.validate(json.loads(out.outputs[0].text, strict=False), SCHEMA)


def test_compile_timeout_aborts_only_that_request(llm, monkeypatch):
    monkeypatch.setenv("DEEPINFER_XGRAMMAR_TIMEOUT", "0.05")
    slow = {"schema_type": "json", "schema": _huge_enum(20000)}  # about 1.5 s of compile
    params = [_params(None, 1, max_tokens=8), _params(slow, 2),
              _params({"schema_type": "regex", "schema": REGEXES[0]}, 3, max_tokens=64)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * 3, sampling_params=params, use_tqdm=False)
    free, timed_out, regex = (o.outputs[0] for o in outs)
    assert timed_out.finish_reason == "abort" and timed_out.token_ids == []
    assert "DEEPINFER_XGRAMMAR_TIMEOUT" in timed_out.error
    assert free.finish_reason in ("length", "stop") and free.error is None
    assert regex.finish_reason == "stop" and re.fullmatch(REGEXES[0], regex.text)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("so_args, words", [
    ({"schema_type": "regex", "schema": "([a-z]"}, "parenthesis"),
    ({"schema_type": "ebnf", "schema": 'root ::= "a" missing'}, "missing"),
    ({"schema_type": "json", "schema": {"type": "colour"}}, "colour"),
    ({"schema_type": "json", "schema": {"type": "object", "required": 5}}, "required"),
    ({"schema_type": "regex", "schema": "a+", "trigger_token_ids": [10**6]}, "vocabulary"),
])
def test_invalid_grammars_are_rejected_at_submit(llm, so_args, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(prompt_token_ids=[PROMPT, PROMPT], use_tqdm=False,
                     sampling_params=[_params(None), _params(so_args)])
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=_params(None, max_tokens=2),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_late_compile_failure_ends_only_that_request(llm, monkeypatch):
    import time

    from deepinfer.core import structured

    service = llm.engine._structured()
    compile_ = service._compile

    def slow_then_fail(schema_type, schema):
        if schema == "a+b":
            time.sleep(0.3)
            raise RuntimeError("made-up late failure")
        return compile_(schema_type, schema)

    monkeypatch.setattr(structured, "_CHECK_WAIT_S", 0.0)
    monkeypatch.setattr(service, "_compile", slow_then_fail)
    params = [_params({"schema_type": "regex", "schema": "a+b"}, 1), _params(None, 2, max_tokens=6),
              _params({"schema_type": "regex", "schema": REGEXES[1]}, 3, max_tokens=32)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * 3, sampling_params=params, use_tqdm=False)
    failed, free, ok = (o.outputs[0] for o in outs)
    assert failed.finish_reason == "abort" and "made-up late failure" in failed.error and not failed.token_ids
    assert free.finish_reason in ("length", "stop") and len(free.token_ids) <= 6
    assert ok.finish_reason == "stop" and re.fullmatch(REGEXES[1], ok.text)


def test_json_schema_must_parse():
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(so_args={"schema_type": "json", "schema": "{nope"})


def _first_pair(tokens: list[int]) -> int:
    """Index j >= 2 where (tokens[j], tokens[j+1]) first appears (not earlier in the list)."""
    for j in range(2, len(tokens) - 1):
        pair = tokens[j:j + 2]
        if not any(tokens[i:i + 2] == pair for i in range(j)):
            return j
    raise AssertionError("no fresh pair")


def test_trigger_starts_the_grammar(llm):
    regex = r"[0-9]{2,4}"
    for seed in range(2):
        free = llm.generate(prompt_token_ids=[PROMPT], sampling_params=_params(None, seed, 40, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        j = _first_pair(free)
        trigger = free[j:j + 2]
        out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=_params(
            {"schema_type": "regex", "schema": regex, "trigger_token_ids": trigger}, seed, 40, ignore_eos=True))
        c = out[0].outputs[0]
        assert c.token_ids[:j + 2] == free[:j + 2]  # free generation until the trigger, unchanged
        assert c.finish_reason == "stop" and c.token_ids[-1] == 1
        assert re.fullmatch(regex, llm.tokenizer.decode(c.token_ids[j + 2:-1]))


def test_bound_forces_the_trigger(llm):
    regex = r"(ab|cd)+!"
    trigger = [llm.tokenizer.encode(x)[-1] for x in ("<", ">")]
    for seed in range(2):
        free = llm.generate(prompt_token_ids=[PROMPT], sampling_params=_params(None, seed, 40, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        j = 3
        while free[j] in free[:j] or free[j] in trigger:
            j += 1
        so = {"schema_type": "regex", "schema": regex, "trigger_token_ids": trigger, "bound_token_id": free[j]}
        c = llm.generate(prompt_token_ids=[PROMPT], sampling_params=_params(so, seed, 60, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
        assert c.token_ids[:j + 1] == free[:j + 1]
        assert c.token_ids[j + 1:j + 3] == trigger  # forced right after the bound token
        assert c.finish_reason == "stop"
        assert re.fullmatch(regex, llm.tokenizer.decode(c.token_ids[j + 3:-1]))
        # the bound token is the trigger's first token: only the rest is forced
        so = dict(so, bound_token_id=trigger[0])
        c = llm.generate(prompt_token_ids=[PROMPT], sampling_params=_params(so, seed, 60, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
        if trigger[0] in c.token_ids[:-1]:
            k = c.token_ids.index(trigger[0])
            assert c.token_ids[k + 1] == trigger[1]


def _mask_list(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def test_fill_bitmask_rows_matches_sequential_fill_and_rolls_back(llm):
    service = llm.engine._structured()
    vocab = service.vocab_size
    compiled = service._compile("regex", r"\[[0-9]{1,3}(,[0-9]{1,3})*\]")
    enc = llm.tokenizer._tok.encode
    drafts = enc("[12,345,6]", add_special_tokens=False).ids + [1]
    bitmask = xgr.allocate_token_bitmask(len(drafts) + 16, vocab)

    def sequential(grammar, tokens):
        rows = []
        for t in tokens:
            row = xgr.allocate_token_bitmask(1, vocab)
            grammar.fill_row(row, 0) or row.fill_(-1)
            rows.append(_mask_list(row, 0, vocab))
            if not grammar.accept(t) or grammar.is_terminated:
                break
        return rows

    g = RequestGrammar(xgr.GrammarMatcher(compiled))
    assert g.fill_bitmask_rows(drafts, bitmask, start=1) == len(drafts)
    expected = sequential(RequestGrammar(xgr.GrammarMatcher(compiled)), drafts)
    assert [_mask_list(bitmask, 1 + i, vocab) for i in range(len(expected))] == expected
    assert _mask_list(bitmask, 1 + len(drafts), vocab) == list(range(vocab))  # after termination: untouched
    assert g.tokens == [] and not g.is_terminated  # rolled back
    # an invalid draft stops the walk: its own row excludes it, later rows stay all-allowed
    bad = drafts[:2] + enc("x", add_special_tokens=False).ids + drafts[2:]
    assert g.fill_bitmask_rows(bad, bitmask) == 2
    assert bad[2] not in _mask_list(bitmask, 2, vocab)
    assert _mask_list(bitmask, 3, vocab) == list(range(vocab))
    # accept some, then draft on top: still consistent with a sequential fill
    for t in drafts[:2]:
        assert g.accept(t)
    assert g.fill_bitmask_rows(drafts[2:], bitmask) == len(drafts) - 2
    assert [_mask_list(bitmask, i, vocab) for i in range(len(drafts) - 2)] == expected[2:]
    assert g.tokens == drafts[:2]

    # drafts that cross the trigger phases: free -> bound -> forced trigger -> grammar
    trigger = enc("<>", add_special_tokens=False).ids
    bound = enc("q", add_special_tokens=False).ids[0]
    g = RequestGrammar(xgr.GrammarMatcher(compiled), trigger, bound)
    walk = [5, 6, bound] + trigger + drafts[:3]
    assert g.fill_bitmask_rows(walk, bitmask) == len(walk)
    assert _mask_list(bitmask, 0, vocab) == list(range(vocab))  # free
    assert _mask_list(bitmask, 3, vocab) == [trigger[0]]  # forced after the bound
    assert _mask_list(bitmask, 3 + len(trigger), vocab) == expected[0]  # grammar from its start
    assert g.phase == 0 and g.tokens == []
    assert g.fill_bitmask_rows([5, bound, 7], bitmask) == 2  # 7 is not the forced trigger token


@pytest.fixture(scope="module")
def deepseek_vocab_model(tmp_path_factory):
    """A tiny random V4 model with DeepSeek-V4's 129,280-token vocabulary and tokenizer."""
    from tiny_models import save_deepseek_vocab_model

    path = tmp_path_factory.mktemp("tiny_v4_ds_vocab")
    save_deepseek_vocab_model(path)
    return path


def test_json_with_deepseek_vocabulary(deepseek_vocab_model):
    llm = LLM(deepseek_vocab_model, max_num_seqs=8, max_num_batched_tokens=256, num_cache_pages=16)
    assert llm.tokenizer.vocab_size == 129280
    info = llm.engine._structured().tokenizer_info
    assert info.vocab_size == 129280 and info.vocab_type == xgr.VocabType.BYTE_LEVEL
    # short outputs (each step samples from 129k logits on the cpu reference) and no unbounded
    # "number": with ~1k digit tokens in the vocabulary a random model rarely ends one
    schema = {"type": "object", "required": ["id", "kind", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                             "kind": SCHEMA["properties"]["kind"],
                             "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}
    prompt = llm.tokenizer.encode("Give me a record:")
    outs = llm.generate(prompt_token_ids=[prompt] * 4, use_tqdm=False,
                        sampling_params=[_params({"schema_type": "json", "schema": schema}, s, 60) for s in range(4)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.error)
        jsonschema.validate(json.loads(c.text, strict=False), schema)
        assert not any(t in info.special_token_ids for t in c.token_ids)  # no bos/placeholders in text


def test_shipped_model_outputs_validate():
    """The trained default model: JSON, regex and EBNF outputs at temperature 1 over several seeds."""
    from deepinfer.llm import DEFAULT_MODEL_DIR
    import os

    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors")):
        pytest.skip("the shipped model is not in deepinfer/assets")
    shipped = LLM(max_num_seqs=16)
    seeds = range(6)
    params = ([_params({"schema_type": "json", "schema": SCHEMA}, s) for s in seeds]
              + [_params({"schema_type": "regex", "schema": REGEXES[2]}, s, max_tokens=64) for s in seeds]
              + [_params({"schema_type": "ebnf", "schema": EBNF}, s, max_tokens=64) for s in seeds])
    outs = shipped.generate(["def record():\n    return "] * len(params), params, use_tqdm=False)
    parser = lark.Lark(LARK, start="start")
    for p, out in zip(params, outs):
        c = out.outputs[0]
        kind = p.so_args["schema_type"]
        if kind == "json":
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text, strict=False), SCHEMA)
        elif kind == "regex":
            assert c.finish_reason == "stop" and re.fullmatch(REGEXES[2], c.text), c.text
        elif c.finish_reason == "stop":  # an EBNF output cut by max_tokens is a valid prefix only
            parser.parse(c.text)
