"""`collect` against a real redis-server when the job's Redis data is not what batchgen wrote: a result
entry of the wrong types is one error row, a broken job hash is a one-line error, and any other
failure of submit or collect is one line, as in `run` and `worker`."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.queue import Keys, submit_job
from tests.redis_server import prefix, redis_server  # noqa: F401


def good_result(row: dict) -> dict:
    return {**row, "text": row["prompt"][::-1], "output_token_ids": [1, 2], "finish_reason": "length", "error": None,
            "prompt_tokens": 3, "completion_tokens": 2, "cached_prompt_tokens": 0, "num_preemptions": 0,
            "queue_s": 0.0, "ttft_s": 0.01, "prefill_s": 0.01, "decode_s": 0.01, "e2e_s": 0.02,
            "decode_tokens_per_s": 100.0}


def add_result(client, keys: Keys, index: int, result: dict) -> str:
    fields = {"index": index, "request": f"{index}-0", "worker": "other", "result": json.dumps(result)}
    return client.xadd(keys.results("j"), fields).decode()


@pytest.fixture
def client(redis_server):  # noqa: F811
    return redis_server.client()


def collect(batchgen, redis_server, prefix, output):  # noqa: F811
    return batchgen("collect", output, "--redis-url", redis_server.url(), "--prefix", prefix, "--job", "j",
                    "--timeout", "30")


def test_wrongly_typed_result_entries_become_error_rows(tmp_path, client, redis_server, prefix, batchgen):  # noqa: F811
    keys = Keys(prefix)
    rows = [{"id": f"r{i}", "prompt": f"prompt {i}", "num": i} for i in range(4)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    submit_job(client, keys, "j", src)
    add_result(client, keys, 0, good_result(rows[0]))
    bad_count = add_result(client, keys, 1, {**good_result(rows[1]), "prompt_tokens": "many"})  # ArrowTypeError
    bad_ids = add_result(client, keys, 2, {**good_result(rows[2]), "output_token_ids": [1, 2**40]})  # ArrowInvalid
    bad_text = add_result(client, keys, 3, {**good_result(rows[3]), "text": {"not": "text"}})
    code, out, err = collect(batchgen, redis_server, prefix, tmp_path / "out.parquet")
    assert code == 0 and "4 rows (1 ok, 3 errors)" in out, err
    got = {r["id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert got["r0"]["finish_reason"] == "length" and got["r0"]["text"] == "0 tpmorp"
    for row_id, entry, field in (("r1", bad_count, "prompt_tokens"), ("r2", bad_ids, "output_token_ids"),
                                 ("r3", bad_text, "text")):
        row = got[row_id]
        assert row["finish_reason"] == "error" and row["text"] is None, row
        assert f"result entry {entry} of {keys.results('j')}" in row["error"] and f"field '{field}'" in row["error"]


def test_a_wrongly_typed_column_of_a_parquet_job_becomes_an_error_row(tmp_path, client, redis_server, prefix,  # noqa: F811
                                                                      batchgen):
    keys = Keys(prefix)
    rows = [{"id": 10 + i, "prompt": f"prompt {i}", "num": i} for i in range(3)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    submit_job(client, keys, "j", src)
    add_result(client, keys, 0, good_result(rows[0]))
    bad = add_result(client, keys, 1, {**good_result(rows[1]), "num": "seven"})
    add_result(client, keys, 2, {**good_result(rows[2]), "id": "twelve"})  # the id itself: kept out
    code, out, err = collect(batchgen, redis_server, prefix, tmp_path / "out.parquet")
    assert code == 0 and "3 rows (1 ok, 2 errors)" in out, err
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("num").type == pa.int64() and table.schema.field("id").type == pa.int64()
    got = table.to_pylist()
    assert [r["finish_reason"] for r in got] == ["length", "error", "error"]
    assert got[1]["id"] == 11 and got[1]["num"] is None and f"result entry {bad}" in got[1]["error"]
    assert "field 'num'" in got[1]["error"]
    assert got[2]["id"] is None and "field 'id'" in got[2]["error"]


@pytest.mark.parametrize("field, value, fragment", [
    ("rows", str(10**15), "more rows than this machine can track"),
    ("rows", "1e11", "not a row count"),
    ("schema", "bm90IGFuIGFycm93IHNjaGVtYQ==", "field schema of"),
])
def test_a_broken_job_hash_is_a_one_line_error_naming_the_field(field, value, fragment, tmp_path, client,  # noqa: F811
                                                                 redis_server, prefix, batchgen):
    keys = Keys(prefix)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    submit_job(client, keys, "j", src)
    client.hset(keys.job("j"), field, value)
    code, _, err = collect(batchgen, redis_server, prefix, tmp_path / "out.parquet")
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("batchgen: error: "), err
    assert fragment in err and keys.job("j") in err, err


def test_other_failures_of_submit_and_collect_are_one_line(tmp_path, client, redis_server, prefix, batchgen):  # noqa: F811
    keys = Keys(prefix)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n{"prompt": "ho"}\n')
    submit_job(client, keys, "j", src, batch_rows=1)
    client.hset(keys.job("j"), "submitted", "garbage")  # not something submit foresees
    code, _, err = batchgen("submit", src, "--redis-url", redis_server.url(), "--prefix", prefix, "--job", "j")
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("batchgen: error: ValueError"), err
    assert "BATCHGEN_DEBUG=1" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = collect(batchgen, redis_server, prefix, blocker / "out.parquet")  # its folder is a file
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("batchgen: error: "), err
    assert "BATCHGEN_DEBUG=1" in err
