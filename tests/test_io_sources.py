"""Sources (batchgen.io.sources): JSONL line by line, Parquet batch by batch."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.shard import Shard
from batchgen.io.sources import InputError, JsonlSource, ParquetSource, open_source


def test_jsonl_rows_are_indexed_by_line_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n\n   \n{"prompt": "b"}\r\n\xef\xbb\xbf{"prompt": "c"}')  # (cat a b)
    source = open_source(path)
    assert isinstance(source, JsonlSource)
    rows = list(source)
    assert [(r.index, r.data) for r in rows] == [(0, {"prompt": "a"}), (3, {"prompt": "b"}), (4, {"prompt": "c"})]
    assert source.count_rows() == 3
    assert source.count_rows_where(lambda i: i in Shard(1, 2)) == 1


def test_jsonl_bad_lines_become_rows_with_a_reason(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "\xff"}\n{"prompt": \n' + b"[" * 100_000 + b"\n42\nnull\n")
    rows = list(open_source(path))
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert rows[4].data is None and rows[4].error == "not a JSON object (got null)"
    assert rows[0].data is None and rows[0].error.startswith("not valid UTF-8 (at byte offset 12 ")
    assert rows[1].data is None and rows[1].error.startswith("not JSON:")
    assert rows[2].data is None and "JSON" in rows[2].error
    assert rows[3].data == 42  # JSON, but not an object: the row checker says so


def test_jsonl_line_with_an_integer_too_long_for_python_is_a_bad_row(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": ' + "9" * 5000 + '}\n{"prompt": "b"}\n')
    rows = list(open_source(path))
    assert rows[0].data is None and rows[0].error.startswith("not usable JSON: ") and "4300 digits" in rows[0].error
    assert rows[1].data == {"prompt": "b"}


def test_jsonl_is_read_lazily(tmp_path):
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for i in range(1000):
            f.write(json.dumps({"prompt": str(i)}) + "\n")
    rows = iter(open_source(path))
    assert next(rows).data == {"prompt": "0"}
    with open(path, "a") as f:  # a reader that had read the whole file up front would not see this
        f.write(json.dumps({"prompt": "late"}) + "\n")
    assert [r.data["prompt"] for r in rows][-1] == "late"


def test_parquet_rows_in_batches(tmp_path):
    table = pa.table({"prompt": [f"p{i}" for i in range(2500)], "n": list(range(2500))})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=1000)
    source = open_source(tmp_path / "in.parquet")
    assert isinstance(source, ParquetSource)
    rows = list(source)
    assert len(rows) == 2500 and rows[1234].index == 1234 and rows[1234].data == {"prompt": "p1234", "n": 1234}
    assert source.count_rows() == 2500 and source.count_rows_where(lambda i: i in Shard(2, 3)) == 833
    assert source.schema.names == ["prompt", "n"]


@pytest.mark.parametrize("name, content, fragment", [
    ("missing.jsonl", None, "does not exist"),
    ("in.csv", b"a,b\n", "unknown format"),
    ("in.parquet", b"not parquet at all", "not a readable Parquet file"),
])
def test_unusable_input_files(tmp_path, name, content, fragment):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=fragment):
        open_source(path)


def test_parquet_with_a_repeated_column_name_is_refused(tmp_path):
    """Two `prompt` (or `id`) columns: which one a row reads is no choice to make silently."""
    path = tmp_path / "in.parquet"
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["x"]), pa.array(["y"])], names=["id", "prompt", "prompt"])
    pq.write_table(table, path)
    with pytest.raises(InputError, match="more than one column named 'prompt'"):
        open_source(path)
