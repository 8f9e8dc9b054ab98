"""How result rows become Arrow tables, and the output file's schema (used by the part files in
parts.py and the final file in sinks.py).

Column types. For a Parquet input the carried-through columns keep the input schema's types and the
`id` column keeps its type (integer ids as int64). For JSONL they are inferred from the values: a
column whose values are all booleans, all integers, all numbers or all strings gets that type; any
other column (lists, objects, or values of mixed types) is stored as JSON text. `id` is int64 when
every id is an integer, else string. Each part records the kind it inferred in its field metadata,
and merging widens kinds across parts the same way.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.io.rows import OUTPUT_FIELDS, RESERVED, ROW_KEY, ROW_SAMPLES_KEY
from batchgen.schema import KNOWN_FIELDS, LOGPROB_OPTIONS

OUTPUT_TYPES: dict[str, pa.DataType] = {
    "sample_index": pa.int64(),
    "text": pa.string(),
    "output_token_ids": pa.list_(pa.int32()),
    "finish_reason": pa.string(),
    "error": pa.string(),
    "prompt_tokens": pa.int64(),
    "completion_tokens": pa.int64(),
    "cached_prompt_tokens": pa.int64(),
    "num_preemptions": pa.int64(),
    "queue_s": pa.float64(),
    "ttft_s": pa.float64(),
    "prefill_s": pa.float64(),
    "decode_s": pa.float64(),
    "e2e_s": pa.float64(),
    "decode_tokens_per_s": pa.float64(),
}
assert tuple(OUTPUT_TYPES) == OUTPUT_FIELDS
# Output columns a job has only when its rows may ask for them (an input column of that name), last.
# top_logprobs: per generated token, its k most likely alternatives.
TOP_LOGPROB_TYPE = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
OPTIONAL_OUTPUT_TYPES: dict[str, pa.DataType] = {
    **{n: pa.list_(pa.float64()) for n in LOGPROB_OPTIONS},
    "top_logprobs": pa.list_(pa.list_(TOP_LOGPROB_TYPE)),
}

KIND_KEY = b"batchgen_kind"
KIND_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string(), "json": pa.string()}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# --- column layout ------------------------------------------------------------------------------


def _value_kind(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if INT64_MIN <= value <= INT64_MAX else "json"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"


def _widen(a: str | None, b: str | None) -> str | None:
    if a is None or a == b:
        return b
    if b is None:
        return a
    if {a, b} == {"int", "float"}:
        return "float"
    return "json"


def _widen_id(a: str | None, b: str | None) -> str | None:
    if a is None or a == b:
        return b
    return a if b is None else "str"


def _encode(values: list, kind: str) -> list:
    if kind == "json":
        return [None if v is None else json.dumps(v, ensure_ascii=False, default=str) for v in values]
    if kind == "float":
        return [None if v is None else float(v) for v in values]
    return values


def _kind_field(name: str, kind: str) -> pa.Field:
    return pa.field(name, KIND_TYPES[kind], metadata={KIND_KEY: kind.encode()})


def _field_kind(f: pa.Field) -> str | None:
    return (f.metadata or {}).get(KIND_KEY, b"").decode() or None


class Layout:
    """How result dicts become Arrow tables: `input_schema` given (Parquet input) means fixed types;
    None (JSONL input) means types inferred per part and widened at merge."""

    def __init__(self, input_schema: pa.Schema | None) -> None:
        self.input_schema = input_schema
        self.fixed_schema: pa.Schema | None = None
        self.carried: list[str] = []  # for a Parquet input: its columns that go through to the output
        if input_schema is not None:
            id_type = pa.int64()
            if "id" in input_schema.names:
                t = input_schema.field("id").type
                if pa.types.is_string(t) or pa.types.is_large_string(t):
                    id_type = t
            # (a column named like an output column is not carried: its rows are error rows that say so)
            carried = [f for f in input_schema if f.name not in KNOWN_FIELDS and f.name not in RESERVED]
            self.carried = [f.name for f in carried]
            optional = [pa.field(n, t) for n, t in OPTIONAL_OUTPUT_TYPES.items() if n in input_schema.names]
            self.fixed_schema = pa.schema(
                [pa.field("id", id_type), *carried, *(pa.field(n, t) for n, t in OUTPUT_TYPES.items()), *optional]
            )

    def part_table(self, rows: list[dict]) -> pa.Table:
        if self.fixed_schema is not None:
            return self._fixed_table(rows)
        return self._inferred_table(rows)

    def _fixed_table(self, rows: list[dict]) -> pa.Table:
        schema = self.fixed_schema.append(pa.field(ROW_KEY, pa.int64())).append(pa.field(ROW_SAMPLES_KEY, pa.int64()))
        id_is_text = not pa.types.is_integer(schema.field("id").type)
        if not id_is_text and any(_has_fallback_id(r) for r in rows):
            rows = [_fallback_id_in_error(r) if _has_fallback_id(r) else r for r in rows]
        columns = {}
        for f in schema:
            values = [r.get(f.name) for r in rows]
            if f.name == "id" and id_is_text:
                values = [None if v is None else str(v) for v in values]
            columns[f.name] = pa.array(values, type=f.type)
        return pa.Table.from_pydict(columns, schema=schema)

    def _inferred_table(self, rows: list[dict]) -> pa.Table:
        names: dict[str, None] = {}  # carried-through names, in order of first appearance
        for r in rows:
            for k in r:
                if k != "id" and k not in OUTPUT_TYPES and k not in RESERVED and k not in KNOWN_FIELDS:
                    names.setdefault(k)
        fields, arrays = [], []
        id_values = [r.get("id") for r in rows]
        id_kind = "int" if all(isinstance(v, int) and not isinstance(v, bool) for v in id_values) else "str"
        if id_kind == "str":
            id_values = [None if v is None else str(v) for v in id_values]
        fields.append(_kind_field("id", id_kind))
        arrays.append(pa.array(id_values, type=KIND_TYPES[id_kind]))
        for name in names:
            values = [r.get(name) for r in rows]
            kind = None
            for v in values:
                kind = _widen(kind, _value_kind(v))
            kind = kind or "str"  # all null
            fields.append(_kind_field(name, kind))
            arrays.append(pa.array(_encode(values, kind), type=KIND_TYPES[kind]))
        for name, t in OUTPUT_TYPES.items():
            fields.append(pa.field(name, t))
            arrays.append(pa.array([r.get(name) for r in rows], type=t))
        for name, t in OPTIONAL_OUTPUT_TYPES.items():
            if any(r.get(name) is not None for r in rows):
                fields.append(pa.field(name, t))
                arrays.append(pa.array([r.get(name) for r in rows], type=t))
        fields.append(pa.field(ROW_KEY, pa.int64()))
        arrays.append(pa.array([r[ROW_KEY] for r in rows], type=pa.int64()))
        fields.append(pa.field(ROW_SAMPLES_KEY, pa.int64()))
        arrays.append(pa.array([r.get(ROW_SAMPLES_KEY) for r in rows], type=pa.int64()))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def final_schema(self, part_schemas: list[pa.Schema]) -> pa.Schema:
        """The output file's schema: id, carried-through columns, output columns; no ROW_KEY."""
        if self.fixed_schema is not None:
            return self.fixed_schema
        order: dict[str, None] = {}
        kinds: dict[str, str | None] = {}
        for schema in part_schemas:
            for f in schema:
                if f.name in OUTPUT_TYPES or f.name in OPTIONAL_OUTPUT_TYPES or f.name in RESERVED:
                    continue
                order.setdefault(f.name)
                widen = _widen_id if f.name == "id" else _widen
                kinds[f.name] = widen(kinds.get(f.name), _field_kind(f))
        fields = [_kind_field("id", kinds.get("id") or "int")]
        fields += [_kind_field(n, kinds[n] or "str") for n in order if n != "id"]
        fields += [pa.field(n, t) for n, t in OUTPUT_TYPES.items()]
        asked = {f.name for schema in part_schemas for f in schema}
        fields += [pa.field(n, t) for n, t in OPTIONAL_OUTPUT_TYPES.items() if n in asked]
        return pa.schema(fields)


def _has_fallback_id(row: dict) -> bool:
    """An error row with a text id: io.rows' fallback for a row whose own id was unusable. A result
    row with a text id in an integer column is a wrong type, and fails as one."""
    return isinstance(row.get("id"), str) and row.get("finish_reason") == "error"


def _fallback_id_in_error(row: dict) -> dict:
    """An error row whose id is a fallback (io.rows: "#row:N") in an integer id column: a null id,
    the fallback named in its error instead."""
    return {**row, "id": None, "error": f"{row.get('error')} ({row['id']})"}


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` (one part) with exactly the columns and types of `schema` (which carries kinds)."""
    arrays = []
    for f in schema:
        if f.name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table.column(f.name)
        have, want = _field_kind(table.schema.field(f.name)), _field_kind(f)
        if column.type == f.type and have == want:
            arrays.append(column)
        elif want == "json":
            arrays.append(pa.array(_encode(column.to_pylist(), "json"), type=f.type))
        else:  # int -> float, or an integer id -> string id
            arrays.append(pc.cast(column, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` without our per-field bookkeeping metadata."""
    return pa.schema([f.remove_metadata() for f in schema], metadata=schema.metadata)
