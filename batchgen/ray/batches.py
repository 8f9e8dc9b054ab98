"""A batch in any of Ray Data's formats (a dict of numpy arrays, pandas, pyarrow): the fields the
engine reads, as plain Python values; and the output batch, in the same format, typed as `run`'s output."""
from __future__ import annotations

import abc
import math
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from batchgen.io.layout import OPTIONAL_OUTPUT_TYPES, OUTPUT_TYPES
from batchgen.io.rows import RESERVED
from batchgen.schema import KNOWN_FIELDS

# the input columns a result column takes the place of (`id`, and opt-in outputs such as logprobs)
REPLACED_COLUMNS = frozenset(("id", *OUTPUT_TYPES, *OPTIONAL_OUTPUT_TYPES))


class Frame(abc.ABC):
    """One input batch in any of Ray's formats: the fields the engine reads, as plain Python values,
    and the output batch in the same format."""

    def __init__(self, batch, columns: list[str], num_rows: int, id_is_text: bool):
        self.batch = batch
        self.columns = columns
        self.num_rows = num_rows
        self.id_is_text = id_is_text  # the output's id column is text (else int64)
        self.reserved_columns = [c for c in columns if c in RESERVED]

    @staticmethod
    def of(batch) -> Frame:
        if isinstance(batch, pa.Table):
            return _ArrowFrame(batch)
        if isinstance(batch, pd.DataFrame):
            return _PandasFrame(batch)
        if isinstance(batch, dict):
            return _NumpyFrame(batch)
        raise TypeError(f"Generate takes a dict of numpy arrays, a pandas DataFrame or a pyarrow Table, "
                        f"got {type(batch).__name__}")

    def request_fields(self) -> list[dict]:
        """Each row's fields that the engine reads (`id`, the prompt, the sampling fields)."""
        names = [c for c in self.columns if c in KNOWN_FIELDS]
        values = {name: self.column_values(name) for name in names}
        return [{name: values[name][i] for name in names} for i in range(self.num_rows)]

    @abc.abstractmethod
    def column_values(self, name: str) -> list:
        """Column `name` as plain Python values."""

    def result_columns(self, rows: list[dict]) -> dict[str, pa.Array]:
        """The output columns of `rows`: `id`, run's output columns and the opt-in ones this input
        asks for (a column of that name), typed as in run's output file."""
        ids = [r["id"] for r in rows]
        id_column = pa.array([str(v) for v in ids] if self.id_is_text else ids,
                             type=pa.string() if self.id_is_text else pa.int64())
        columns = {"id": id_column}
        wanted = {**OUTPUT_TYPES, **{n: t for n, t in OPTIONAL_OUTPUT_TYPES.items() if n in self.columns}}
        for name, kind in wanted.items():
            values = [r.get(name) for r in rows]
            if name == "output_token_ids":
                values = [[] if v is None else [int(t) for t in v] for v in values]
            columns[name] = pa.array(values, type=kind)
        return columns

    def kept_columns(self) -> list[str]:
        """The input columns that pass through: all but those a result column replaces."""
        return [c for c in self.columns if c not in REPLACED_COLUMNS]

    @abc.abstractmethod
    def with_results(self, positions: list[int], rows: list[dict]):
        """The output batch: result `rows[i]` beside input row `positions[i]`'s columns."""


class _ArrowFrame(Frame):
    def __init__(self, table: pa.Table):
        id_type = table.schema.field("id").type if "id" in table.column_names else pa.string()
        text = pa.types.is_string(id_type) or pa.types.is_large_string(id_type)
        super().__init__(table, table.column_names, table.num_rows, text)

    def column_values(self, name: str) -> list:
        return self.batch.column(name).to_pylist()

    def with_results(self, positions, rows) -> pa.Table:
        kept = self.batch.select(self.kept_columns()).take(pa.array(positions, type=pa.int64()))
        results = self.result_columns(rows)
        return pa.table({"id": results.pop("id"), **{c: kept.column(c) for c in kept.column_names}, **results})


class _PandasFrame(Frame):
    def __init__(self, frame: pd.DataFrame):
        text = "id" not in frame.columns or not pd.api.types.is_numeric_dtype(frame["id"].dtype)
        super().__init__(frame, list(frame.columns), len(frame), text)

    def column_values(self, name: str) -> list:
        return [plain(v) for v in self.batch[name].tolist()]

    def with_results(self, positions, rows) -> pd.DataFrame:
        out = self.batch[self.kept_columns()].iloc[positions].reset_index(drop=True)
        results = self.result_columns(rows)
        # Arrow-backed columns: Ray turns them back into Arrow with their types (list<int32>, ...)
        columns = {n: pd.Series(a, dtype=pd.ArrowDtype(a.type)) for n, a in results.items()}
        out.insert(0, "id", columns.pop("id"))
        for name, column in columns.items():
            out[name] = column
        return out


class _NumpyFrame(Frame):
    def __init__(self, batch: dict):
        sizes = {len(v) for v in batch.values()}
        if len(sizes) > 1:
            raise ValueError(f"the batch's columns have different lengths: {sorted(sizes)}")
        ids = batch.get("id")
        text = ids is None or np.asarray(ids).dtype.kind not in "iufb"
        super().__init__(batch, list(batch), sizes.pop() if sizes else 0, text)

    def column_values(self, name: str) -> list:
        return [plain(v) for v in self.batch[name]]

    def with_results(self, positions, rows) -> dict:
        index = np.asarray(positions, dtype=np.int64)
        out = {"id": None, **{c: _kept_column(np.asarray(self.batch[c])[index]) for c in self.kept_columns()}}
        for name, column in self.result_columns(rows).items():
            out[name] = _numpy_column(column)
        return out


def _kept_column(column: np.ndarray) -> np.ndarray:
    """An input column going out again. Ray gives a list column as an object array of numpy arrays,
    and turns such an array back into its tensor type, whose batches do not concatenate where one
    holds only nulls: its lists go back as Python lists (an Arrow list column again)."""
    if column.ndim > 1:  # (a batch made by hand: lists of one length as a 2-d array)
        return _object_array(column.tolist())
    if column.dtype != object or not any(isinstance(v, np.ndarray) for v in column):
        return column
    return _object_array([plain(v) if isinstance(v, np.ndarray) else v for v in column])


def _numpy_column(column: pa.Array) -> np.ndarray:
    """A numpy column Ray turns back into the Arrow type it came from: scalars as numpy dtypes; lists
    as Python lists in an object array (numpy arrays there would become Ray's tensor type)."""
    if pa.types.is_list(column.type) or pa.types.is_string(column.type):
        return _object_array(column.to_pylist())
    return column.to_numpy(zero_copy_only=False)


def _object_array(values: list) -> np.ndarray:
    """A 1-d object array of `values` (np.array would make lists of one length a 2-d array)."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def plain(value: Any) -> Any:
    """A value of a numpy or pandas batch as the plain Python value the engine's checks expect:
    arrays as lists, numpy scalars as Python ones, NaN and pandas' NA as None (how they show a null)."""
    if value is None or value is pd.NA:
        return None
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value

