"""The Redis queue's protocol pieces against a real redis-server, with a stand-in engine: fast, no model.

The stand-in follows the engine's contract for a live source: it pulls requests only while it has
room, takes None as "nothing right now", yields results out of order, honours stop_event, carries
unknown keys through; a request whose prompt is "poison" makes it raise, as a request that breaks the
engine would.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from batchgen.io.rows import ROW_KEY
from batchgen.queue import Keys, Worker, WorkerConfig, collect_job, connect, redact, submit_job
from batchgen.queue.metrics import WorkerMetrics
from batchgen.queue.protocol import GROUP, ensure_group
from batchgen.queue.submit import SubmitError
from batchgen.schema import SAMPLING_FIELDS
from tests.redis_server import PASSWORD, USER, RedisServer, prefix, redis_server, self_signed_tls  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class StandInLLM:
    """Answers a prompt with its reverse; finishes the oldest request each step."""

    def __init__(self, room: int = 3, step_s: float = 0.0) -> None:
        self.room, self.step_s = room, step_s
        self.calls = 0

    def describe(self) -> dict:
        return {"model": "stand-in", "dtype": "float32", "device": "cpu"}

    def generate(self, requests, sampling=None, stop_event=None):
        self.calls += 1
        active: deque = deque()
        source = iter(requests)
        exhausted = False
        while True:
            while not exhausted and len(active) < self.room:
                try:
                    request = next(source)
                except StopIteration:
                    exhausted = True
                    break
                if request is None:
                    break
                active.append(request)
            if stop_event is not None and stop_event.is_set():
                return
            if not active:
                if exhausted:
                    return
                continue
            time.sleep(self.step_s)
            request = active.popleft()
            if request.get("prompt") == "poison":
                raise RuntimeError("the engine fell over")
            yield answer(request)


def answer(request: dict) -> dict:
    text = request["prompt"][::-1]
    inputs = ("prompt", "messages", "prompt_token_ids", *SAMPLING_FIELDS)
    carried = {k: v for k, v in request.items() if k not in inputs}
    return {**carried, "text": text, "output_token_ids": [1, 2], "finish_reason": "length", "error": None,
            "prompt_tokens": 3, "completion_tokens": 2, "cached_prompt_tokens": 0, "num_preemptions": 0,
            "queue_s": 0.0, "ttft_s": 0.01, "prefill_s": 0.01, "decode_s": 0.01, "e2e_s": 0.02,
            "decode_tokens_per_s": 100.0}


class Running:
    """A Worker serving on a thread of this process."""

    def __init__(self, client, keys, llm, **config) -> None:
        config.setdefault("consumer", "w1")
        config.setdefault("block_ms", 50)
        self.worker = Worker(client, keys, llm, None, WorkerConfig(**config), WorkerMetrics(llm),
                             {"model": "stand-in"})
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.counts = self.worker.run()
        except BaseException as e:  # noqa: BLE001 (reported by stop())
            self.error = e

    def stop(self) -> dict:
        self.worker.drain()
        self.thread.join(30)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.counts


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def results(client, keys: Keys, job: str) -> list[dict]:
    """The job's result stream entries: index (or None), worker, the result row."""
    out = []
    for _id, fields in client.xrange(keys.results(job)):
        fields = {k.decode(): v.decode() for k, v in fields.items()}
        out.append({"index": int(fields["index"]) if "index" in fields else None, "worker": fields["worker"],
                    "row": json.loads(fields["result"])})
    return out


def dead_letters(client, keys: Keys) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _id, fields in client.xrange(keys.dead)]


@pytest.fixture
def client(redis_server):
    return redis_server.client()


@pytest.fixture
def keys(prefix):
    return Keys(prefix)


ROWS = [{"id": f"r{i}", "prompt": f"prompt number {i}", "tag": i} for i in range(6)]


# --- submit ---------------------------------------------------------------------------------------


def test_submit_queues_good_rows_and_answers_bad_ones_at_once(tmp_path, client, keys):
    src = write_jsonl(tmp_path / "in.jsonl", [*ROWS[:3], {"id": "x"}, "not json", {"id": "r0", "prompt": "again"}])
    result = submit_job(client, keys, "j", src)
    assert (result.rows, result.queued, result.errors) == (6, 3, 3)
    info = client.hgetall(keys.job("j"))
    assert info[b"rows"] == b"6" and info[b"submitted"] == b"6"
    messages = client.xrange(keys.requests)
    assert [m[1][b"job"] for m in messages] == [b"j"] * 3
    assert [int(m[1][b"index"]) for m in messages] == [0, 1, 2]
    request = json.loads(messages[0][1][b"request"])
    assert request == {"id": "r0", "prompt": "prompt number 0", "tag": 0}  # no bookkeeping keys
    errors = results(client, keys, "j")
    assert [e["index"] for e in errors] == [3, 4, 5]
    assert [e["row"]["finish_reason"] for e in errors] == ["error"] * 3
    assert "already seen" in errors[2]["row"]["error"] and errors[2]["row"]["id"] == "#line:6"
    # the consumer group exists from the start, at id 0: a worker started later misses nothing
    assert client.xinfo_groups(keys.requests)[0]["name"] == GROUP.encode()


def test_submit_again_adds_nothing_and_an_interrupted_submit_continues(tmp_path, client, keys, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    import batchgen.queue.submit as submit_module

    real_add, calls = submit_module._add, []

    def failing_add(*args):
        calls.append(1)
        if len(calls) == 2:
            raise redis.ConnectionError("connection lost")
        return real_add(*args)

    monkeypatch.setattr(submit_module, "_add", failing_add)
    with pytest.raises(redis.ConnectionError):
        submit_job(client, keys, "j", src, batch_rows=2)
    assert client.xlen(keys.requests) == 2
    monkeypatch.undo()
    again = submit_job(client, keys, "j", src, batch_rows=2)
    assert (again.earlier, again.queued) == (2, 4)
    assert submit_job(client, keys, "j", src).queued == 0
    indices = [int(m[1][b"index"]) for m in client.xrange(keys.requests)]
    assert indices == list(range(6))


def test_submit_refuses_another_input_under_a_used_job_name(tmp_path, client, keys):
    submit_job(client, keys, "j", write_jsonl(tmp_path / "a.jsonl", ROWS))
    with pytest.raises(SubmitError, match="already exists with another input"):
        submit_job(client, keys, "j", write_jsonl(tmp_path / "b.jsonl", ROWS[:2]))


def test_submit_refuses_parquet_columns_that_json_cannot_carry(tmp_path, client, keys):
    table = pa.table({"prompt": ["a"], "when": pa.array([0], pa.timestamp("us"))})
    pq.write_table(table, tmp_path / "in.parquet")
    with pytest.raises(SubmitError, match=r"when \(timestamp"):
        submit_job(client, keys, "j", tmp_path / "in.parquet")


# --- the worker -------------------------------------------------------------------------------------


def test_worker_answers_every_request_once_then_acknowledges_and_deletes_it(tmp_path, client, keys):
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", ROWS))
    running = Running(client, keys, StandInLLM())
    wait_for(lambda: client.xlen(keys.results("j")) == 6, what="6 results")
    counts = running.stop()
    answers = results(client, keys, "j")
    assert sorted(a["index"] for a in answers) == list(range(6))
    by_index = {a["index"]: a["row"] for a in answers}
    assert all(by_index[i]["text"] == ROWS[i]["prompt"][::-1] and by_index[i]["tag"] == i for i in range(6))
    assert all("__batchgen_msg__" not in a["row"] for a in answers)
    assert client.xlen(keys.requests) == 0  # acknowledged and deleted
    assert client.xpending(keys.requests, GROUP)["pending"] == 0
    assert counts["results"] == 6 and counts["reclaimed"] == 0
    assert json.loads(client.hget(keys.workers("j"), "w1")) == {"model": "stand-in"}
    # a worker that leaves owning nothing leaves no consumer behind
    assert client.xinfo_consumers(keys.requests, GROUP) == []


def test_malformed_messages_get_an_error_result_or_a_dead_letter_and_the_worker_goes_on(client, keys):
    ensure_group(client, keys)
    bad = [
        {"index": "0", "request": "{}"},  # no job: dead letter only
        {"job": "j", "index": "1", "request": "{not json"},
        {"job": "j", "index": "2", "request": "[1, 2]"},
        {"job": "j", "index": "3", "request": json.dumps({"id": {"a": 1}, "prompt": "x"})},
        {"job": "j", "index": "4", "request": b"\xff\xfe"},
        {"job": "j", "index": "5", "request": json.dumps({"id": "t", "prompt": "x", "text": "mine"})},
        {"job": "j", "index": "zz", "request": json.dumps({"prompt": "x"})},
    ]
    for fields in bad:
        client.xadd(keys.requests, fields)
    client.xadd(keys.requests, {"job": "j", "index": "6", "request": json.dumps({"id": "ok", "prompt": "fine"})})
    running = Running(client, keys, StandInLLM())
    wait_for(lambda: client.xlen(keys.results("j")) == 7, what="7 results")
    counts = running.stop()
    answers = {a["index"]: a["row"] for a in results(client, keys, "j")}
    assert answers[6]["text"] == "enif"
    errors = {i: answers[i]["error"] for i in (1, 2, 3, 4, 5)}
    assert "not JSON" in errors[1] and "not a JSON object" in errors[2] and "id must be" in errors[3]
    assert "not valid UTF-8" in errors[4] and "text" in errors[5] and "reserved" in errors[5]
    assert None in answers and "index field" in answers[None]["error"]  # no usable index: still answered
    assert all(answers[i]["finish_reason"] == "error" for i in (1, 2, 3, 4, 5, None))
    [dead] = dead_letters(client, keys)
    assert "no job field" in dead["reason"] and json.loads(dead["message"]) == {"index": "0", "request": "{}"}
    assert counts["malformed"] == 6 and counts["dead_letters"] == 1
    assert client.xlen(keys.requests) == 0


def test_poison_request_is_dead_lettered_after_max_deliveries_and_the_rest_finish(tmp_path, client, keys):
    rows = [*ROWS[:4], {"id": "p", "prompt": "poison"}, *ROWS[4:]]
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", rows))
    llm = StandInLLM(room=2)
    running = Running(client, keys, llm, max_deliveries=2, claim_idle_s=0.3)
    wait_for(lambda: client.xlen(keys.results("j")) == 7, what="7 results")
    counts = running.stop()
    answers = {a["index"]: a["row"] for a in results(client, keys, "j")}
    assert sorted(answers) == list(range(7))  # one result each, the poison's included
    assert answers[4]["finish_reason"] == "error" and "delivered 3 times" in answers[4]["error"]
    assert all(answers[i]["text"] == rows[i]["prompt"][::-1] for i in (0, 1, 2, 3, 5, 6))
    [dead] = dead_letters(client, keys)
    assert dead["deliveries"] == "3" and json.loads(json.loads(dead["message"])["request"])["prompt"] == "poison"
    # the engine failed on each of the 2 deliveries; the worker lived on
    assert counts["engine_failures"] == 2 and llm.calls == 3
    assert client.xlen(keys.requests) == 0


def test_a_dead_workers_requests_are_reclaimed_and_one_seen_too_often_is_dead_lettered(tmp_path, client, keys):
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", ROWS))
    # a worker that read three requests and died; one of them had been delivered to two earlier ones
    taken = client.xreadgroup(GROUP, "ghost", {keys.requests: ">"}, count=3)[0][1]
    for ghost in ("ghost2", "ghost3"):
        client.xclaim(keys.requests, GROUP, ghost, 0, [taken[0][0]])
    time.sleep(0.4)
    running = Running(client, keys, StandInLLM(), claim_idle_s=0.3, max_deliveries=3)
    wait_for(lambda: client.xlen(keys.results("j")) == 6, what="6 results")
    counts = running.stop()
    answers = {a["index"]: a["row"] for a in results(client, keys, "j")}
    assert sorted(answers) == list(range(6))
    assert "delivered 4 times" in answers[0]["error"]
    assert all(answers[i]["finish_reason"] == "length" for i in range(1, 6))
    assert counts["reclaimed"] == 3 and counts["dead_letters"] == 1
    assert client.xpending(keys.requests, GROUP)["pending"] == 0


def test_a_late_second_answer_is_dropped(tmp_path, client, keys):
    """A slow worker whose request was reclaimed and answered elsewhere: one result, not two."""
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", ROWS[:1]))
    [(msg_id, fields)] = client.xreadgroup(GROUP, "slow", {keys.requests: ">"})[0][1]
    running = Running(client, keys, StandInLLM(), claim_idle_s=0.05)
    wait_for(lambda: client.xlen(keys.results("j")) == 1, what="the first answer")
    running.stop()
    # the slow worker finishes now, through the same script the worker uses
    from batchgen.queue.protocol import FINISH, encode_result

    late = encode_result(msg_id.decode(), 0, "slow", answer(json.loads(fields[b"request"])))
    written = client.register_script(FINISH)(keys=[keys.requests, keys.results("j"), keys.dead],
                                             args=[GROUP, msg_id, len(late), *late])
    assert written == 0 and client.xlen(keys.results("j")) == 1


def test_heartbeat_keeps_a_live_workers_requests_and_release_hands_them_over(tmp_path, client, keys):
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", ROWS[:2]))
    [(a, _), (b, _)] = client.xreadgroup(GROUP, "w1", {keys.requests: ">"})[0][1]
    from batchgen.queue.protocol import TOUCH

    touch = client.register_script(TOUCH)
    client.xclaim(keys.requests, GROUP, "w1", 0, [a, b], idle=60_000, justid=True)  # long idle: looks dead
    assert touch(keys=[keys.requests], args=[GROUP, "w1", 0, 0, a, b]) == 2  # a heartbeat
    pending = client.xpending_range(keys.requests, GROUP, "-", "+", 10)
    assert all(p["time_since_delivered"] < 5_000 and p["times_delivered"] == 1 for p in pending)
    assert touch(keys=[keys.requests], args=[GROUP, "other", 0, 0, a]) == 0  # not its message: untouched
    assert touch(keys=[keys.requests], args=[GROUP, "w1", 9_000, 1, a]) == 1  # a release, try not counted
    claimed = client.xautoclaim(keys.requests, GROUP, "w2", min_idle_time=8_000)[1]
    assert [c[0] for c in claimed] == [a]
    assert client.xpending_range(keys.requests, GROUP, a, a, 1)[0]["times_delivered"] == 1


def test_drain_finishes_what_the_engine_has_and_hands_back_the_rest(tmp_path, client, keys):
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", ROWS))
    first = Running(client, keys, StandInLLM(room=2, step_s=0.3), max_in_flight=4, claim_idle_s=30,
                    drain_timeout_s=0.4)
    wait_for(lambda: client.xlen(keys.results("j")) >= 1, what="a first result")
    counts = first.stop()  # drain: at most 0.4 s more, then the engine drops what it has
    done = client.xlen(keys.results("j"))
    assert done < 6 and counts["released"] >= 1
    pending = client.xpending_range(keys.requests, GROUP, "-", "+", 10)
    # handed back: idle past the claim time, and this delivery taken off the count (the next one is "the first")
    assert pending and all(p["time_since_delivered"] >= 30_000 and p["times_delivered"] == 0 for p in pending)
    second = Running(client, keys, StandInLLM(), consumer="w2", claim_idle_s=30)
    wait_for(lambda: client.xlen(keys.results("j")) == 6, what="6 results")
    assert second.stop()["reclaimed"] == len(pending)
    assert sorted(a["index"] for a in results(client, keys, "j")) == list(range(6))


def test_results_wait_out_a_redis_restart_and_nothing_is_lost(tmp_path_factory, tmp_path, keys):
    server = RedisServer(tmp_path_factory.mktemp("restart")).start()
    try:
        client = server.client()
        rows = [{"id": i, "prompt": f"p{i}"} for i in range(12)]
        submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", rows))
        running = Running(connect(server.url()), keys, StandInLLM(room=2, step_s=0.1), max_in_flight=4,
                          claim_idle_s=2)
        wait_for(lambda: client.xlen(keys.results("j")) >= 2, what="two results")
        server.stop()
        time.sleep(1.5)  # the engine goes on; its results wait
        server.start()
        wait_for(lambda: client.xlen(keys.results("j")) == 12, what="12 results")
        counts = running.stop()
        assert sorted(a["index"] for a in results(client, keys, "j")) == list(range(12))
        assert counts["superseded"] == 0 and counts["redis_errors"] >= 1  # it did see the outage
    finally:
        server.stop()


# --- collect ----------------------------------------------------------------------------------------


def test_collect_keeps_one_result_per_row_and_writes_the_run_format(tmp_path, client, keys):
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", [*ROWS[:3], {"id": "bad"}]))
    taken = client.xreadgroup(GROUP, "w", {keys.requests: ">"})[0][1]
    from batchgen.queue.protocol import encode_result

    def add(index, row, request=""):
        fields = encode_result(request, index, "w", row)
        client.xadd(keys.results("j"), dict(zip(fields[::2], fields[1::2])))

    for index, (msg_id, fields) in enumerate(taken):
        add(index, answer(json.loads(fields[b"request"])), msg_id.decode())
    add(1, {**answer(ROWS[1]), "text": "second answer"})  # answered twice: the first one counts
    add(None, {"id": None, "text": None, "finish_reason": "error", "error": "malformed message: no request"}, "9-9")
    result = collect_job(client, keys, "j", tmp_path / "out.parquet", timeout_s=10)
    assert (result.rows, result.duplicates, result.extra) == (4, 1, 1)
    table = pq.read_table(tmp_path / "out.parquet")
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["r1"]["text"] == ROWS[1]["prompt"][::-1] and rows["bad"]["finish_reason"] == "error"
    assert table.column_names[:2] == ["id", "tag"] and ROW_KEY not in table.column_names
    meta = json.loads(table.schema.metadata[b"batchgen"])
    assert meta["rows"] == 5 and meta["rows_error"] == 2 and meta["duplicates_dropped"] == 1
    assert meta["job"] == "j" and meta["workers"] == []


def test_collect_keeps_a_parquet_inputs_column_types(tmp_path, client, keys):
    table = pa.table({"id": pa.array([10, 11], pa.int32()), "prompt": ["ab", "cd"],
                      "score": pa.array([1.5, None], pa.float32()), "tags": [["x"], []]})
    pq.write_table(table, tmp_path / "in.parquet")
    submit_job(client, keys, "j", tmp_path / "in.parquet")
    running = Running(client, keys, StandInLLM())
    wait_for(lambda: client.xlen(keys.results("j")) == 2, what="2 results")
    running.stop()
    collect_job(client, keys, "j", tmp_path / "out.parquet", timeout_s=10)
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.schema.field("id").type == pa.int64() and out.schema.field("score").type == pa.float32()
    assert out.schema.field("tags").type == pa.list_(pa.string())
    assert sorted(out.column("text").to_pylist()) == ["ba", "dc"]


def test_collect_keeps_top_logprobs(tmp_path, client, keys):
    """The top_logprobs column (list<list<struct>>) survives the JSON of the result stream, from a
    Parquet input whose rows ask for it and whose constraint is JSON text in a string column."""
    table = pa.table({"id": ["a", "b"], "prompt": ["ab", "cd"], "top_logprobs": [2, None],
                      "response_format": ['{"type": "json_object"}', None]})
    pq.write_table(table, tmp_path / "in.parquet")
    submit_job(client, keys, "j", tmp_path / "in.parquet")
    taken = client.xreadgroup(GROUP, "w", {keys.requests: ">"})[0][1]
    from batchgen.queue.protocol import encode_result

    top = [[{"token_id": 5, "token": "x", "logprob": -0.5}, {"token_id": 7, "token": " y", "logprob": -1.25}]] * 2
    for index, (msg_id, fields) in enumerate(taken):
        request = json.loads(fields[b"request"])
        row = answer(request)
        row.pop("top_logprobs", None)
        row.pop("response_format", None)
        if request["id"] == "a":
            row["top_logprobs"] = top
        encoded = encode_result(msg_id.decode(), index, "w", row)
        client.xadd(keys.results("j"), dict(zip(encoded[::2], encoded[1::2])))
    collect_job(client, keys, "j", tmp_path / "out.parquet", timeout_s=10)
    out = pq.read_table(tmp_path / "out.parquet")
    entry = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
    assert out.schema.field("top_logprobs").type == pa.list_(pa.list_(entry))
    got = {r["id"]: r for r in out.to_pylist()}
    assert got["a"]["top_logprobs"] == top and got["b"]["top_logprobs"] is None
    assert "response_format" not in out.column_names  # a request field, not a carried column


# --- the commands ------------------------------------------------------------------------------------


def test_submit_and_collect_commands_with_a_password_url(tmp_path, redis_server, prefix, batchgen, client):
    url = redis_server.url(USER, PASSWORD)
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    code, out, err = batchgen("submit", src, "--redis-url", url, "--prefix", prefix, "--job", "j")
    assert code == 0 and "2 requests added" in out and PASSWORD not in out, err
    code, out, err = batchgen("collect", tmp_path / "out.parquet", "--redis-url", url, "--prefix", prefix,
                              "--job", "j", "--timeout", "0.5")
    assert code == 124 and err.count("\n") == 1 and "2 of 2 rows of job 'j' have no result" in err
    running = Running(client, Keys(prefix), StandInLLM())
    wait_for(lambda: client.xlen(Keys(prefix).results("j")) == 2, what="2 results")
    running.stop()
    code, out, err = batchgen("collect", tmp_path / "out.parquet", "--redis-url", url, "--prefix", prefix,
                              "--job", "j", "--timeout", "10", "--delete")
    assert code == 0 and "done: 2 rows (2 ok, 0 errors)" in out, err
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 2
    assert not client.exists(Keys(prefix).job("j"), Keys(prefix).results("j"))
    code, _, err = batchgen("collect", tmp_path / "out.parquet", "--redis-url", url, "--prefix", prefix, "--job", "j")
    assert code == 1 and "no job 'j'" in err


@pytest.mark.parametrize("args, fragment", [
    (["submit", "{src}", "--redis-url", "http://x", "--job", "j"], "--redis-url"),
    (["submit", "{src}", "--redis-url", "redis://127.0.0.1:1", "--job", "a:b"], "--job"),
    (["submit", "{src}", "--redis-url", "redis://127.0.0.1:1", "--job", "j", "--prefix", "a b"], "--prefix"),
    (["submit", "missing.jsonl", "--redis-url", "redis://127.0.0.1:1", "--job", "j"], "INPUT"),
    (["collect", "out.parquet", "--redis-url", "redis://127.0.0.1:1", "--job", "j", "--timeout", "-1"], "--timeout"),
    (["worker", "--redis-url", "redis://127.0.0.1:1", "--max-deliveries", "0"], "--max-deliveries"),
    (["worker", "--redis-url", "redis://127.0.0.1:1", "--temperature", "-1"], "temperature"),
    (["worker", "--redis-url", "redis://127.0.0.1:1", "--log-format", "xml"], "--log-format"),
    (["worker"], "--redis-url"),
])
def test_queue_commands_usage_errors_are_one_line(tmp_path, batchgen, args, fragment):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    code, _, err = batchgen(*(a.replace("{src}", str(src)) for a in args))
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_worker_help_has_the_engine_and_sampling_options_of_run(batchgen, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    _, run_help, _ = batchgen("run", "--help")
    _, worker_help, _ = batchgen("worker", "--help")
    for option in ("--model", "--dtype", "-tp", "--max-num-seqs", "--kv-cache-tokens", "--max-tokens", "--temperature",
                   "--seed", "--stop", "BATCHGEN_MAX_TOKENS"):
        assert option in run_help and option in worker_help, option
    for option in ("--claim-idle-seconds", "--max-deliveries", "--drain-timeout", "--metrics-port", "--log-format",
                   "BATCHGEN_REDIS_URL", "--prefix"):
        assert option in worker_help, option


def test_submit_to_an_unreachable_redis_is_one_line(tmp_path, batchgen):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    code, _, err = batchgen("submit", src, "--redis-url", "redis://u:hidden@127.0.0.1:1", "--job", "j")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "u:***@127.0.0.1:1" in err and "hidden" not in err


def test_redact_hides_only_the_password():
    assert redact("redis://user:pw@host:6380/2") == "redis://user:***@host:6380/2"
    assert redact("rediss://:pw@host") == "rediss://:***@host"
    assert redact("redis://host:6379") == "redis://host:6379"


def test_metrics_are_served_with_vllm_style_names(tmp_path):
    class Engine:
        class scheduler:  # noqa: N801
            running, waiting = [1, 2], [3]

        class kv:  # noqa: N801
            num_used, num_slots = 25, 100

    llm = StandInLLM()
    llm.engine = Engine
    metrics = WorkerMetrics(llm)
    metrics.observe(answer({"id": 1, "prompt": "abc"}))
    metrics.observe({**answer({"id": 2, "prompt": "abc"}), "prompt_tokens": 10, "cached_prompt_tokens": 8})
    port = metrics.serve(0, addr="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        metrics.close()
    for line in ("batchgen:num_requests_running 2.0", "batchgen:num_requests_waiting 1.0",
                 "batchgen:kv_cache_usage_perc 0.25", "batchgen:generation_tokens_total 4.0",
                 'batchgen:request_success_total{finished_reason="length"} 2.0',
                 "batchgen:prefix_cache_queries_total 13.0", "batchgen:prefix_cache_hits_total 8.0",
                 "batchgen:time_to_first_token_seconds_count 2.0", "batchgen:e2e_request_latency_seconds_count 2.0"):
        assert line in body, line


def test_json_logs_are_one_object_a_line_with_the_extra_fields(capsys):
    import logging

    from batchgen.logs import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("json")
        logging.getLogger("batchgen.worker").warning("dead letter %s", "1-0", extra={"event": "dead_letter"})
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    entry = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert entry["message"] == "dead letter 1-0" and entry["event"] == "dead_letter" and entry["level"] == "warning"


def test_rediss_urls_connect_over_tls(tmp_path_factory):
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    workdir = tmp_path_factory.mktemp("tls")
    tls = self_signed_tls(workdir)
    server = RedisServer(workdir, tls=tls)
    try:
        server.start()
    except RuntimeError:
        pytest.skip("this redis-server has no TLS")
    try:
        client = connect(f"{server.url(USER, PASSWORD)}?ssl_ca_certs={tls['ca']}")
        ensure_group(client, Keys("tls"))
        assert client.xinfo_groups("tls:requests")[0]["name"] == GROUP.encode()
    finally:
        server.stop()


class SamplingStandIn(StandInLLM):
    """The stand-in, answering a request of n samples with n results (sample_index 0..n-1) that
    finish apart from each other."""

    def generate(self, requests, sampling=None, stop_event=None):
        def expanded():
            for request in requests:
                if request is None:
                    yield None
                    continue
                for i in range(request.get("n", 1)):
                    yield {**request, "sample_index": i}

        yield from super().generate(expanded(), sampling, stop_event)


def test_samples_of_a_row_are_answered_together_and_collected_once_each(tmp_path, client, keys):
    rows = [{**r, "n": 1 + i % 3} for i, r in enumerate(ROWS)]
    submit_job(client, keys, "j", write_jsonl(tmp_path / "in.jsonl", rows))
    running = Running(client, keys, SamplingStandIn(room=4))
    expected = sum(r["n"] for r in rows)
    wait_for(lambda: client.xlen(keys.results("j")) == expected, what=f"{expected} results")
    counts = running.stop()
    assert counts["results"] == len(rows)  # one answer per message, all its samples in it
    assert client.xpending(keys.requests, GROUP)["pending"] == 0
    entries = [{k.decode(): v.decode() for k, v in f.items()} for _id, f in client.xrange(keys.results("j"))]
    for i, row in enumerate(rows):  # a message's samples are written in one step: adjacent entries
        mine = [j for j, e in enumerate(entries) if e["index"] == str(i)]
        assert mine == list(range(mine[0], mine[0] + row["n"]))
    result = collect_job(client, keys, "j", tmp_path / "out.parquet", timeout_s=10)
    assert result.rows == len(rows) and result.duplicates == 0
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    pairs = sorted((r["id"], i) for r in rows for i in range(r["n"]))
    assert sorted((r["id"], r["sample_index"]) for r in out) == pairs
