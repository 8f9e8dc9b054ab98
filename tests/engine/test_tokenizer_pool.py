"""Tokenizing ahead of the engine loop and detokenizing behind it give what tokenizing in the loop
gives: the same token ids, the same error rows, the same texts."""
import random
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import batchgen.engine.engine
from batchgen import LLM, SamplingParams
from batchgen.engine.request import RequestError, RequestPreparer
from batchgen.engine.tokenizer_pool import OrderedWorker

CHAT_TOKENIZER = Path(__file__).resolve().parents[2] / "benchmarks" / "chat_tokenizer"  # SmolLM2's
WORDS = "the river runs north past old stone bridges while small boats wait for morning light".split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def mixed_rows(seed=0, n=150):
    """Good rows of each prompt kind, with a bad row now and then."""
    rng = random.Random(seed)
    bad = [
        42, {"max_tokens": 3}, {"prompt": "   "}, {"prompt_token_ids": [1, 2, 10**6]},
        {"prompt": "hi", "temperature": -1.0}, {"messages": [{"role": "user"}]},
        {"prompt": text(rng, 300), "max_tokens": 4},  # too long
    ]
    rows = []
    for i in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            row = {"prompt": text(rng, rng.randint(1, 30))}
        elif kind == 1:
            row = {"messages": [{"role": "system", "content": text(rng, 5)},
                                {"role": "user", "content": text(rng, rng.randint(1, 40))}]}
        elif kind == 2:
            row = {"prompt_token_ids": [rng.randrange(1, 300) for _ in range(rng.randint(1, 20))]}
        else:
            row = bad[i % len(bad)]
        if isinstance(row, dict):
            row = {"id": i, **row, "max_tokens": row.get("max_tokens", rng.randint(1, 8)), "tag": i}
        rows.append(row)
    return rows


def in_loop_ids(tok, row):
    """The prompt's ids as the engine tokenized a row by itself, between steps."""
    if "prompt" in row:
        return tok(row["prompt"]).input_ids
    if "messages" in row:
        return tok(tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
    return row["prompt_token_ids"]


def test_a_batch_prepares_each_row_as_alone_would():
    tok = AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
    prepare = RequestPreparer(SamplingParams(max_tokens=8), 0, tok, 49152, 256)
    rows = mixed_rows()
    batched = prepare(rows)
    alone = [prepare([row])[0] for row in rows]
    assert len(batched) == len(rows)
    kinds = set()
    for row, b, a in zip(rows, batched, alone):
        assert type(b) is type(a)
        if isinstance(b, RequestError):
            assert str(b) == str(a) and "\n" not in str(b)
            kinds.add("error")
        else:
            assert b.prompt_ids == a.prompt_ids == in_loop_ids(tok, row)
            assert (b.id, b.params, b.extras) == (a.id, a.params, a.extras) == (row["id"], a.params, {"tag": row["id"]})
            kinds.add(next(f for f in ("prompt", "messages", "prompt_token_ids") if f in row))
    assert kinds == {"prompt", "messages", "prompt_token_ids", "error"}


def results_by_id(llm, rows, params):
    """id -> the result's content; rows that are not objects (their id: their place, or #row:N where a row
    holds that id): None -> their results."""
    by_id = {None: []}
    for r in llm.generate(rows, params):
        content = {k: r.get(k) for k in ("text", "output_token_ids", "finish_reason", "error", "prompt_tokens",
                                         "completion_tokens", "tag")}
        if (r["error"] or "").startswith("a request must be"):
            by_id[None].append(content)
        else:
            assert r["id"] not in by_id
            by_id[r["id"]] = content
    return by_id


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=4),
    SamplingParams(temperature=0.8, max_tokens=4, stop=["e"]),  # stop strings: texts cut on the loop
])
def test_the_pool_gives_what_tokenizing_in_the_loop_gives(tiny_model, monkeypatch, params):
    """Rows in many tokenizer batches, over many pulls (a small lookahead), with bad rows among them:
    the same results, token for token and error for error, as tokenizing on the engine's thread."""
    monkeypatch.setattr(batchgen.engine.engine, "PREPARE_BATCH", 8)
    model = str(tiny_model("llama"))
    rows = [r if not isinstance(r, dict) else {k: v for k, v in r.items() if k != "max_tokens"}
            for r in mixed_rows(seed=1, n=100) if not (isinstance(r, dict) and "messages" in r)]
    options = dict(max_num_seqs=8, kv_cache_tokens=400, max_model_len=256, device="cpu", dtype="float32")
    pooled = results_by_id(LLM(model, **options), rows, params)
    in_loop = results_by_id(LLM(model, tokenizer_pool=False, **options), rows, params)
    assert pooled == in_loop
    not_rows = pooled.pop(None)
    assert len(pooled) + len(not_rows) == len(rows) and not_rows
    errors = [r for r in pooled.values() if r["error"]]
    assert 0 < len(errors) < len(pooled)
    tok = AutoTokenizer.from_pretrained(model)
    for r in pooled.values():
        if r["finish_reason"] == "length":  # its text decoded behind the loop
            assert r["text"] == tok.decode(r["output_token_ids"], skip_special_tokens=True)


def test_the_device_starts_on_the_first_batch_of_rows(tiny_model, monkeypatch):
    """With nothing running, the first step starts once the oldest batch of rows is prepared, not all
    of them; the step after it takes every other row read (waited for), and every row gets its result."""
    monkeypatch.setattr(batchgen.engine.engine, "PREPARE_BATCH", 4)
    llm = LLM(str(tiny_model("llama")), max_num_seqs=16, kv_cache_tokens=400, max_model_len=128)
    engine, events = llm.engine, []
    preparer, step = engine.request_preparer, engine.step

    def slow_preparer(defaults):
        prepare = preparer(defaults)

        def call(rows):
            if rows[0]["id"] >= 4:  # every batch after the first
                time.sleep(0.2)
            out = prepare(rows)
            events.append(("prepared", rows[0]["id"]))
            return out
        return call

    def logged_step():
        events.append(("step", len(engine.scheduler.running) + len(engine.scheduler.waiting)))
        return step()

    monkeypatch.setattr(engine, "request_preparer", slow_preparer)
    monkeypatch.setattr(engine, "step", logged_step)
    rows = [{"id": i, "prompt_token_ids": [1 + i, 2, 3]} for i in range(12)]
    results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=3))
    assert events[:3] == [("prepared", 0), ("step", 4), ("prepared", 4)]
    assert ("step", 12) in events  # the other two batches joined together at the next step
    assert [r["id"] for r in results] == list(range(12)) and all(r["completion_tokens"] == 3 for r in results)


@pytest.mark.parametrize("pool", [True, False])
def test_the_other_rows_are_prepared_once_the_first_step_is_launched(tiny_model, monkeypatch, pool):
    """With nothing running, only the oldest batch is prepared before the first step: the rest are handed
    to the worker (or prepared in the loop) after that step is launched, so that no Python beside it
    holds the GIL while the loop schedules and launches it. The next step takes them all."""
    monkeypatch.setattr(batchgen.engine.engine, "PREPARE_BATCH", 4)
    llm = LLM(str(tiny_model("llama")), tokenizer_pool=pool, max_num_seqs=16, kv_cache_tokens=400, max_model_len=128)
    engine, events = llm.engine, []
    preparer, step = engine.request_preparer, engine.step

    def logged_preparer(defaults):
        prepare = preparer(defaults)

        def call(rows):
            events.append(("prepare", rows[0]["id"]))
            return prepare(rows)
        return call

    def slow_step():  # a step the device takes a while over: the worker would have run beside its launch
        out = step()
        if not any(e[0] == "launched" for e in events):
            time.sleep(0.2)
            events.append(("launched", len(engine.scheduler.running) + len(engine.scheduler.waiting)))
        return out

    monkeypatch.setattr(engine, "request_preparer", logged_preparer)
    monkeypatch.setattr(engine, "step", slow_step)
    rows = [{"id": i, "prompt_token_ids": [1 + i, 2, 3]} for i in range(12)]
    results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=3))
    assert events == [("prepare", 0), ("launched", 4), ("prepare", 4), ("prepare", 8)]
    assert [r["id"] for r in results] == list(range(12)) and all(r["completion_tokens"] == 3 for r in results)


def test_texts_of_chat_rows_and_stop_token_finishes(tiny_model):
    """messages through a chat template; a stop token ends a row (its text leaves the token out)."""
    llm = LLM(str(tiny_model("llama")), max_num_seqs=4, kv_cache_tokens=2000, device="cpu", dtype="float32")
    llm.tokenizer.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>"
    rows = [{"id": i, "messages": [{"role": "user", "content": text(random.Random(i), 3 + i)}]} for i in range(8)]
    first = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=5))
    stop_id = first[0]["output_token_ids"][2]
    results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_id]))
    assert results[0]["finish_reason"] == "stop" and results[0]["output_token_ids"][-1] == stop_id
    for r, f in zip(results, first):
        assert r["prompt_tokens"] == f["prompt_tokens"] == len(in_loop_ids(llm.tokenizer, rows[r["id"]]))
        ids = r["output_token_ids"][:-1] if r["finish_reason"] == "stop" else r["output_token_ids"]
        assert r["text"] == llm.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_chat_template_that_refuses_messages_gives_an_error_row(tiny_model):
    llm = LLM(str(tiny_model("qwen2")), max_num_seqs=2, kv_cache_tokens=200, max_model_len=128)
    llm.tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be\\nthe user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    rows = [{"id": "bad", "messages": [{"role": "assistant", "content": "hello"}]},
            {"id": "good", "messages": [{"role": "user", "content": "hello"}]}]
    bad, good = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=3))
    assert bad["finish_reason"] == "error"
    assert bad["error"] == "messages refused by the model's chat template: the first message must be the user"
    assert good["finish_reason"] == "length"


def test_a_consumer_that_stops_early_leaves_the_engine_ready(tiny_model):
    llm = LLM(str(tiny_model("qwen2")), max_num_seqs=4, kv_cache_tokens=400, max_model_len=128)
    pulled = []

    def source():
        for i in range(10_000):  # far more than the lookahead: read lazily, never whole
            pulled.append(i)
            yield {"id": i, "prompt_token_ids": [1 + i % 50, 2, 3]}

    params = SamplingParams(temperature=0, max_tokens=3)
    stream = llm.generate(source(), params)
    next(stream)
    stream.close()
    assert len(pulled) < 100
    assert not llm.engine.has_work()
    assert [r["completion_tokens"] for r in llm.generate_list([{"prompt": "hello"}], params)] == [3]


def test_a_stop_ends_the_stream_and_leaves_the_engine_ready(tiny_model):
    llm = LLM(str(tiny_model("qwen2")), max_num_seqs=4, kv_cache_tokens=400, max_model_len=128)
    stop = threading.Event()
    rows = [{"id": i, "prompt_token_ids": [1, 2, 3 + i], "max_tokens": 2 + 3 * i} for i in range(8)]
    seen = []
    for r in llm.generate(rows, SamplingParams(temperature=0, ignore_eos=True), stop_event=stop):
        seen.append(r["id"])
        stop.set()
    assert 0 < len(seen) < len(rows)
    again = llm.generate_list(rows[:2], SamplingParams(temperature=0, ignore_eos=True))
    assert [r["completion_tokens"] for r in again] == [2, 5]


def test_ordered_worker_keeps_submission_order_and_raises_failures():
    def slow_square(batch):
        time.sleep(0.01 * random.random())
        if "boom" in batch:
            raise ValueError("boom")
        return [x * x for x in batch]

    worker = OrderedWorker(slow_square, "test-worker")
    for start in range(0, 40, 5):
        worker.submit(list(range(start, start + 5)))
    assert worker.pending == 40
    taken = worker.take()
    taken += worker.take(wait_all=True)
    assert taken == [(x, x * x) for x in range(40)] and worker.pending == 0
    worker.submit(["boom"])
    with pytest.raises(ValueError, match="boom"):
        worker.take(wait_all=True)
    worker.close()

    inline = OrderedWorker(slow_square, "unused", threaded=False)
    inline.submit([3])
    assert inline.take() == [(3, 9)]


@pytest.mark.parametrize("threaded", [True, False])
def test_ordered_worker_holds_batches_until_released(threaded):
    """A held batch counts as pending but does not run until release() (or a take that waits for it);
    results keep the submission order."""
    ran = []

    def record(batch):
        ran.append(batch[0])
        return [-x for x in batch]

    worker = OrderedWorker(record, "test-hold", threaded)
    worker.submit([1, 2])
    worker.submit([3], hold=True)
    worker.submit([4], hold=True)
    assert worker.pending == 4
    assert worker.take(oldest=True) == [(1, -1), (2, -2)]
    assert worker.take() == [] and ran == [1]  # held: neither ran nor taken
    worker.release()
    assert worker.take(wait_all=True) == [(3, -3), (4, -4)] and ran == [1, 3, 4] and worker.pending == 0
    worker.submit([5], hold=True)
    assert worker.take(wait_all=True) == [(5, -5)]  # waited for: started then
    worker.close()
