"""`batchgen run` end to end: the real CLI, the real engine, the embedded default model. The CLI runs in a
subprocess where a kill or a signal is the point, else through its entry point in this process (conftest's
`batchgen` fixture, which shadows this module's subprocess `batchgen` there): a subprocess pays ~10 s of
imports before its first token.

Kept small for CI's 2 CPU cores: a handful of rows, --max-tokens <= 16, greedy where texts are compared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# The job the interruption and sharding tests share (its reference output: conftest's run_job): every row
# runs to exactly 8 tokens, two at a time, each finished row saved at once, so that a signal lands while
# some rows are saved and others are not.
JOB_ROWS = [{"id": f"row{i}", "prompt": f"Write a short note number {i} about the weather in spring."}
            for i in range(10)]
# fp32: these tests compare greedy texts of runs that batch rows differently (resumed, sharded); in
# bf16 (the CPU default where it is native) a different batch can round a near-tie the other way.
JOB_OPTIONS = [
    "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--max-num-seqs", "2", "--flush-rows", "1",
    "--dtype", "float32",
]


def batchgen(*args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout, env=environment(env),
                          cwd=REPO)


def command(*args) -> list[str]:
    return [sys.executable, "-m", "batchgen.cli", *map(str, args)]


def environment(extra: dict | None = None) -> dict:
    # the caller's BATCHGEN_* settings must not leak into the tests (the model cache may)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_") or k == "BATCHGEN_CACHE"}
    return {**env, **(extra or {})}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def read(path: Path) -> tuple[list[dict], dict]:
    table = pq.read_table(path)
    return table.to_pylist(), json.loads(table.schema.metadata[b"batchgen"])


def texts(rows: list[dict]) -> dict:
    return {r["id"]: (r["text"], r["output_token_ids"]) for r in rows}


def assert_metrics_consistent(rows: list[dict]) -> None:
    for r in rows:
        assert r["completion_tokens"] == len(r["output_token_ids"])
        if r["finish_reason"] == "error":
            assert r["error"] and r["text"] is None and r["e2e_s"] is None
            continue
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None and r["prompt_tokens"] > 0
        assert 0 <= r["queue_s"] <= r["ttft_s"] <= r["e2e_s"]
        assert r["prefill_s"] >= 0 and r["decode_s"] >= 0
        assert r["ttft_s"] + r["decode_s"] == pytest.approx(r["e2e_s"], abs=1e-3)


def test_jsonl_job_end_to_end(batchgen, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "paris", "messages": [{"role": "user", "content": "What is the capital of France?"}], "lang": "en"},
        {"id": "story", "prompt": "Once upon a time", "max_tokens": 4, "lang": "en"},
        {"prompt_token_ids": [1, 504, 3575, 282], "lang": None},
    ])
    out = tmp_path / "out" / "result.parquet"  # its folder is made
    # fp32: the first token of the France answer is a near-tie ("The" -1.88 vs "L" -1.97 in fp32);
    # bf16 greedy (the CPU default where it is native) picks "L" ("L'Étoile, la Marseillaise,")
    done = batchgen("run", src, out, "--max-tokens", "12", "--temperature", "0", "--dtype", "float32",
                    "--log-every", "0")
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {"paris", "story", "2"}
    assert "Paris" in by_id["paris"]["text"] and by_id["paris"]["finish_reason"] == "stop"
    assert by_id["story"]["completion_tokens"] == 4 and by_id["story"]["finish_reason"] == "length"
    assert by_id["paris"]["lang"] == "en" and by_id["2"]["lang"] is None
    assert_metrics_consistent(rows)
    schema = pq.read_schema(out)
    assert schema.field("output_token_ids").type == pa.list_(pa.int32())
    assert schema.field("ttft_s").type == pa.float64() and schema.field("prompt_tokens").type == pa.int64()
    assert meta["device"] == "cpu" and meta["dtype"] and "SmolLM2" in meta["model"] and meta["batchgen_version"]
    assert (meta["rows"], meta["rows_ok"], meta["rows_error"]) == (3, 3, 0)
    assert meta["output_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert meta["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert meta["generation_seconds"] > 0 and meta["output_tokens_per_s"] > 0 and meta["wall_seconds"] > 0
    assert meta["max_num_seqs"] == 256 and "kv_cache_tokens" in meta
    assert "done: 3 rows (3 ok, 0 errors)" in done.stdout and "latency: e2e p50" in done.stdout
    assert not (tmp_path / "out" / "result.parquet.partial").exists()

    again = batchgen("run", src, out, "--max-tokens", "12", "--temperature", "0", "--dtype", "float32")
    assert again.returncode == 0 and "already complete" in again.stdout


def test_fp8_kv_cache_job_says_so_in_its_metadata(batchgen, tmp_path):
    out = tmp_path / "out.parquet"
    done = batchgen("run", REPO / "examples" / "prompts.parquet", out, "--max-tokens", "3", "--kv-cache-dtype", "fp8",
                    "--log-every", "0")
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    assert meta["kv_cache_dtype"] == "float8_e4m3fn" and meta["rows_error"] == 0 and rows
    assert all(r["error"] is None and r["completion_tokens"] > 0 for r in rows)


def test_parquet_job_end_to_end_with_settings_from_the_environment(batchgen, tmp_path):
    out = tmp_path / "out.parquet"
    done = batchgen("run", REPO / "examples" / "prompts.parquet", out,
                    env={"BATCHGEN_MAX_TOKENS": "3", "BATCHGEN_TEMPERATURE": "0", "BATCHGEN_SEED": "7"})
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    source = pq.read_table(REPO / "examples" / "prompts.parquet")
    assert sorted(r["id"] for r in rows) == source.column("id").to_pylist()
    schema = pq.read_schema(out)
    assert schema.field("id").type == pa.int64()
    assert schema.field("tags").type == source.schema.field("tags").type
    assert schema.field("source").type == pa.string() and "prompt" not in schema.names
    limits = dict(zip(source.column("id").to_pylist(), source.column("max_tokens").to_pylist()))
    assert all(r["completion_tokens"] <= (limits[r["id"]] or 3) and r["source"] == "example" for r in rows)
    assert any(r["completion_tokens"] > 3 for r in rows)  # a row's own max_tokens beats the job's
    assert meta["fingerprint"]["max_tokens"] == 3 and meta["seed"] == 7
    assert_metrics_consistent(rows)


def test_bad_rows_of_every_kind_become_error_rows(batchgen, tmp_path):
    good = {"id": "good", "prompt": "Hello"}
    lines = [
        good,
        b"{this is not json",
        b'"just a string"',
        b'{"id": "utf8", "prompt": "caf\xe9"}',
        {"id": "noprompt", "lang": "en"},
        {"id": "two", "prompt": "a", "prompt_token_ids": [1]},
        {"id": "type", "prompt": ["a"]},
        {"id": "empty", "prompt": ""},
        {"id": "range", "prompt_token_ids": [1, 10**9]},
        {"id": "temp", "prompt": "a", "temperature": -1},
        {"id": "topp", "prompt": "a", "top_p": 2.5},
        {"id": "long", "prompt": "word " * 100},
        {"id": "good", "prompt": "Hello again"},
        {"id": "maxtok", "prompt": "a", "max_tokens": "ten"},
    ]
    src = write_jsonl(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out.parquet"
    done = batchgen("run", src, out, "--max-tokens", "2", "--max-model-len", "64")
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    assert len(rows) == len(lines) and (meta["rows_ok"], meta["rows_error"]) == (1, len(lines) - 1)
    errors = {r["id"]: r["error"] for r in rows if r["finish_reason"] == "error"}
    expected = {
        "#line:2": "not JSON", "#line:3": "not a JSON object", "#line:4": "not valid UTF-8", "noprompt": "no prompt",
        "two": "more than one prompt field", "type": "prompt must be a string", "empty": "prompt is empty",
        "range": "outside the vocabulary", "temp": "temperature", "topp": "top_p", "long": "exceeds the limit",
        "#line:13": "id 'good' already seen", "maxtok": "max_tokens must be an integer",
    }
    for row_id, fragment in expected.items():
        assert fragment in errors[row_id], (row_id, errors[row_id])
    assert all("\n" not in e for e in errors.values())
    assert_metrics_consistent(rows)
    assert "1 ok, 13 errors" in done.stdout

    strict = batchgen("run", src, out, "--max-tokens", "2", "--max-model-len", "64", "--strict")
    assert strict.returncode == 65, strict.stderr
    assert "13 rows failed" in strict.stderr


def test_logprobs_columns_when_rows_ask_for_them(batchgen, tmp_path):
    """`logprobs` / `prompt_logprobs` are request options, not carried columns: the output gets
    list<double> columns of that name (null where a row did not ask or failed), from JSONL and Parquet."""
    rows = [
        {"id": "a", "prompt": "Hello", "logprobs": True},
        {"id": "b", "prompt": "Hi there", "prompt_logprobs": True, "logprobs": False},
        {"id": "c", "prompt": ""},  # an error row first in completion order: its columns are null
        {"id": "d", "prompt": "Hey", "logprobs": "yes"},
    ]
    src_jsonl = write_jsonl(tmp_path / "in.jsonl", rows)
    src_parquet = tmp_path / "in.parquet"
    keys = ("id", "prompt", "logprobs", "prompt_logprobs")
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows if r["id"] != "d"]), src_parquet)
    for src in (src_jsonl, src_parquet):
        out = tmp_path / f"out-{src.suffix[1:]}.parquet"
        done = batchgen("run", src, out, "--max-tokens", "3", "--temperature", "0")
        assert done.returncode == 0, done.stderr
        table = pq.read_table(out)
        for name in ("logprobs", "prompt_logprobs"):
            assert table.schema.field(name).type == pa.list_(pa.float64()), (src, table.schema)
        got = {r["id"]: r for r in table.to_pylist()}
        assert len(got["a"]["logprobs"]) == len(got["a"]["output_token_ids"]) == 3
        assert all(lp <= 0 for lp in got["a"]["logprobs"]) and got["a"]["prompt_logprobs"] is None
        assert got["b"]["logprobs"] is None
        assert len(got["b"]["prompt_logprobs"]) == got["b"]["prompt_tokens"] - 1
        assert got["c"]["finish_reason"] == "error" and got["c"]["logprobs"] is None
        if "d" in got:
            assert got["d"]["error"] == "logprobs must be true or false, got str"


def test_sigkill_mid_job_then_rerun_gives_every_row_once_and_the_same_texts(run_job, batchgen, tmp_path):
    src, whole = run_job
    out = tmp_path / "out.parquet"
    workdir = tmp_path / "out.parquet.partial"
    saved = killed_after_first_part("run", src, out, *JOB_OPTIONS)
    assert not out.exists() and 0 < saved < len(JOB_ROWS)

    done = batchgen("run", src, out, *JOB_OPTIONS)
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in JOB_ROWS)
    assert meta["rows_resumed"] >= saved and meta["rows"] == len(JOB_ROWS)
    assert texts(rows) == texts(whole)
    assert not workdir.exists()


def test_sigterm_exits_75_leaves_nothing_at_output_and_the_rerun_completes(run_job, batchgen, tmp_path):
    src, whole = run_job
    out = tmp_path / "out.parquet"
    workdir = tmp_path / "out.parquet.partial"
    process = subprocess.Popen(command("run", src, out, *JOB_OPTIONS), env=environment(), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_parts(process, workdir)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr
    assert time.monotonic() - signalled < 15
    assert "rerun the same command to resume" in stdout
    assert not out.exists() and workdir.exists()

    done = batchgen("run", src, out, *JOB_OPTIONS)
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    assert meta["rows_resumed"] > 0
    assert texts(rows) == texts(whole)


def test_shards_union_is_the_whole_job(run_job, batchgen, tmp_path):
    src, whole = run_job
    union = []
    for i in range(3):
        out = tmp_path / f"shard-{i}.parquet"
        done = batchgen("run", src, out, *JOB_OPTIONS, "--shard", f"{i}/3")
        assert done.returncode == 0, done.stderr
        rows, meta = read(out)
        assert meta["shard"] == f"{i}/3" and len(rows) == len(range(i, len(JOB_ROWS), 3))
        union += rows
    assert len(union) == len(whole)
    assert texts(union) == texts(whole)


def test_leftover_with_other_settings_is_refused(run_job, batchgen, tmp_path):
    src, _ = run_job
    out = tmp_path / "out.parquet"
    process = subprocess.Popen(command("run", src, out, *JOB_OPTIONS), env=environment(), cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_parts(process, tmp_path / "out.parquet.partial")
    process.kill()
    process.wait(timeout=30)
    refused = batchgen("run", src, out, *JOB_OPTIONS, "--temperature", "0.5")
    assert refused.returncode == 1
    assert "other settings" in refused.stderr and "temperature: 0.0 then, 0.5 now" in refused.stderr
    assert "--no-resume" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def killed_after_first_part(*args, timeout: float = 300) -> int:
    """`batchgen run SRC OUT ...` (args) in a subprocess, SIGKILLed once it has saved a row -> rows saved."""
    out = Path(args[2])
    process = subprocess.Popen(command(*args), env=environment(), cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = wait_for_parts(process, out.with_name(out.name + ".partial"), timeout)
    process.kill()
    process.wait(timeout=60)
    return saved


def wait_for_parts(process: subprocess.Popen, workdir: Path, timeout: float = 300) -> int:
    """Waits until the running job has saved at least one row; -> rows saved."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parts = sorted(workdir.glob("part-*.parquet"))
        if parts:
            return sum(pq.read_metadata(p).num_rows for p in parts)
        assert process.poll() is None, "the job ended before saving a row"
        time.sleep(0.02)
    process.kill()
    raise AssertionError("no row saved in time")


def test_structured_outputs_and_top_logprobs_from_jsonl_and_parquet(batchgen, tmp_path):
    """Constraints as objects (JSONL) or JSON text in string columns (Parquet); top_logprobs is a
    list<list<struct>> column; a bad constraint is an error row naming its field."""
    choice = {"choice": ["yes", "no"]}
    rows = [
        {"id": "a", "prompt": "Is the sky blue?", "structured_outputs": choice, "top_logprobs": 2},
        {"id": "b", "prompt": "A number:", "structured_outputs": {"regex": "[0-9]{2}"}},
        {"id": "c", "prompt": "Hi", "structured_outputs": {"regex": "[0-9"}},
    ]
    src_jsonl = write_jsonl(tmp_path / "in.jsonl", rows)
    src_parquet = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([
        {**r, "structured_outputs": json.dumps(r["structured_outputs"]), "top_logprobs": r.get("top_logprobs")}
        for r in rows]), src_parquet)
    for src in (src_jsonl, src_parquet):
        out = tmp_path / f"out-{src.suffix[1:]}.parquet"
        done = batchgen("run", src, out, "--max-tokens", "4", "--temperature", "0")
        assert done.returncode == 0, done.stderr
        table = pq.read_table(out)
        assert "structured_outputs" not in table.column_names
        entry = table.schema.field("top_logprobs").type.value_type.value_type
        assert [f.name for f in entry] == ["token_id", "token", "logprob"]
        got = {r["id"]: r for r in table.to_pylist()}
        assert got["a"]["text"] in ("yes", "no") and got["a"]["finish_reason"] == "stop"
        assert len(got["a"]["top_logprobs"]) == len(got["a"]["output_token_ids"])
        assert all(len(top) == 2 for top in got["a"]["top_logprobs"])
        assert len(got["b"]["text"]) == 2 and got["b"]["text"].isdigit() and got["b"]["top_logprobs"] is None
        assert got["c"]["finish_reason"] == "error" and got["c"]["error"].startswith("structured_outputs.regex:")
