"""Part files (batchgen.io.parts), the final file (batchgen.io.sinks), the work directory (batchgen.io.resume)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.layout import Layout
from batchgen.io.parts import PartWriter, list_parts
from batchgen.io.resume import JobError, WorkDir
from batchgen.io.rows import ROW_KEY, error_result
from batchgen.io.sinks import merge_parts


def ok_row(index, **extra):
    return {"id": f"r{index}", **extra, "sample_index": 0, "text": f"t{index}", "output_token_ids": [1, 2],
            "finish_reason": "stop", "error": None, "prompt_tokens": 3, "completion_tokens": 2,
            "cached_prompt_tokens": 0, "num_preemptions": 0, "queue_s": 0.0, "ttft_s": 0.1 * index, "prefill_s": 0.1,
            "decode_s": 0.2, "e2e_s": 1.0 + index, "decode_tokens_per_s": 5.0, ROW_KEY: index}


def test_part_writer_flushes_by_rows_and_leaves_no_temp_files(tmp_path):
    writer = PartWriter(tmp_path, Layout(None), flush_rows=3, flush_seconds=3600)
    for i in range(7):
        writer.add(ok_row(i))
    assert len(list_parts(tmp_path)) == 2 and writer.rows_written == 6
    writer.flush()
    writer.flush()  # nothing buffered: no empty part
    parts = list_parts(tmp_path)
    assert [p.name for p in parts] == ["part-000001.parquet", "part-000002.parquet", "part-000003.parquet"]
    assert not list(tmp_path.glob("*.tmp"))
    assert pq.read_table(parts[2]).column(ROW_KEY).to_pylist() == [6]
    # a later run numbers its parts after the existing ones
    later = PartWriter(tmp_path, Layout(None), flush_rows=1)
    later.add(ok_row(7))
    assert list_parts(tmp_path)[-1].name == "part-000004.parquet"


def test_part_writer_flushes_by_time(tmp_path):
    writer = PartWriter(tmp_path, Layout(None), flush_rows=1000, flush_seconds=0.0)
    writer.add(ok_row(0))
    assert len(list_parts(tmp_path)) == 1


def test_merge_keeps_each_row_once_and_writes_totals_into_the_schema(tmp_path):
    writer = PartWriter(tmp_path, Layout(None), flush_rows=2)
    for i in range(4):
        writer.add(ok_row(i))
    writer.add(ok_row(2))  # a row written twice (it should not happen) is kept once
    writer.add({**error_result("bad", "no prompt"), ROW_KEY: 4})
    writer.flush()
    out = tmp_path / "out.parquet"
    totals = merge_parts(tmp_path, out, Layout(None), lambda t: {"rows": t.rows, "rows_error": t.rows_error})
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == ["bad", "r0", "r1", "r2", "r3"]
    assert ROW_KEY not in table.column_names
    assert json.loads(pq.read_schema(out).metadata[b"batchgen"]) == {"rows": 5, "rows_error": 1}
    assert (totals.rows_ok, totals.output_tokens, totals.prompt_tokens) == (4, 8, 12)
    assert totals.percentiles("e2e_s") == {"p50": pytest.approx(2.5), "p95": pytest.approx(3.85)}
    assert not list(tmp_path.glob("*.tmp"))
    assert all(f.metadata is None for f in table.schema)  # no bookkeeping metadata in the output


def test_merge_of_nothing_gives_an_empty_file_with_the_schema(tmp_path):
    out = tmp_path / "out.parquet"
    merge_parts(tmp_path, out, Layout(None), lambda t: {"rows": t.rows})
    table = pq.read_table(out)
    assert table.num_rows == 0 and table.schema.field("id").type == pa.int64()
    assert table.schema.field("output_token_ids").type == pa.list_(pa.int32())


def test_fixed_layout_stores_ids_as_the_input_schema_says(tmp_path):
    layout = Layout(pa.schema([("id", pa.string()), ("prompt", pa.string()), ("num", pa.int16())]))
    writer = PartWriter(tmp_path, layout, flush_rows=10)
    writer.add(ok_row(0, num=3) | {"id": 0})  # a row without id got its index: stored as text here
    writer.flush()
    merge_parts(tmp_path, tmp_path / "out.parquet", layout, lambda t: {})
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("id").to_pylist() == ["0"] and table.schema.field("num").type == pa.int16()
    assert table.column_names[:4] == ["id", "num", "sample_index", "text"]


def test_workdir_sets_aside_an_unreadable_part(tmp_path):
    out = tmp_path / "out.parquet"
    workdir = WorkDir(out)
    workdir.open({"a": 1}, resume=True)
    writer = PartWriter(workdir.path, Layout(None), flush_rows=1)
    writer.add(ok_row(2))
    (workdir.path / "part-000002.parquet").write_bytes(b"garbage")
    (workdir.path / "part-000003.parquet.tmp").write_bytes(b"half written")
    workdir.close()
    workdir = WorkDir(out)
    workdir.open({"a": 1}, resume=True)
    assert workdir.done_rows().any.tolist() == [False, False, True]
    assert (workdir.path / "part-000002.parquet.corrupt").exists()
    assert not (workdir.path / "part-000003.parquet.tmp").exists()
    workdir.remove()
    assert not workdir.path.exists()


def test_workdir_refuses_rows_without_job_file(tmp_path):
    out = tmp_path / "out.parquet"
    workdir = WorkDir(out)
    workdir.path.mkdir()
    PartWriter(workdir.path, Layout(None), flush_rows=1).add(ok_row(0))
    with pytest.raises(JobError, match="no job.json.*--no-resume"):
        workdir.open({"a": 1}, resume=True)
    workdir.open({"a": 1}, resume=False)
    assert workdir.done_rows().any.tolist() == []
