"""docs/API.md's compatibility tables against the gateway's request models: every field a model accepts, or accepts
only at its no-op value, has a row with that status, and every row marked refused really gets the 400, so the
tables cannot go stale. (vLLM's own field list lives in the tables only.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from gateway.chat_messages import ChatMessage
from gateway.openai_api import _NO_OP, APIError, ChatCompletionRequest, CompletionRequest, validation_error

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "API.md"
STATUSES = {"supported", "no-op", "refused"}
ROW = re.compile(r"^\| `(\w+)` \| (\w+) \| ([\w-]+) \|")
USER = {"role": "user", "content": "hi"}
# each table: its section heading, the model its rows describe, a valid body to add one field to
TABLES = {
    "## `POST /v1/chat/completions`": (ChatCompletionRequest, {"model": "m", "messages": [USER]}, True),
    "## `POST /v1/completions`": (CompletionRequest, {"model": "m", "prompt": "hi"}, True),
    "## Messages": (ChatMessage, USER, False),
}


def table(heading: str) -> dict[str, str]:
    """field -> status, from the table under `heading`."""
    lines = API_DOC.read_text().splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    rows = [m.groups() for m in map(ROW.match, lines[start:end]) if m]
    fields = [field for field, _, _ in rows]
    assert len(fields) == len(set(fields)), f"a field has two rows under {heading}"
    assert {status for _, _, status in rows} <= STATUSES
    return {field: status for field, _, status in rows}


def refusal(model: type[BaseModel], body: dict, field: str) -> APIError:
    """The error a body with `field` added gets, as the gateway answers it."""
    try:
        model.model_validate({**body, field: 1})
    except APIError as exc:
        return exc
    except ValidationError as exc:
        return validation_error(exc.errors())
    raise AssertionError(f"{field} was accepted")


@pytest.mark.parametrize("heading", list(TABLES))
def test_every_field_the_gateway_takes_has_its_row(heading: str) -> None:
    model, _, no_ops = TABLES[heading]
    rows = table(heading)
    for field in model.model_fields:
        assert rows.get(field) in ("supported", "no-op"), f"{field}: {rows.get(field)} in docs/API.md, accepted here"
    for field in (set(_NO_OP) - set(model.model_fields)) if no_ops else ():
        assert rows.get(field) == "no-op", f"{field}: {rows.get(field)} in docs/API.md, a no-op here"


@pytest.mark.parametrize("heading", list(TABLES))
def test_every_row_is_what_the_gateway_does(heading: str) -> None:
    model, body, no_ops = TABLES[heading]
    known = set(model.model_fields) | (set(_NO_OP) if no_ops else set())
    for field, status in table(heading).items():
        if status == "refused":
            assert field not in known
            error = refusal(model, body, field)
            assert (error.status, error.message) == (400, f"Unrecognized request argument supplied: {field}")
        else:
            assert field in known, f"{field} is {status} in docs/API.md, unknown to the gateway"
            assert status == "no-op" or field in model.model_fields, f"{field} is only accepted as a no-op"
