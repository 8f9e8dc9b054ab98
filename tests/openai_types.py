"""OpenAI batch output lines checked against the OpenAI Python SDK's own types (pydantic models,
which accept unknown fields: `strict` also refuses fields the SDK does not know); and the OpenAI
batch input and output lines the tests write and read."""

from __future__ import annotations

import json

import openai.types
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion
from pydantic import BaseModel


def line(custom_id: str, url: str, **body) -> dict:
    """An OpenAI batch input line."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def read_lines(path) -> list[dict]:
    """The lines of an OpenAI batch output (or error) file, each ended by a newline."""
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def strict(model: BaseModel, where: str = "body") -> None:
    extra = model.model_extra or {}
    assert not extra, f"{where}: fields the OpenAI SDK does not know: {sorted(extra)}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                strict(item, f"{where}.{name}")


def validate_line(line: dict) -> ChatCompletion | Completion | None:
    """-> the parsed response body of a line, or None for an error line."""
    assert set(line) == {"id", "custom_id", "response", "error"}, line
    request_output = getattr(openai.types, "BatchRequestOutput", None)  # in the SDK's newer versions only
    if request_output is not None:
        request_output.model_validate(line)
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_")
    assert line["custom_id"] is None or isinstance(line["custom_id"], str)
    if line["error"] is not None:
        assert line["response"] is None
        error = BatchError.model_validate(line["error"])
        strict(error, "error")
        assert error.code and error.message and "\n" not in error.message
        return None
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
    assert isinstance(response["request_id"], str)
    body = response["body"]
    parsed = (ChatCompletion if body.get("object") == "chat.completion" else Completion).model_validate(body)
    strict(parsed)
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    return parsed
