"""Input files, read lazily: Parquet in record batches, JSONL line by line. Never the whole file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io.rows import InputRow

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class InputError(Exception):
    """The input file as a whole cannot be used (missing, unreadable, wrong format)."""


def open_source(path: str | Path) -> JsonlSource | ParquetSource:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"input file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return ParquetSource(path)
    if suffix in JSONL_SUFFIXES:
        return JsonlSource(path)
    raise InputError(f"input file {str(path)!r}: unknown format; name it *.jsonl or *.parquet")


class JsonlSource:
    """One JSON object per line. Blank lines are skipped but keep their index, so a row's index is
    its 0-based line number. Each line is decoded as UTF-8 here, so that a bad line becomes one error
    row instead of an exception that ends the job."""

    schema: pa.Schema | None = None  # column types are inferred from the values (see layout.py)

    def __init__(self, path: Path) -> None:
        self.path = path

    def count_rows(self) -> int:
        """Rows (non-blank lines) in the file: one quick pass, for the progress bar and shard sizes."""
        with open(self.path, "rb") as f:
            return sum(1 for line in f if line.strip())

    def count_rows_where(self, keep) -> int:
        with open(self.path, "rb") as f:
            return sum(1 for index, line in enumerate(f) if line.strip() and keep(index))

    def __iter__(self) -> Iterator[InputRow]:
        with open(self.path, "rb") as f:
            for index, raw in enumerate(f):
                if raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte order mark that some editors write (or files joined with cat)
                if not raw.strip():
                    continue
                yield parse_jsonl_line(index, raw)


def parse_jsonl_line(index: int, raw: bytes) -> InputRow:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return InputRow(index, None, f"not valid UTF-8 (at byte offset {e.start} of the line)", "line")
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        return InputRow(index, None, f"not JSON: {e.msg} at column {e.colno}", "line")
    except RecursionError:
        return InputRow(index, None, "not usable JSON: nested too deeply", "line")
    except ValueError as e:  # an integer over Python's 4,300 digits
        return InputRow(index, None, f"not usable JSON: {str(e).split(':')[0].lower()}", "line")
    if data is None:  # (`null`: no object, as `true` or `3` is not)
        return InputRow(index, None, "not a JSON object (got null)", "line")
    return InputRow(index, data, unit="line")


class ParquetSource:
    """A Parquet file read one record batch at a time; a row's index is its position in the file."""

    def __init__(self, path: Path, batch_size: int = 1024) -> None:
        self.path = path
        self.batch_size = batch_size
        try:
            self._file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"input file {str(path)!r} is not a readable Parquet file: {_one_line(e)}") from e
        self.schema: pa.Schema = self._file.schema_arrow
        names = self.schema.names
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:  # (which one a row's field would come from is no choice to make for the user)
            raise InputError(f"input file {str(path)!r} has more than one column named "
                             f"{', '.join(map(repr, twice))}; rename or drop the extra ones")

    def count_rows(self) -> int:
        return self._file.metadata.num_rows

    def count_rows_where(self, keep) -> int:
        return sum(1 for index in range(self.count_rows()) if keep(index))

    def __iter__(self) -> Iterator[InputRow]:
        index = 0
        for batch in self._file.iter_batches(batch_size=self.batch_size):
            try:
                rows = batch.to_pylist()
            except UnicodeDecodeError:  # a string column holds bytes that are not UTF-8: find the rows
                for i in range(batch.num_rows):
                    yield InputRow(index, *_decode_row(batch.slice(i, 1)))
                    index += 1
                continue
            for data in rows:
                yield InputRow(index, data)
                index += 1


def _decode_row(row: pa.RecordBatch) -> tuple[dict | None, str | None]:
    """A one-row batch -> (its dict, None), or (None, the first column that is not UTF-8)."""
    try:
        return row.to_pylist()[0], None
    except UnicodeDecodeError:
        for name, column in zip(row.schema.names, row.columns):
            try:
                column.to_pylist()
            except UnicodeDecodeError as e:
                return None, f"column {name} is not valid UTF-8 (at byte {e.start} of its value)"
        return None, "not valid UTF-8"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
