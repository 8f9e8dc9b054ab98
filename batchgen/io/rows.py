"""Input rows: what a source reads, and the checks a row must pass before it reaches the engine.

A row that fails a check becomes an error result at once (``finish_reason == "error"``, a one-line
``error``); it never reaches the engine and never stops the job. The engine checks what needs the
model (token ids in range, prompt length, sampling value ranges); here we check what needs only the row.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from batchgen.schema import OUTPUT_OPTIONS, PROMPT_FIELDS, SAMPLING_FIELDS, error_result

INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed")
FLOAT_FIELDS = ("temperature", "top_p")
INPUT_FIELDS = ("id", *PROMPT_FIELDS, *SAMPLING_FIELDS, *OUTPUT_OPTIONS)

# Columns every output row has, in file order after `id` and the carried-through columns.
OUTPUT_FIELDS = (
    "text", "output_token_ids", "finish_reason", "error",
    "prompt_tokens", "completion_tokens", "cached_prompt_tokens", "num_preemptions",
    "queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "decode_tokens_per_s",
)

# The input row's index travels with its request through the engine (as a carried-through key) and
# is stored in the work directory's part files; it is what resume and sharding go by.
ROW_KEY = "__batchgen_row__"
RESERVED = frozenset((*OUTPUT_FIELDS, ROW_KEY))


@dataclass
class InputRow:
    """One row as a source read it: `data` is the parsed row, or None with `error` saying why not."""

    index: int  # 0-based position in the input (the line index for JSONL)
    data: dict | None
    error: str | None = None


class IdSet:
    """Ids seen so far, kept as 64-bit digests (under 100 bytes an id, whatever the id's length).

    Ids compare as text: the string "7" and the integer 7 are the same id, because a JSONL file that
    mixes them stores its ids as strings. Two different ids share a digest with odds of about
    rows² / 2^65 (1e-8 for a million rows).
    """

    def __init__(self) -> None:
        self._digests: set[int] = set()

    def add(self, row_id: str | int) -> bool:
        """Adds `row_id`; False if it was already there."""
        digest = hashlib.blake2b(str(row_id).encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "little")
        if key in self._digests:
            return False
        self._digests.add(key)
        return True


class RowError(ValueError):
    """A row-level problem; its message is the output row's `error`."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise RowError(f"{name} must be an integer, got bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # 16.0 from JSON, or from a float column that holds whole numbers
    raise RowError(f"{name} must be an integer, got {_type_name(value)} {value!r}")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RowError(f"{name} must be a number, got {_type_name(value)}")
    return float(value)


def _as_int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise RowError(f"{name} must be a list of integers, got {_type_name(value)}")
    return [_as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def check_id(value: Any) -> str | int:
    if isinstance(value, str):
        if not value:
            raise RowError("id is an empty string")
        return value
    if isinstance(value, bool):
        raise RowError("id must be a string or an integer, got bool")
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
        return int(value)
    raise RowError(f"id must be a string or an integer, got {_type_name(value)}")


def _check_messages(value: Any) -> list[dict]:
    if not isinstance(value, (list, tuple)):
        raise RowError(f"messages must be a list of {{role, content}} objects, got {_type_name(value)}")
    if not value:
        raise RowError("messages is empty")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowError(f"messages[{i}] must be an object with role and content, got {_type_name(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise RowError(f"messages[{i}].{key} must be a string, got {_type_name(message.get(key))}")
        if not message["role"]:
            raise RowError(f"messages[{i}].role is empty")
        # A Parquet struct column gives every message every field; unset ones come back as None.
        messages.append({k: v for k, v in message.items() if v is not None})
    if not any(m["content"] for m in messages):
        raise RowError("messages has no content")
    return messages


def _check_prompt(data: dict) -> dict:
    present = [f for f in PROMPT_FIELDS if data.get(f) is not None]
    if not present:
        raise RowError("no prompt: a row needs one of prompt, messages, prompt_token_ids")
    if len(present) > 1:
        raise RowError(f"more than one prompt field ({', '.join(present)}): a row needs exactly one")
    field, value = present[0], data[present[0]]
    if field == "prompt":
        if not isinstance(value, str):
            raise RowError(f"prompt must be a string, got {_type_name(value)}")
        if not value:
            raise RowError("prompt is empty")
        return {"prompt": value}
    if field == "messages":
        return {"messages": _check_messages(value)}
    ids = _as_int_list("prompt_token_ids", value)
    if not ids:
        raise RowError("prompt_token_ids is empty")
    return {"prompt_token_ids": ids}


def _check_sampling(data: dict) -> dict:
    fields: dict[str, Any] = {}
    for name in INT_FIELDS:
        if data.get(name) is not None:
            fields[name] = _as_int(name, data[name])
    for name in FLOAT_FIELDS:
        if data.get(name) is not None:
            fields[name] = _as_float(name, data[name])
    stop = data.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise RowError(f"stop must be a string or a list of strings, got {_type_name(stop)}")
        if any(s == "" for s in stop):
            raise RowError("stop holds an empty string")
        fields["stop"] = list(stop)
    if data.get("stop_token_ids") is not None:
        fields["stop_token_ids"] = _as_int_list("stop_token_ids", data["stop_token_ids"])
    for name in ("ignore_eos", *OUTPUT_OPTIONS):
        if data.get(name) is not None:
            if not isinstance(data[name], bool):
                raise RowError(f"{name} must be true or false, got {_type_name(data[name])}")
            fields[name] = data[name]
    return fields


class RowChecker:
    """Turns input rows into engine requests or error results, and keeps the set of ids seen.

    Every row of the input goes through `check`, in input order, including rows that another shard
    generates or an earlier run finished: which row holds an id "already seen" must not depend on
    sharding or resuming.
    """

    def __init__(self) -> None:
        self.seen = IdSet()

    def check(self, row: InputRow) -> tuple[dict | None, dict | None]:
        """Returns (request, None) for a good row and (None, error result) for a bad one.

        The request holds the id, the prompt field, the per-row sampling fields, the carried-through
        columns and ROW_KEY. A row without a usable id (none, null, wrong type, or already seen) gets
        its index as id.
        """
        if row.data is None:
            return None, self._error(row.index, row.index, row.error or "unreadable row", {})
        data = row.data
        if not isinstance(data, dict):
            return None, self._error(row.index, row.index, f"not a JSON object (got {_json_type(data)})", {})
        extras = {k: v for k, v in data.items() if k not in INPUT_FIELDS}

        row_id: str | int = row.index
        id_problem = None
        if data.get("id") is not None:
            try:
                row_id = check_id(data["id"])
            except RowError as e:
                id_problem = str(e)
                row_id = row.index
        if id_problem is None and not self.seen.add(row_id):
            if row_id == row.index and data.get("id") is None:
                id_problem = f"the row has no id and its index {row.index} is already another row's id"
            else:
                id_problem = f"id {row_id!r} already seen in this input"
                row_id = row.index
        if id_problem is not None:
            return None, self._error(row.index, row_id, id_problem, extras)

        reserved = sorted(k for k in extras if k in RESERVED)
        if reserved:
            names = ", ".join(reserved)
            return None, self._error(row.index, row_id, f"column {names} is reserved for the output; rename it", extras)
        try:
            request = {"id": row_id, **_check_prompt(data), **_check_sampling(data)}
        except RowError as e:
            return None, self._error(row.index, row_id, str(e), extras)
        request.update(extras)
        request[ROW_KEY] = row.index
        return request, None

    @staticmethod
    def _error(index: int, row_id: Any, message: str, extras: dict) -> dict:
        result = error_result(row_id, message, extras)
        result[ROW_KEY] = index
        return result


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"
