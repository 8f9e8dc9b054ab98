"""DESIGN.md's row contracts, shared by the engine, the file job and the queue: the fields of an
input row and the checks of their types (one place for both the Python API and the files), and the
output row of a request that failed."""
from __future__ import annotations

import math
from typing import Any

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")  # exactly one per row
SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "n",
)
OUTPUT_OPTIONS = ("logprobs", "prompt_logprobs")  # opt-in: return log-probabilities
# Which of a request's n samples to generate (all when absent): set by a resumed job for a row
# whose other samples an earlier run finished.
SAMPLES_KEY = "__batchgen_samples__"
KNOWN_FIELDS = ("id", *PROMPT_FIELDS, *SAMPLING_FIELDS, *OUTPUT_OPTIONS, SAMPLES_KEY)  # the rest is carried through
METRIC_FIELDS = ("queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "decode_tokens_per_s")
INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "n")
FLOAT_FIELDS = ("temperature", "top_p")
BOOL_FIELDS = ("ignore_eos", *OUTPUT_OPTIONS)


class FieldError(ValueError):
    """A field of a request row has the wrong type or shape; the message is one line, the row's `error`."""


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise FieldError(f"{name} must be an integer, got bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # 16.0 from JSON, or from a float column that holds whole numbers
    raise FieldError(f"{name} must be an integer, got {type_name(value)} {value!r}")


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(f"{name} must be a number, got {type_name(value)}")
    return float(value)


def as_int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise FieldError(f"{name} must be a list of integers, got {type_name(value)}")
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def check_messages(value: Any) -> list[dict]:
    if not isinstance(value, (list, tuple)):
        raise FieldError(f"messages must be a list of {{role, content}} objects, got {type_name(value)}")
    if not value:
        raise FieldError("messages is empty")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise FieldError(f"messages[{i}] must be an object with role and content, got {type_name(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise FieldError(f"messages[{i}].{key} must be a string, got {type_name(message.get(key))}")
        if not message["role"]:
            raise FieldError(f"messages[{i}].role is empty")
        # A Parquet struct column gives every message every field; unset ones come back as None.
        messages.append({k: v for k, v in message.items() if v is not None})
    if not any(m["content"] for m in messages):
        raise FieldError("messages has no content")
    return messages


def check_prompt(row: dict) -> dict:
    """The row's one prompt field, type-checked -> {field: value}."""
    present = [f for f in PROMPT_FIELDS if row.get(f) is not None]
    if not present:
        raise FieldError("no prompt: a row needs one of prompt, messages, prompt_token_ids")
    if len(present) > 1:
        raise FieldError(f"more than one prompt field ({', '.join(present)}): a row needs exactly one")
    field, value = present[0], row[present[0]]
    if field == "prompt":
        if not isinstance(value, str):
            raise FieldError(f"prompt must be a string, got {type_name(value)}")
        if not value.strip():
            raise FieldError("prompt is empty")
        return {"prompt": value}
    if field == "messages":
        return {"messages": check_messages(value)}
    ids = as_int_list("prompt_token_ids", value)
    if not ids:
        raise FieldError("prompt_token_ids is empty")
    return {"prompt_token_ids": ids}


def check_options(row: dict) -> dict:
    """The row's non-null sampling fields and output options, type-checked (value ranges are
    SamplingParams' to check) -> {field: value}."""
    fields: dict[str, Any] = {}
    for name in INT_FIELDS:
        if row.get(name) is not None:
            fields[name] = as_int(name, row[name])
    for name in FLOAT_FIELDS:
        if row.get(name) is not None:
            fields[name] = as_float(name, row[name])
    stop = row.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise FieldError(f"stop must be a string or a list of strings, got {type_name(stop)}")
        if any(s == "" for s in stop):
            raise FieldError("stop holds an empty string")
        fields["stop"] = list(stop)
    if row.get("stop_token_ids") is not None:
        fields["stop_token_ids"] = as_int_list("stop_token_ids", row["stop_token_ids"])
    for name in BOOL_FIELDS:
        if row.get(name) is not None:
            if not isinstance(row[name], bool):
                raise FieldError(f"{name} must be true or false, got {type_name(row[name])}")
            fields[name] = row[name]
    return fields


def error_result(row_id, message: str, extras: dict | None = None) -> dict:
    """The output row of a request that failed: no text, no tokens, no timings."""
    return {
        "id": row_id,
        **(extras or {}),
        "sample_index": 0,  # one error row for a request, whatever its n
        "text": None,
        "output_token_ids": [],
        "finish_reason": "error",
        "error": message,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_prompt_tokens": 0,
        "num_preemptions": 0,
        **dict.fromkeys(METRIC_FIELDS),
    }
