"""Tool calls read from a reply's text (gateway/tool_calls.py): complete blocks become calls and the rest stays
content; several calls, a cap on them, malformed and unclosed blocks; a stream split at every character gives the
whole reply's parse. The tool_calls grammar accepts exactly the calls it describes."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from gateway.tool_calls import ParsedCall, ToolCallParser, finish_reason, parse_reply
from runtime.grammar import parse_grammar, tool_calls_grammar

WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "time", "arguments": {"zone": "CET"}}\n</tool_call>'
PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}


def calls(parsed: list[ParsedCall]) -> list[tuple[int, str, dict]]:
    return [(c.index, c.name, json.loads(c.arguments)) for c in parsed]


def test_a_reply_without_blocks_is_content_unchanged() -> None:
    for text in ("", "Hello\n", "a <tool_ b", "x <tool_call"):
        assert parse_reply(text, None) == (text, [])


def test_complete_blocks_become_calls_and_the_rest_content() -> None:
    content, parsed = parse_reply(WEATHER, None)
    assert content is None and calls(parsed) == [(0, "weather", {"city": "Paris", "days": 2})]
    assert parsed[0].id.startswith("call_")
    assert parsed[0].message() == {"id": parsed[0].id, "type": "function",
                                   "function": {"name": "weather", "arguments": '{"city": "Paris", "days": 2}'}}
    content, parsed = parse_reply(f"Let me look.\n\n{WEATHER}\n{TIME}\n", None)
    assert content == "Let me look."
    assert calls(parsed) == [(0, "weather", {"city": "Paris", "days": 2}), (1, "time", {"zone": "CET"})]
    assert len({c.id for c in parsed}) == 2


def test_a_cap_leaves_later_blocks_as_content() -> None:
    content, parsed = parse_reply(f"{WEATHER}\n{TIME}", 1)
    assert calls(parsed) == [(0, "weather", {"city": "Paris", "days": 2})] and content == TIME


@pytest.mark.parametrize("block", [
    "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": }\n</tool_call>",  # malformed JSON
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n{\"name\": \"weather\", \"arguments\": \"city\"}\n</tool_call>",  # arguments not an object
    "<tool_call>\n[1, 2]\n</tool_call>",
])
def test_blocks_that_are_not_calls_stay_content(block: str) -> None:
    assert parse_reply(f"Hi {block} there", None) == (f"Hi {block} there", [])
    content, parsed = parse_reply(f"{block}\n{TIME}", None)
    assert content == block and calls(parsed) == [(0, "time", {"zone": "CET"})]


def test_an_unclosed_block_stays_content() -> None:
    text = f'{TIME} Then <tool_call>\n{{"name": "weather", "arguments": {{'
    content, parsed = parse_reply(text, None)
    assert content == text[len(TIME) + 1:] and calls(parsed) == [(0, "time", {"zone": "CET"})]


@pytest.mark.parametrize("text", [
    f"Let me look.\n\n{WEATHER}\n{TIME}\n",
    f"{WEATHER} and then {TIME} done",
    f"a <tool_ b\n{WEATHER}<tool_call>\n{{oops}}\n</tool_call>  {TIME}<tool_call> left open",
])
@pytest.mark.parametrize("max_calls", [None, 1])
def test_streams_split_anywhere_parse_as_the_whole_reply(text: str, max_calls: int | None) -> None:
    whole, whole_calls = parse_reply(text, max_calls)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            parser = ToolCallParser(max_calls)
            parsed = [parser.read(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
            content = "".join(p.text for p in parsed)
            streamed = [c for p in parsed for c in p.calls]
            assert (content or None if streamed else content) == whole, (cut, pieces)
            assert [(c.index, c.name, c.arguments) for c in streamed] == \
                   [(c.index, c.name, c.arguments) for c in whole_calls]


def test_text_before_a_block_streams_at_once() -> None:
    parser = ToolCallParser(None)
    assert parser.read("Let me look. <tool").text == "Let me look."
    assert parser.read('_call>\n{"name": "time", "arguments": {}}').text == ""
    parsed = parser.read("\n</tool_call>")
    assert parsed.text == "" and calls(parsed.calls) == [(0, "time", {})]


def test_finish_reason_names_tool_calls_only_for_a_finished_reply() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("stop", False) == "stop" and finish_reason("length", True) == "length"


def accepts(grammar: str, text: str) -> bool:
    """Whether the grammar accepts exactly `text`."""
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(parse_grammar(grammar)))
    return matcher.accept_string(text) and matcher.is_completed()


def test_the_tool_calls_grammar_takes_calls_of_its_functions_only() -> None:
    one = tool_calls_grammar([("weather", PARAMETERS)], parallel=False)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(one, call)
    assert not accepts(one, f"{call}\n{call}")  # one call only
    assert not accepts(one, call.replace("Oslo", "Rome"))  # outside the schema
    assert not accepts(one, "Sure. " + call)  # no text around the calls
    assert not accepts(one, "")
    both = tool_calls_grammar([("weather", PARAMETERS), ("time", {"type": "object"})], parallel=True)
    time = '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    assert accepts(both, f"{call}\n{time}\n{call}") and parse_reply(f"{call}\n{time}", None)[0] is None
    assert not accepts(both, call.replace("weather", "wether"))


def test_a_bad_parameters_schema_is_named() -> None:
    with pytest.raises(ValueError, match='invalid parameters schema: Unsupported type "colour"'):
        parse_grammar(tool_calls_grammar([("f", {"type": "colour"})], parallel=False))
