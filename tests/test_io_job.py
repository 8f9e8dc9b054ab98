"""The file job (batchgen.io.job) end to end against a small stand-in engine: fast, no model.

The stand-in follows the engine's contract: it pulls requests lazily with a bounded number in
flight, yields results out of order, honours stop_event, carries unknown keys through.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io import JobError, JobSpec, Shard, run_job
from batchgen.io.resume import workdir_for
from batchgen.io.rows import ROW_KEY
from batchgen.schema import SAMPLING_FIELDS


class StandInLLM:
    """Answers each prompt with its reversed text; finishes requests newest-first within a window."""

    def __init__(self, in_flight: int = 3, stop_after: int | None = None, crash_after: int | None = None):
        self.in_flight = in_flight
        self.stop_after = stop_after
        self.crash_after = crash_after
        self.generated_ids: list = []
        self.max_pulled_ahead = 0
        self.stats = {}

    def describe(self) -> dict:
        return {"model": "stand-in", "dtype": "float32", "device": "cpu", "batchgen_version": "test"}

    def generate(self, requests, sampling=None, stop_event=None):
        pending = deque()
        source = iter(requests)
        exhausted = False
        yielded = pulled = 0
        while True:
            while not exhausted and len(pending) < self.in_flight:
                try:
                    pending.append(next(source))
                    pulled += 1
                    self.max_pulled_ahead = max(self.max_pulled_ahead, pulled - yielded)
                except StopIteration:
                    exhausted = True
            if not pending or (stop_event is not None and stop_event.is_set()):
                break
            request = pending.pop()  # newest first: results come back out of input order
            if self.crash_after is not None and yielded == self.crash_after:
                raise RuntimeError("engine crashed")
            self.generated_ids.append(request["id"])
            yield self._answer(request)
            yielded += 1
            if self.stop_after is not None and yielded == self.stop_after and stop_event is not None:
                stop_event.set()
        self.stats = {"generation_seconds": 0.5, "prompt_tokens": 0, "output_tokens": yielded}

    @staticmethod
    def _answer(request: dict) -> dict:
        prompt = request.get("prompt") or json.dumps(request.get("messages") or request.get("prompt_token_ids"))
        text = prompt[::-1][: request.get("max_tokens", 8)]
        carried = {k: v for k, v in request.items()
                   if k not in ("prompt", "messages", "prompt_token_ids", *SAMPLING_FIELDS)}
        return {
            **carried, "text": text, "output_token_ids": [ord(c) % 50 for c in text], "finish_reason": "length",
            "error": None, "prompt_tokens": len(prompt), "completion_tokens": len(text), "cached_prompt_tokens": 0,
            "num_preemptions": 0, "queue_s": 0.0, "ttft_s": 0.01, "prefill_s": 0.01, "decode_s": 0.02,
            "e2e_s": 0.03, "decode_tokens_per_s": 100.0,
        }


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(tmp_path: Path, input_path: Path, llm: StandInLLM | None = None, settings=None, **kw):
    llm = llm or StandInLLM()
    made = []

    def make_llm():
        made.append(1)
        return llm

    spec = JobSpec(input=input_path, output=tmp_path / "out.parquet", settings=settings or {"model": "stand-in"}, **kw)
    result = run_job(spec, make_llm, sampling=None, stop_event=threading.Event())
    return result, llm, bool(made)


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def prompts(n: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"prompt number {i}", "topic": i % 3} for i in range(n)]


def test_jsonl_job_writes_every_row_once_with_metadata(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    result, _, _ = run(tmp_path, src)
    assert result.status == "complete"
    rows = read_rows(tmp_path / "out.parquet")
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(10))
    by_id = {r["id"]: r for r in rows}
    assert by_id["r3"]["text"] == "3 rebmun tpmorp"[:8] and by_id["r3"]["topic"] == 0
    assert ROW_KEY not in rows[0]
    meta = json.loads(pq.read_schema(tmp_path / "out.parquet").metadata[b"batchgen"])
    for key in ("model", "dtype", "device", "batchgen_version", "rows", "rows_ok", "rows_error", "prompt_tokens",
                "output_tokens", "wall_seconds", "generation_seconds", "output_tokens_per_s"):
        assert key in meta, key
    assert (meta["rows"], meta["rows_ok"], meta["rows_error"]) == (10, 10, 0)
    assert meta["output_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert not workdir_for(tmp_path / "out.parquet").exists()


def test_source_is_pulled_lazily(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(500))
    result, llm, _ = run(tmp_path, src, llm=StandInLLM(in_flight=4))
    assert result.status == "complete"
    assert llm.max_pulled_ahead <= 4


def test_interrupted_job_keeps_finished_rows_and_resumes(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(12))
    result, first, _ = run(tmp_path, src, llm=StandInLLM(stop_after=5))
    assert result.status == "interrupted" and result.rows_this_run == 5
    assert not (tmp_path / "out.parquet").exists()
    result, second, _ = run(tmp_path, src)
    assert result.status == "complete" and result.rows_resumed == 5
    assert set(first.generated_ids).isdisjoint(second.generated_ids)
    ids = [r["id"] for r in read_rows(tmp_path / "out.parquet")]
    assert sorted(ids) == sorted(f"r{i}" for i in range(12))


def test_engine_crash_keeps_finished_rows(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(9))
    with pytest.raises(RuntimeError):
        run(tmp_path, src, llm=StandInLLM(crash_after=4), flush_seconds=3600)
    assert not (tmp_path / "out.parquet").exists()
    result, second, _ = run(tmp_path, src)
    assert result.rows_resumed == 4 and len(second.generated_ids) == 5
    assert len(read_rows(tmp_path / "out.parquet")) == 9


def test_leftover_with_other_settings_is_refused_until_no_resume(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(6))
    run(tmp_path, src, llm=StandInLLM(stop_after=2), settings={"model": "a", "temperature": 0.0})
    with pytest.raises(JobError, match=r"temperature: 0.0 then, 0.7 now.*--no-resume"):
        run(tmp_path, src, settings={"model": "a", "temperature": 0.7})
    result, llm, _ = run(tmp_path, src, settings={"model": "a", "temperature": 0.7}, resume=False)
    assert result.status == "complete" and result.rows_resumed == 0 and len(llm.generated_ids) == 6


def test_changed_input_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(6))
    run(tmp_path, src, llm=StandInLLM(stop_after=2))
    write_jsonl(src, prompts(7))
    with pytest.raises(JobError, match="input"):
        run(tmp_path, src)


def test_rerun_of_a_complete_job_does_nothing(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(4))
    run(tmp_path, src)
    before = (tmp_path / "out.parquet").stat().st_mtime_ns
    result, _, made = run(tmp_path, src)
    assert result.status == "already_complete" and not made
    assert (tmp_path / "out.parquet").stat().st_mtime_ns == before
    assert result.metadata["rows"] == 4
    result, _, made = run(tmp_path, src, resume=False)
    assert result.status == "complete" and made


def test_shards_partition_the_job(tmp_path):
    rows = prompts(11) + ["not json"]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    whole, _, _ = run(tmp_path, src)
    whole_rows = read_rows(tmp_path / "out.parquet")
    union = []
    for i in range(3):
        spec_out = tmp_path / f"shard{i}"
        spec_out.mkdir()
        result, _, _ = run(spec_out, src, shard=Shard(i, 3))
        part = read_rows(spec_out / "out.parquet")
        assert len(part) == result.rows_total == len(range(i, 12, 3))
        union += part
    key = lambda r: str(r["id"])  # noqa: E731
    assert sorted(union, key=key) == sorted(whole_rows, key=key)


def test_bad_rows_become_error_rows_and_the_job_goes_on(tmp_path):
    path = tmp_path / "in.jsonl"
    good = {"id": "ok", "prompt": "hello"}
    lines = [
        json.dumps(good).encode(),
        b"{not json",
        b"[1, 2]",
        b'{"id": "bad-utf8", "prompt": "caf\xe9"}',
        json.dumps({"id": "none"}).encode(),
        json.dumps({"id": "two", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}).encode(),
        json.dumps({"id": "type", "prompt": 5}).encode(),
        json.dumps({"id": "empty", "prompt": ""}).encode(),
        json.dumps({"id": "ok", "prompt": "again"}).encode(),
        json.dumps({"id": "mt", "prompt": "x", "max_tokens": "many"}).encode(),
        b"",  # blank: skipped, not a row
        json.dumps({"id": 3.5, "prompt": "x"}).encode(),
        json.dumps({"id": "msg", "messages": [{"role": "user"}]}).encode(),
        json.dumps({"id": "tok", "prompt_token_ids": [1, "a"]}).encode(),
        json.dumps({"id": "res", "prompt": "x", "text": "mine"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    result, llm, _ = run(tmp_path, path)
    assert result.status == "complete"
    rows = {(r["id"] if r["error"] is None else r["error"]): r for r in read_rows(tmp_path / "out.parquet")}
    assert len(rows) == 14 and llm.generated_ids == ["ok"]
    errors = sorted(rows)
    expected = [
        "not JSON", "not a JSON object (got an array)", "not valid UTF-8", "no prompt",
        "more than one prompt field (prompt, messages)", "prompt must be a string, got int", "prompt is empty",
        "id 'ok' already seen", "max_tokens must be an integer, got str",
        "id must be a string or an integer, got float",
        "messages[0].content must be a string", "prompt_token_ids[1] must be an integer", "reserved for the output",
    ]
    for fragment in expected:
        assert any(fragment in e for e in errors), fragment
    by_error = {r["error"]: r for r in rows.values() if r["error"]}
    assert all(r["finish_reason"] == "error" and r["text"] is None for r in by_error.values())
    ids = {r["error"].split(":")[0]: r["id"] for r in by_error.values()}
    assert ids["not JSON"] == "#line:2" and ids["not valid UTF-8 (at byte offset 33 of the line)"] == "#line:4"
    dup = next(r for r in by_error.values() if "already seen" in r["error"])
    assert dup["id"] == "#line:9"  # an id already seen is not usable: its line's fallback id stands in
    assert "\n" not in "".join(by_error)


def test_parquet_input_keeps_carried_column_types(tmp_path):
    table = pa.table({
        "id": pa.array([10, 11, 12], pa.int32()),
        "prompt": ["a b", "c d", None],
        "messages": pa.array([None, None, [{"role": "user", "content": "hi"}]],
                             pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        "max_tokens": pa.array([2, None, 3], pa.int64()),
        "when": pa.array([1_700_000_000_000, 1_700_000_000_001, None], pa.timestamp("ms")),
        "tags": pa.array([["x"], [], None], pa.list_(pa.string())),
        "score": pa.array([0.5, None, 1.5], pa.float32()),
    })
    pq.write_table(table, tmp_path / "in.parquet")
    result, llm, _ = run(tmp_path, tmp_path / "in.parquet")
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.schema.field("id").type == pa.int64()
    for name in ("when", "tags", "score"):
        assert out.schema.field(name).type == table.schema.field(name).type
    assert "prompt" not in out.column_names and "max_tokens" not in out.column_names
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows[10]["text"] == "b " and rows[11]["tags"] == [] and rows[12]["score"] == 1.5
    assert sorted(llm.generated_ids) == [10, 11, 12]


def test_jsonl_column_types_widen_across_parts(tmp_path):
    rows = [
        {"prompt": "a", "num": 1, "mixed": "x", "meta": {"k": 1}, "flag": True},
        {"prompt": "b", "num": 2.5, "mixed": 3, "meta": None, "flag": False},
        {"prompt": "c", "mixed": [1], "only_here": None},
        {"id": "named", "prompt": "d"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run(tmp_path, src, flush_rows=1)  # one part per row: every column's type is widened at merge
    out = pq.read_table(tmp_path / "out.parquet")
    types = {f.name: f.type for f in out.schema}
    assert types["id"] == pa.string() and types["num"] == pa.float64() and types["flag"] == pa.bool_()
    assert types["mixed"] == pa.string() and types["meta"] == pa.string() and types["only_here"] == pa.string()
    by_prompt_text = {r["text"]: r for r in out.to_pylist()}
    assert by_prompt_text["a"]["num"] == 1.0 and by_prompt_text["a"]["meta"] == '{"k": 1}'
    assert {r["mixed"] for r in out.to_pylist()} == {'"x"', "3", "[1]", None}
    assert sorted(r["id"] for r in out.to_pylist()) == ["0", "1", "2", "named"]


def test_jsonl_integer_ids_stay_integers(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"id": 7, "prompt": "b"}])
    run(tmp_path, src)
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.schema.field("id").type == pa.int64()
    assert sorted(out.column("id").to_pylist()) == [0, 7]


def test_second_run_on_the_same_output_is_refused_while_the_first_holds_it(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    errors = []

    class Reentrant(StandInLLM):
        def generate(self, requests, sampling=None, stop_event=None):
            try:
                run(tmp_path, src)
            except JobError as e:
                errors.append(str(e))
            yield from super().generate(requests, sampling, stop_event)

    result, _, _ = run(tmp_path, src, llm=Reentrant())
    assert result.status == "complete"
    assert errors and "another batchgen run" in errors[0]


def test_a_work_directory_batchgen_did_not_make_is_left_alone(tmp_path):
    """OUTPUT.partial/ holding files but no lock (the user's, not a run's leftover) would be emptied and deleted
    with the job's parts: refused, and nothing in it touched; a file of that name is refused too. Afterwards
    an empty folder there is used (and removed when the job is done)."""
    src = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    workdir = workdir_for(tmp_path / "out.parquet")
    workdir.mkdir()
    (workdir / "notes.txt").write_text("mine")
    with pytest.raises(JobError, match="not a batchgen work directory"):
        run(tmp_path, src)
    assert (workdir / "notes.txt").read_text() == "mine" and not (tmp_path / "out.parquet").exists()
    (workdir / "notes.txt").unlink()
    workdir.rmdir()
    workdir.write_text("a file")
    with pytest.raises(JobError, match="in the way"):
        run(tmp_path, src)
    assert workdir.read_text() == "a file"
    workdir.unlink()
    workdir.mkdir()
    result, _, _ = run(tmp_path, src)
    assert result.status == "complete" and len(read_rows(tmp_path / "out.parquet")) == 3 and not workdir.exists()


def test_an_output_folder_that_cannot_be_made_is_one_clear_error(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", prompts(1))
    spec = JobSpec(input=src, output=src / "out.parquet", settings={"model": "stand-in"})  # (under a file)
    with pytest.raises(JobError, match="cannot make OUTPUT's folder"):
        run_job(spec, StandInLLM, sampling=None, stop_event=threading.Event())
