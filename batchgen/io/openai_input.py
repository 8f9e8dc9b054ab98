"""OpenAI Batch API input files: `{"custom_id", "method", "url", "body"}` lines, read as batchgen rows.

A line becomes the row `{"id": custom_id, <prompt field>, <sampling fields>, "url", "model"}` and
then goes through the native checks (batchgen.io.rows), so the engine sees nothing new. `url` and
`model` are carried through: the OpenAI writer (openai_output.py) needs the endpoint to shape the
response, and Parquet output shows both as columns.

Body fields either map onto a row field, are accepted only at their default value (`stream: false`,
`frequency_penalty: 0`, ...), are ignored (`user`, `metadata`, `store`), or are refused: an unknown
field makes the line an error row naming it, so no setting is ever dropped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from batchgen.io.rows import IdSet, InputRow, RowChecker, checked_request, error_row
from batchgen.io.sources import JSONL_SUFFIXES, JsonlSource
from batchgen.schema import (
    INPUT_FORMATS,
    MAX_TOP_LOGPROBS,
    PROMPT_FIELDS,
    FieldError,
    as_int,
    check_text,
    message_text,
    type_name,
)
from batchgen.unicode_text import lone_surrogate

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
LINE_FIELDS = ("custom_id", "method", "url", "body")

# Body fields copied to the row field of the same name (the native checks type-check them).
PASSED_FIELDS = (
    "temperature", "top_p", "stop", "seed", "top_k", "min_tokens", "ignore_eos", "stop_token_ids", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens", "include_stop_str_in_output", "skip_special_tokens",
)
# Body fields read by the mapping itself, per endpoint.
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs",
               "response_format", "structured_outputs")
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "n", "logprobs", "best_of", "response_format",
                     "structured_outputs")
# Accepted only at their default value (None counts as default): what they would change, batchgen
# does not do.
DEFAULT_ONLY: dict[str, tuple] = {
    "stream": (False,),
    "stream_options": (),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),  # meaningless without tools
    "echo": (False,),  # /v1/completions
    "suffix": (),  # /v1/completions
}
IGNORED = ("user", "metadata", "store")  # bookkeeping of the caller's; no effect on the output


def looks_like_openai(data: Any) -> bool:
    """A parsed line of an OpenAI batch file: a body and one of the other line fields, no batchgen prompt."""
    return (
        isinstance(data, dict)
        and "body" in data
        and any(k in data for k in ("custom_id", "url", "method"))
        and not any(k in data for k in PROMPT_FIELDS)
    )


def detect_jsonl_format(path: Path, max_lines: int = 100) -> str:
    """"openai" or "batchgen", from the first non-blank line of the first `max_lines` that is a JSON
    object (lines that are not are skipped: they are error rows in either format); "batchgen" when
    none is found there."""
    for row in JsonlSource(path):  # row.index: the 0-based line number, blank lines counted
        if row.index >= max_lines:
            break
        if isinstance(row.data, dict):
            return "openai" if looks_like_openai(row.data) else "batchgen"
    return "batchgen"


def resolve_input_format(path: Path, requested: str = "auto") -> str:
    """"openai" or "batchgen" for the input file at `path` (ValueError for an OpenAI Parquet file:
    OpenAI batch files are JSONL)."""
    if requested not in INPUT_FORMATS:
        raise ValueError(f"unknown input format {requested!r}; use one of {', '.join(INPUT_FORMATS)}")
    jsonl = path.suffix.lower() in JSONL_SUFFIXES
    if requested == "openai" and not jsonl:
        raise ValueError(f"{str(path)!r}: an OpenAI batch file is JSONL (name it *.jsonl)")
    if requested != "auto":
        return requested
    return detect_jsonl_format(path) if jsonl else "batchgen"


def _is_default(name: str, value: Any) -> bool:
    return value is None or any(_same(value, default) for default in DEFAULT_ONLY[name])


def _same(value: Any, default: Any) -> bool:
    """value == default, where 0 is not False and "0" is not 0."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return type(value) is type(default) and value == default


def _messages(value: Any) -> Any:
    """OpenAI's messages as a chat template takes them: content as text, and the `developer` role
    (OpenAI's newer name for the system prompt) as `system`, which chat templates know."""
    if not isinstance(value, list):
        return value  # the native check names the type
    messages = []
    for i, m in enumerate(value):
        if isinstance(m, dict):
            m = {**m, "content": message_text(m.get("content"), f"body.messages[{i}]")}
            if m.get("role") == "developer":
                m["role"] = "system"
        messages.append(m)
    return messages


def _completion_prompt(value: Any) -> dict:
    """/v1/completions' prompt (a string, token ids, or a list holding one of those) -> a prompt field."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > 1:
            raise FieldError(f"body.prompt holds {len(value)} prompts; batchgen takes one prompt per line")
        value = value[0]
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, list):
        return {"prompt_token_ids": value}
    raise FieldError(f"body.prompt must be a string or a list of token ids, got {type_name(value)}")


class OpenAILineMapper:
    """One OpenAI batch line -> a batchgen row; FieldError with a one-line message otherwise.

    `served_models`: the names a line's `body.model` may have (the first is recorded for a body
    without one); None accepts any model (`batchgen submit` without --served-model-name)."""

    def __init__(self, served_models: Iterable[str] | None) -> None:
        self.served_models = list(served_models) if served_models is not None else None
        if self.served_models == []:
            raise ValueError("served_models must hold at least one name, or be None")

    def line(self, data: dict) -> dict:
        unknown = sorted(k for k in data if k not in LINE_FIELDS)
        if unknown:
            raise FieldError(f"unknown line field {', '.join(unknown)} (a line has custom_id, method, url, body)")
        if data.get("method") != "POST":
            raise FieldError(f"method must be \"POST\", got {json.dumps(data.get('method'))}")
        url = data.get("url")
        if url not in URLS:
            raise FieldError(f"url {json.dumps(url)} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
        body = data.get("body")
        if not isinstance(body, dict):
            raise FieldError(f"body must be an object, got {type_name(body)}")
        return {"id": data["custom_id"], **self.body(url, body)}

    def body(self, url: str, body: dict) -> dict:
        own = CHAT_FIELDS if url == CHAT_URL else COMPLETION_FIELDS
        unknown = sorted(k for k in body if k not in own and k not in PASSED_FIELDS and k not in DEFAULT_ONLY
                         and k not in IGNORED)
        if unknown:
            raise FieldError(f"unknown body field {', '.join(unknown)} for {url} (batchgen does not support it)")
        if body.get("stream") is True:
            raise FieldError("body.stream: true is not supported in a batch file")
        for name in DEFAULT_ONLY:
            if name in body and not _is_default(name, body[name]):
                raise FieldError(f"body.{name} {json.dumps(body[name])} is not supported (only its default)")

        row: dict[str, Any] = {"url": url, "model": self._model(body.get("model"))}
        if url == CHAT_URL:
            if body.get("messages") is None:
                raise FieldError("body.messages is missing")
            row["messages"] = _messages(body["messages"])
        else:
            if body.get("prompt") is None:
                raise FieldError("body.prompt is missing")
            row.update(_completion_prompt(body["prompt"]))
        row.update({k: body[k] for k in PASSED_FIELDS if body.get(k) is not None})

        max_tokens = {k: as_int(f"body.{k}", body[k]) for k in ("max_tokens", "max_completion_tokens")
                      if body.get(k) is not None}
        if len(set(max_tokens.values())) > 1:
            raise FieldError("body.max_tokens and body.max_completion_tokens differ; give one")
        if max_tokens:
            row["max_tokens"] = next(iter(max_tokens.values()))

        n = as_int("body.n", body["n"]) if body.get("n") is not None else None
        if (url == COMPLETIONS_URL and body.get("best_of") is not None
                and as_int("body.best_of", body["best_of"]) != (n or 1)):
            raise FieldError("body.best_of must equal n (batchgen returns every sample)")
        if n is not None and n < 1:
            raise FieldError(f"body.n must be >= 1, got {n}")
        if n is not None:  # absent: the job's --n (1 unless set, as OpenAI's)
            row["n"] = n

        row.update(self._logprobs(url, body))
        response_format = body.get("response_format")
        structured_outputs = body.get("structured_outputs")
        if response_format == {"type": "text"} and structured_outputs is not None:
            response_format = None  # a client's default beside vLLM's constraint: the constraint holds
        if response_format is not None:  # {"type": "text"} too: it turns a job-wide --response-format off
            if not isinstance(response_format, dict):
                raise FieldError(f"body.response_format must be an object, got {type_name(response_format)}")
            row["response_format"] = response_format
        if structured_outputs is not None:  # vLLM's: {"json" | "regex" | "choice" | "grammar": ...}
            row["structured_outputs"] = structured_outputs
        return row

    def _model(self, model: Any) -> str | None:
        if model is None:
            return self.served_models[0] if self.served_models else None
        if not isinstance(model, str):
            raise FieldError(f"body.model must be a string, got {type_name(model)}")
        if self.served_models is not None and model not in self.served_models:
            served = ", ".join(repr(m) for m in self.served_models)
            raise FieldError(f"body.model {model!r} is not served here (serving {served}); "
                             f"pass --served-model-name {model} to accept it")
        return model

    @staticmethod
    def _logprobs(url: str, body: dict) -> dict:
        """Chat: `logprobs` (bool) + `top_logprobs` (k); completions: `logprobs` (k, 0 = the sampled
        token's only) -> the row's `logprobs: true` and `top_logprobs: k` (when k > 0)."""
        value = body.get("logprobs")
        if url == CHAT_URL:
            if value is not None and not isinstance(value, bool):
                raise FieldError(f"body.logprobs must be true or false, got {type_name(value)}")
            top = body.get("top_logprobs")
            top = None if top is None else as_int("body.top_logprobs", top)
            if top is not None and not value:
                raise FieldError("body.top_logprobs needs body.logprobs: true")
            asked = bool(value)
        else:
            top = None if value is None else as_int("body.logprobs", value)
            asked = top is not None
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            name = "top_logprobs" if url == CHAT_URL else "logprobs"
            raise FieldError(f"body.{name} must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        fields: dict[str, Any] = {"logprobs": True} if asked else {}
        if top:
            fields["top_logprobs"] = top
        return fields


class OpenAIRowChecker:
    """RowChecker's interface for OpenAI batch lines: the line's own checks (custom_id present,
    unique, a string; method, url, body), its mapping to a row, then the native checks.

    A line without a usable custom_id (missing, not a string, or repeated) gets a null id: its error
    names its line number, and its output line has `custom_id: null`."""

    def __init__(self, served_models: Iterable[str] | None) -> None:
        self.mapper = OpenAILineMapper(served_models)
        self.seen = IdSet()  # custom_ids; the mapped row's id is its custom_id, so no second id check

    def check(self, row: InputRow) -> tuple[dict | None, dict | None]:
        where = f"line {row.index + 1}"
        if row.data is None:
            return None, error_row(row.index, None, f"{row.error or 'unreadable line'} ({where})")
        data = row.data
        if not isinstance(data, dict):
            return None, error_row(row.index, None, f"not a JSON object, got {type_name(data)} ({where})")
        custom_id = data.get("custom_id")
        if custom_id is None:
            return None, error_row(row.index, None, f"custom_id is missing ({where})")
        if not isinstance(custom_id, str) or not custom_id:
            problem = "is empty" if custom_id == "" else f"must be a string, got {type_name(custom_id)}"
            return None, error_row(row.index, None, f"custom_id {problem} ({where})")
        at = lone_surrogate(custom_id)
        if at is not None:
            return None, error_row(row.index, None, f"custom_id is not valid Unicode: lone surrogate at character {at} "
                                                    f"({where})")
        if not self.seen.add(custom_id):
            return None, error_row(row.index, None, f"custom_id {custom_id!r} already seen in this input ({where})")
        try:
            check_text("", {k: v for k, v in data.items() if k != "custom_id"})  # names it: body.messages[0].content
            mapped = self.mapper.line(data)
        except FieldError as e:
            return None, error_row(row.index, custom_id, str(e), self._recorded(data))
        return checked_request(row.index, custom_id, mapped)

    @staticmethod
    def _recorded(data: dict) -> dict:
        """What an error row keeps of a line it could not map: url and model, where they are strings."""
        body = data.get("body") if isinstance(data.get("body"), dict) else {}
        return {"url": data["url"] if isinstance(data.get("url"), str) else None,
                "model": body["model"] if isinstance(body.get("model"), str) else None}


def make_checker(input_format: str, served_models: Iterable[str] | None) -> RowChecker | OpenAIRowChecker:
    """The row checker for a resolved input format ("openai" or "batchgen")."""
    return OpenAIRowChecker(served_models) if input_format == "openai" else RowChecker()
