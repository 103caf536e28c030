"""Tool calls read from a reply's text (gateway/tool_calls.py): complete blocks become calls and the rest stays
content; several calls, a cap on them, blocks that are not calls, calls with malformed or unfinished arguments;
arguments streamed as they come, and a stream split anywhere assembles, as OpenAI's clients do, into the whole
reply's parse; a block cut off before its header is complete is dropped. The tool_calls grammar accepts exactly the
calls it describes, up to MAX_PARALLEL_CALLS of them. A chat template that leaves tools out of the prompt is found at
start-up and warned of."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import xgrammar as xgr

from gateway.chat import renders_tools, warn_unrendered_tools
from gateway.tool_calls import CallDelta, Parsed, ParsedCall, ToolCallParser, finish_reason, parse_reply
from runtime.grammar import MAX_PARALLEL_CALLS, parse_grammar, tool_calls_grammar
from runtime.models import load_tokenizer, resolve_pair

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
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n{\"arguments\": {}, \"name\": \"weather\"}\n</tool_call>",  # not the header's order
    "<tool_call>\n{\"name\": \"weather\", \"arguments\": \"city\"}\n</tool_call>",  # arguments not an object
    "<tool_call>\n{\"name\": \"the weather\", \"arguments\": {}}\n</tool_call>",  # not a function name
    "<tool_call>\n[1, 2]\n</tool_call>",
])
def test_blocks_that_are_not_calls_stay_content(block: str) -> None:
    assert parse_reply(f"Hi {block} there", None) == (f"Hi {block} there", [])
    content, parsed = parse_reply(f"{block}\n{TIME}", None)
    assert content == block and calls(parsed) == [(0, "time", {"zone": "CET"})]


def test_a_call_keeps_arguments_that_are_not_json_as_written() -> None:
    content, parsed = parse_reply('<tool_call>\n{"name": "weather", "arguments": {"city": }\n</tool_call> ok', None)
    assert content == "ok" and [(c.name, c.arguments) for c in parsed] == [("weather", '{"city":')]


def test_an_unclosed_call_keeps_what_was_written_of_its_arguments() -> None:
    text = f'{TIME} Then <tool_call>\n{{"name": "weather", "arguments": {{"city": "Pa'
    content, parsed = parse_reply(text, None)
    assert content == "Then" and [(c.name, c.arguments) for c in parsed] == \
           [("time", '{"zone": "CET"}'), ("weather", '{"city": "Pa')]
    # a closing cut short is dropped: the arguments are whole
    for cut in ("}", "}\n", "}\n</tool_"):
        (call,) = parse_reply(f'<tool_call>\n{{"name": "time", "arguments": {{"zone": "CET"}}{cut}', None)[1]
        assert call.arguments == '{"zone": "CET"}'


def test_a_block_cut_off_before_its_header_is_complete_is_dropped() -> None:
    content, parsed = parse_reply(f'{TIME} Then <tool_call>\n{{"name": "weath', None)
    assert content == "Then" and calls(parsed) == [(0, "time", {"zone": "CET"})]
    assert parse_reply('<tool_call>\n{"name": "weath', None) == ("", [])
    # cut off in its opening: dropped where it stands as a block (at the start, or after calls), as in a reply
    # constrained to calls; after content it is that content's end
    for cut in ("<", "<tool_c", "<tool_call"):
        assert parse_reply(cut, None) == ("", [])
        content, parsed = parse_reply(f"{TIME}\n{cut}", None)
        assert content is None and calls(parsed) == [(0, "time", {"zone": "CET"})]
        assert parse_reply(f"x {cut}", None) == (f"x {cut}", [])


def streamed(pieces: list[str], max_calls: int | None) -> tuple[str, list[tuple[int, str, str]], list[int]]:
    """A stream's content, its calls assembled from their deltas as OpenAI's clients do, and how many arguments
    deltas each call had; each delta's shape checked on the way."""
    parser = ToolCallParser(max_calls)
    content, assembled, pieces_per_call = "", [], []
    for i, piece in enumerate(pieces):
        parsed = parser.read(piece, last=i == len(pieces) - 1)
        content += parsed.text
        for d in parsed.calls:
            delta = d.delta()
            if "id" in delta:  # a call's first delta: its id, name and empty arguments
                assert delta["index"] == len(assembled) and delta["type"] == "function"
                assert delta["id"].startswith("call_") and delta["function"]["arguments"] == ""
                assembled.append([delta["index"], delta["function"]["name"], ""])
                pieces_per_call.append(0)
            else:  # the next piece of the last call's arguments, never empty
                assert delta.keys() == {"index", "function"} and delta["index"] == len(assembled) - 1
                assert delta["function"].keys() == {"arguments"} and delta["function"]["arguments"]
                assembled[-1][2] += delta["function"]["arguments"]
                pieces_per_call[-1] += 1
    return content, [tuple(c) for c in assembled], pieces_per_call


PRETTY = '<tool_call>\n{ "name" :"weather",\n "arguments":\n  {\n  "city": {"in": "Paris"} \n }\n}\n\n</tool_call>'


@pytest.mark.parametrize("text", [
    f"Let me look.\n\n{WEATHER}\n{TIME}\n",
    f"{WEATHER} and then {TIME} done",
    f"a <tool_ b\n{WEATHER}<tool_call>\n{{oops}}\n</tool_call>  {TIME}<tool_call> left open",
    f"{PRETTY}{TIME}",
    '<tool_call>{"name":"f","arguments":{"a":"}"}}</tool_call><tool_call>\n{"name": "g", "arguments": {}}} </tool',
    '<tool_call>\n{"name": "weather", "arguments": {"city": }\n</tool_call>\n<tool_call>\n{"name": "x y"',
    f'{TIME}\n<tool_call>\n{{"name": "weather", "arguments": {{"city": "Pa',
    f'{TIME}\n<tool_call>\n{{"name": "wea',
    f"{TIME}\n<tool_ca",
    "Hi <tool_call>\n{",
])
@pytest.mark.parametrize("max_calls", [None, 1])
def test_streams_split_anywhere_parse_as_the_whole_reply(text: str, max_calls: int | None) -> None:
    whole, whole_calls = parse_reply(text, max_calls)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            content, assembled, _ = streamed(pieces, max_calls)
            assert (content or None if assembled else content) == whole, (cut, pieces)
            assert assembled == [(c.index, c.name, c.arguments) for c in whole_calls], (cut, pieces)


def test_arguments_stream_as_they_come() -> None:
    parser = ToolCallParser(None)
    assert parser.read("Let me look. <tool").text == "Let me look."
    parsed = parser.read('_call>\n{"name": "weather", "argu')
    assert parsed.text == "" and parsed.calls == []
    assert parser.read('ments": ').calls == []  # the header ends with the arguments' `{`
    first, piece = parser.read("{").calls
    assert (first.index, first.name, first.arguments) == (0, "weather", "") and first.id.startswith("call_")
    assert piece == CallDelta(0, "{")
    assert [d.delta() for d in parser.read('"city"').calls] == [{"index": 0, "function": {"arguments": '"city"'}}]
    assert parser.read(': "Paris"}').calls == [CallDelta(0, ': "Paris"')]  # the `}` may close the block
    assert parser.read("}").calls == [CallDelta(0, "}")]  # the first `}` was the arguments': this one may close
    assert parser.read("\n</tool_call").calls == []
    parsed = parser.read(">\n\nDone.", last=True)
    assert parsed == Parsed("Done.", []) and parser.calls == 1
    _, (call,) = parse_reply('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>', None)
    assert call.arguments == '{"city": "Paris"}'


def test_each_piece_of_the_arguments_gets_a_delta() -> None:
    arguments = '{"city":"Paris","days":2}'  # no blanks: a blank is held until what follows it shows
    _, assembled, per_call = streamed(['<tool_call>\n{"name": "weather", "arguments": ', *arguments,
                                       "}\n</tool_call>"], None)
    assert assembled == [(0, "weather", arguments)] and per_call == [len(arguments)]


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
    # a bounded number of calls: after the last one the grammar is complete, so the model must stop
    most = "\n".join([time] * MAX_PARALLEL_CALLS)
    assert accepts(both, most) and not accepts(both, f"{most}\n{time}")


def test_a_bad_parameters_schema_is_named() -> None:
    with pytest.raises(ValueError, match='invalid parameters schema: Unsupported type "colour"'):
        parse_grammar(tool_calls_grammar([("f", {"type": "colour"})], parallel=False))


def test_a_chat_template_that_leaves_tools_out_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = load_tokenizer(resolve_pair(None, None)[0])  # the demo target: ChatML, no tools
    qwen3 = (Path(__file__).resolve().parents[1] / "qwen3_tools.jinja").read_text()
    assert renders_tools(tokenizer, qwen3) and not renders_tools(tokenizer, None)
    caplog.set_level(logging.WARNING, logger="ddtree.gateway")
    warn_unrendered_tools(tokenizer, qwen3)
    assert not caplog.records
    warn_unrendered_tools(tokenizer, None)
    (record,) = caplog.records
    assert "does not render `tools`" in record.getMessage() and "--chat-template" in record.getMessage()
    caplog.clear()
    warn_unrendered_tools(tokenizer, "{{ raise_exception('system message first') }}")
    (record,) = caplog.records
    assert "could not check" in record.getMessage() and "system message first" in record.getMessage()
