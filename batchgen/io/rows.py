"""Input rows: what a source reads, and the checks a row must pass before it reaches the engine.

A row that fails a check becomes an error result at once (``finish_reason == "error"``, a one-line
``error``); it never reaches the engine and never stops the job. Here: its id (unique in the input),
reserved column names, every string valid Unicode (no lone surrogate: see batchgen.unicode_text),
and the field types and integer ranges (batchgen.schema's checks, which the engine applies to Python
API requests too). The engine checks what needs the model (token ids in the vocabulary, prompt
length, the sampling ranges that depend on each other).

An error row whose own id is unusable (missing where its index is taken, of the wrong type, out of
range, not valid Unicode, or already seen) gets a fallback id that no real id can be mistaken for:
``#line:N`` for line N (1-based, as editors count) of a JSONL file, ``#row:N`` for row N (0-based,
as Arrow and pandas count) of a Parquet file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from batchgen.schema import (
    KNOWN_FIELDS,
    FieldError,
    IdSet,
    check_options,
    check_prompt,
    check_range,
    check_text,
    error_result,
    type_name,
)
from batchgen.unicode_text import lone_surrogate

# Columns every output row has, in file order after `id` and the carried-through columns.
OUTPUT_FIELDS = (
    "sample_index", "text", "output_token_ids", "finish_reason", "error",
    "prompt_tokens", "completion_tokens", "cached_prompt_tokens", "num_preemptions",
    "queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "decode_tokens_per_s",
)

# The input row's index travels with its request through the engine (as a carried-through key) and
# is stored in the work directory's part files; it is what resume and sharding go by.
ROW_KEY = "__batchgen_row__"
# A part file's record of how many samples its row has (n > 1 only), so that resume knows a row that
# is only partly done.
ROW_SAMPLES_KEY = "__batchgen_samples__"
RESERVED = frozenset((*OUTPUT_FIELDS, ROW_KEY, ROW_SAMPLES_KEY))
FALLBACK_ID = re.compile(r"#(line|row):[0-9]+")  # the form of InputRow.fallback_id, which no real id may take


@dataclass
class InputRow:
    """One row as a source read it: `data` is the parsed row, or None with `error` saying why not."""

    index: int  # 0-based position in the input (the line index for JSONL)
    data: dict | None
    error: str | None = None
    unit: str = "row"  # what `index` counts: "line" (JSONL) or "row" (Parquet, Python lists)

    @property
    def fallback_id(self) -> str:
        """The id of this row's error result when the row has no usable id of its own."""
        return f"#line:{self.index + 1}" if self.unit == "line" else f"#row:{self.index}"


class RowError(FieldError):
    """A row-level problem; its message is the output row's `error`."""


def check_id(value: Any) -> str | int:
    """An id, checked: a non-empty string that UTF-8 can encode, or an integer in int64's range."""
    try:
        if isinstance(value, str):
            if not value:
                raise RowError("id is an empty string")
            check_text("id", value)
            if value.startswith("#") and FALLBACK_ID.fullmatch(value):
                raise RowError(f"id {value!r} has the form of the ids batchgen gives rows without a usable id "
                               f"(#line:N, #row:N); choose another")
            return value
        if isinstance(value, bool):
            raise RowError("id must be a string or an integer, got bool")
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
            return check_range("id", int(value))
    except FieldError as e:
        raise RowError(str(e)) from None
    raise RowError(f"id must be a string or an integer, got {type_name(value)}")


def check_columns_text(extras: dict) -> None:
    """RowError naming the first carried-through column whose name or value (nested too) holds a
    string that UTF-8 cannot encode: no writer could store it."""
    for name, value in extras.items():
        at = lone_surrogate(name) if isinstance(name, str) else None
        if at is not None:
            raise RowError(f"a column name is not valid Unicode: lone surrogate at character {at}")
        try:
            check_text(f"column {name}", value)
        except FieldError as e:
            raise RowError(str(e)) from None


class RowChecker:
    """Turns input rows into engine requests or error results, and keeps the set of ids seen.

    Every row of the input goes through `check`, in input order, including rows that another shard
    generates or an earlier run finished: which row holds an id "already seen" must not depend on
    sharding or resuming.
    """

    def __init__(self) -> None:
        self.seen = IdSet()
        self._without_id = bytearray()  # bit i: row i has no id of its own (its index is its id)

    def check(self, row: InputRow) -> tuple[dict | None, dict | None]:
        """Returns (request, None) for a good row and (None, error result) for a bad one.

        The request holds the id, the prompt field, the per-row sampling fields, the carried-through
        columns and ROW_KEY. A row without an id gets its index as id; the error result of a row
        without a usable id gets the row's fallback id.
        """
        if row.data is None:
            return None, error_row(row.index, row.fallback_id, row.error or "unreadable row")
        data = row.data
        if not isinstance(data, dict):
            return None, error_row(row.index, row.fallback_id, f"not a JSON object (got {_json_type(data)})")
        extras = {k: v for k, v in data.items() if k not in KNOWN_FIELDS}  # carried through

        row_id: str | int = row.index
        id_problem = None
        if data.get("id") is not None:
            try:
                row_id = check_id(data["id"])
            except RowError as e:
                id_problem = str(e)
        if id_problem is None and not self.seen.add(row_id):
            if row_id == row.index and data.get("id") is None:
                id_problem = f"the row has no id and its index {row.index} is already another row's id"
            elif self._took_index_as_id(row_id):
                id_problem = (f"id {row_id!r} is taken: row {row_id} has no id, and a row without an id takes its "
                              f"0-based index as id; give every row an id, or none")
            else:
                id_problem = f"id {row_id!r} already seen in this input"
        if id_problem is None and data.get("id") is None:
            self._mark_without_id(row.index)
        if id_problem is not None:
            return None, error_row(row.index, row.fallback_id, id_problem, extras)
        return checked_request(row.index, row_id, data, extras)

    def _mark_without_id(self, index: int) -> None:
        byte = index >> 3
        if byte >= len(self._without_id):
            self._without_id.extend(bytes(max(byte + 1 - len(self._without_id), len(self._without_id))))
        self._without_id[byte] |= 1 << (index & 7)

    def _took_index_as_id(self, row_id: str | int) -> bool:
        """Whether row_id, as text, is the index of an earlier row that has no id (ids compare as text)."""
        text = str(row_id)
        if not text.isdigit() or text != str(int(text)):
            return False
        index = int(text)
        byte = index >> 3
        return byte < len(self._without_id) and bool(self._without_id[byte] >> (index & 7) & 1)


def checked_request(index: int, row_id: str | int, data: dict,
                    extras: dict | None = None) -> tuple[dict | None, dict | None]:
    """The checks after the id's, for input row `index` whose id `row_id` passed them (RowChecker's,
    or an OpenAI line's custom_id): reserved column names, the prompt and the per-row fields ->
    (request, None) or (None, error result). `extras`: data's carried-through fields, where the
    caller has them already."""
    if extras is None:
        extras = {k: v for k, v in data.items() if k not in KNOWN_FIELDS}
    reserved = sorted(k for k in extras if k in RESERVED)
    if reserved:
        names = ", ".join(reserved)
        return None, error_row(index, row_id, f"column {names} is reserved for the output; rename it", extras)
    try:
        check_columns_text(extras)
        request = {"id": row_id, **check_prompt(data), **check_options(data)}
    except FieldError as e:
        return None, error_row(index, row_id, str(e), extras)
    request.update(extras)
    request[ROW_KEY] = index
    return request, None


def error_row(index: int, row_id: Any, message: str, extras: dict | None = None) -> dict:
    """The error result of input row `index` (with ROW_KEY: resume and sharding go by it)."""
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
