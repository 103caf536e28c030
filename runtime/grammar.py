"""Structured output's grammars as the wire carries them (SamplingParams.grammar): canonical JSON naming what the
output must be, {"json_object": true}, {"json_schema": {...}} or {"tool_calls": {...}}, and the xgrammar grammar
each one means. The
gateway checks a request's grammar with it before starting; the verifier compiles it against the target's
vocabulary (verify_server/grammar.py)."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr


def canonical(value: Any) -> str:
    """One spelling per JSON value (no spaces): the wire's grammar and the verifier's cache key. Keys keep their
    order: a schema's properties come out in the order it lists them."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def json_object_grammar() -> str:
    return canonical({"json_object": True})


def json_schema_grammar(schema: dict[str, Any]) -> str:
    return canonical({"json_schema": schema})


def tool_calls_grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """Tool calls in Qwen3's format, and nothing else: one (parallel: one or more, a newline apart) of
    `<tool_call>\n{"name": "<name>", "arguments": <JSON of its parameters' schema>}\n</tool_call>`.
    functions: each function's name and parameters schema (the names need no JSON escaping)."""
    return canonical({"tool_calls": {"functions": [{"name": n, "parameters": p} for n, p in functions],
                                     "parallel": parallel}})


def _tool_calls_structural_tag(spec: Any) -> dict[str, Any]:
    """A tool_calls grammar's xgrammar structural tag; ValueError for a malformed one."""
    if not (isinstance(spec, dict) and spec.keys() == {"functions", "parallel"} and isinstance(spec["parallel"], bool)
            and isinstance(spec["functions"], list) and spec["functions"]
            and all(isinstance(f, dict) and f.keys() == {"name", "parameters"} and isinstance(f["name"], str)
                    and isinstance(f["parameters"], dict) for f in spec["functions"])):
        raise ValueError('a tool_calls grammar is {"functions": [{"name", "parameters"}, ...], "parallel": bool}')
    # Qwen3's own spacing around the call's JSON; at most one blank in a row inside the arguments, so a model
    # cannot spend its tokens on blanks
    tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{f["name"]}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": f["parameters"], "max_whitespace_cnt": 1},
             "end": "}\n</tool_call>"} for f in spec["functions"]]
    return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                                  "at_least_one": True, "stop_after_first": not spec["parallel"]}}


def parse_grammar(description: str) -> xgr.Grammar:
    """A wire grammar -> its xgrammar grammar; ValueError naming what is wrong. A schema's output is compact JSON
    (no free whitespace between tokens): a model cannot spend its tokens on blanks."""
    try:
        spec = json.loads(description)
    except json.JSONDecodeError as exc:
        raise ValueError(f"a grammar must be JSON: {exc}") from None
    if spec == {"json_object": True}:  # an object (OpenAI's json_object), not any JSON value; any members
        return xgr.Grammar.from_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
    if isinstance(spec, dict) and spec.keys() == {"tool_calls"}:
        try:
            return xgr.Grammar.from_structural_tag(canonical(_tool_calls_structural_tag(spec["tool_calls"])))
        except RuntimeError as exc:  # a parameters schema xgrammar refuses
            raise ValueError(f"invalid parameters schema: {str(exc).split(': ', 1)[-1].strip()}") from None
    if not (isinstance(spec, dict) and spec.keys() == {"json_schema"} and isinstance(spec["json_schema"], dict)):
        raise ValueError('a grammar is {"json_object": true}, {"json_schema": {...}} or {"tool_calls": {...}}')
    try:
        return xgr.Grammar.from_json_schema(canonical(spec["json_schema"]), any_whitespace=False)
    except RuntimeError as exc:  # xgrammar's errors carry its source location first: keep the message
        raise ValueError(f"invalid JSON schema: {str(exc).split(': ', 1)[-1].strip()}") from None
