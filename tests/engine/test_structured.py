"""Constrained decoding and top_logprobs on a tiny random model: outputs follow their constraint
whatever the model prefers, bad specs fail alone, top_logprobs match a reference log-softmax."""
import json
import re
from types import SimpleNamespace

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.request import Status
from batchgen.schema import FieldError, StructuredSpec, check_structured
from tests.tiny_models import EOS, load_hf

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("qwen2")), max_num_seqs=8, kv_cache_tokens=600, max_model_len=128, dtype="float32")


def test_sampled_outputs_follow_the_regex(llm):
    """Random weights put most mass outside the grammar; sampled rows still match it, and end
    (stop) as soon as the grammar is complete, with or without ignore_eos."""
    pattern = "(ab|ba)[0-9]{2,3}c?"
    rows = [
        {"id": i, "prompt": "the quick brown fox", "seed": i, "ignore_eos": i % 2 == 0,
         "structured_outputs": {"regex": pattern}}
        for i in range(8)
    ]
    results = llm.generate_list(rows, SamplingParams(temperature=1.0, max_tokens=12))
    for r in results:
        assert r["error"] is None
        assert r["finish_reason"] == "stop", r
        assert re.fullmatch(pattern, r["text"]), r["text"]
        assert all(t < 376 or t == EOS for t in r["output_token_ids"])  # no padded-vocab ids


def test_choice_and_grammar_rows_mixed_with_free_rows(llm):
    free = {"id": "free", "prompt": "hello world", "max_tokens": 6, "ignore_eos": True}
    alone = llm.generate_list([free], SamplingParams(temperature=0))[0]
    rows = [
        {"id": "choice", "prompt": "paris is", "structured_outputs": {"choice": ["france", "germany", "fox"]}},
        {"id": "grammar", "prompt": "the lazy", "structured_outputs": {"grammar": 'root ::= "dog" | "cat" [0-9]'}},
        {"id": "json", "prompt": "hello", "response_format": '{"type": "json_schema", "json_schema": '
         '{"name": "x", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}'},
        free,
    ]
    by_id = {r["id"]: r for r in llm.generate(rows, SamplingParams(temperature=0, max_tokens=16))}
    assert by_id["choice"]["text"] in ("france", "germany", "fox")
    assert re.fullmatch("dog|cat[0-9]", by_id["grammar"]["text"])
    assert json.loads(by_id["json"]["text"]) in ({"ok": True}, {"ok": False})
    for key in ("choice", "grammar", "json"):
        assert by_id[key]["finish_reason"] == "stop"
    assert by_id["free"]["output_token_ids"] == alone["output_token_ids"]  # unconstrained rows untouched


BAD_SPECS = [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex: invalid or unsupported regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar: invalid"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json: invalid"),
    ({"structured_outputs": {"json": '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'}},
     "structured_outputs.json: $ref '#/nowhere' at #/properties/a points to nothing in the schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema: invalid"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema is missing"),
    ({"response_format": "{not json"}, "response_format is not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of json, regex, choice, grammar"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs has unknown key 'regexp'"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a non-empty list"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "both response_format and"),
    ({"top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ({"top_logprobs": "3"}, "top_logprobs must be an integer"),
]


def test_bad_specs_become_error_rows_and_the_others_go_on(llm):
    good = {"id": "good", "prompt": "hello", "structured_outputs": {"regex": "[a-z]{3}"}}
    alone = llm.generate_list([good], SamplingParams(temperature=0, max_tokens=8))[0]
    rows = [good] + [{"id": i, "prompt": "hello", **spec} for i, (spec, _) in enumerate(BAD_SPECS)]
    # twice: the second time the bad specs are cached failures, refused when the row is made
    for _ in range(2):
        by_id = {r["id"]: r for r in llm.generate(rows, SamplingParams(temperature=0, max_tokens=8))}
        for i, (_, message) in enumerate(BAD_SPECS):
            assert by_id[i]["finish_reason"] == "error"
            assert message in by_id[i]["error"] and "\n" not in by_id[i]["error"]
        assert by_id["good"]["output_token_ids"] == alone["output_token_ids"] and alone["finish_reason"] == "stop"


def test_text_response_format_is_unconstrained():
    assert check_structured({"response_format": {"type": "text"}}) is None
    assert (check_structured({"response_format": '{"type": "json_object"}'})
            == StructuredSpec("json", "", "response_format"))
    # a schema given as an object or as its JSON text is one spec (compiled once)
    a = check_structured({"structured_outputs": {"json": {"a": {"type": "string"}, "b": 1}}})
    b = check_structured({"structured_outputs": '{"json": "{\\"a\\": {\\"type\\": \\"string\\"}, \\"b\\": 1}"}'})
    assert a.key == b.key
    with pytest.raises(FieldError, match="structured_outputs must be an object"):
        check_structured({"structured_outputs": ["regex"]})


def test_the_mask_keeps_what_the_grammar_needs(llm):
    """Walking a choice grammar token by token: each next token of every choice is allowed, and a
    stop token only where a choice is complete."""
    import xgrammar as xgr

    structured = llm.engine.structured
    tok = llm.tokenizer
    choices = ["fox jumps", "fox", "dog 12"]
    spec = check_structured({"structured_outputs": {"choice": choices}})
    compiled = structured.compile(spec).result()
    bitmask = xgr.allocate_token_bitmask(1, structured.vocab_size)

    def allowed(matcher) -> set[int]:
        matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        return {t for t in range(structured.vocab_size) if (words[t // 32] >> (t % 32)) & 1}

    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        ids = tok(choice, add_special_tokens=False).input_ids
        for i, token in enumerate(ids):
            ok = allowed(matcher)
            assert token in ok
            assert (EOS in ok) == (tok.decode(ids[:i]) in choices)
            assert matcher.accept_token(token)
        assert matcher.is_completed()
        if choice == "fox":  # complete, or going on to "fox jumps"
            assert EOS in allowed(matcher) and len(allowed(matcher)) > 1
        else:
            assert allowed(matcher) == {EOS}


def test_top_logprobs_match_a_reference_log_softmax(llm, tiny_model):
    rows = [
        {"id": "k5", "prompt": "the quick brown", "top_logprobs": 5, "logprobs": True, "max_tokens": 4},
        {"id": "k1", "prompt": "hello world", "top_logprobs": 1, "max_tokens": 3},
        {"id": "k20", "prompt": "paris", "top_logprobs": 20, "max_tokens": 2,
         "structured_outputs": {"regex": "[a-z ]+"}},
        {"id": "none", "prompt": "batch", "max_tokens": 2},
    ]
    by_id = {r["id"]: r for r in llm.generate(rows, SamplingParams(temperature=0, ignore_eos=True))}
    assert "top_logprobs" not in by_id["none"]
    hf = load_hf(tiny_model("qwen2"))
    for key, k in (("k5", 5), ("k1", 1), ("k20", 20)):
        r = by_id[key]
        prompt = llm.tokenizer(next(x["prompt"] for x in rows if x["id"] == key)).input_ids
        ids = prompt + r["output_token_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert len(r["top_logprobs"]) == len(r["output_token_ids"])
        for step, top in enumerate(r["top_logprobs"]):
            want = lp[len(prompt) - 1 + step].topk(k)
            assert len(top) == k
            got_values = torch.tensor([e["logprob"] for e in top], dtype=torch.float32)
            torch.testing.assert_close(got_values, want.values, atol=1e-4, rtol=1e-4)
            # ids agree wherever the values are not (near) ties
            for e, t, v in zip(top, want.indices.tolist(), want.values.tolist()):
                assert e["token_id"] == t or abs(lp[len(prompt) - 1 + step, e["token_id"]].item() - v) < 1e-4
                assert e["token"] == llm.tokenizer.decode([e["token_id"]])
        if key == "k5":  # logprobs (of the chosen token) is the top-1 under greedy
            assert r["logprobs"] == pytest.approx([t[0]["logprob"] for t in r["top_logprobs"]], abs=1e-6)


PREEMPT_PATTERN = "[a-z]{3}( [a-z0-9]{2,4}){12,14}\\."


def constrained_rows(n: int) -> list[dict]:
    return [{"id": i, "prompt": "the quick brown fox jumps over the lazy dog"[: 10 + 3 * i], "seed": i,
             "structured_outputs": {"regex": PREEMPT_PATTERN}} for i in range(n)]


def test_preemption_and_small_steps_give_the_same_constrained_outputs(tiny_model):
    """A preempted constrained row recomputes its KV, not its grammar state: the outputs equal a
    run with room for every row."""
    params = SamplingParams(temperature=0.8, max_tokens=48)
    roomy = LLM(str(tiny_model("qwen2")), max_num_seqs=8, kv_cache_tokens=1000, max_model_len=128, dtype="float32")
    want = roomy.generate_list(constrained_rows(6), params)
    # (the prefix cache off: the rows' shared prompt prefixes would leave room enough not to preempt)
    tight = LLM(str(tiny_model("qwen2")), max_num_seqs=6, kv_cache_tokens=64, max_model_len=128, dtype="float32",
                max_num_batched_tokens=16, enable_prefix_caching=False)
    got = tight.generate_list(constrained_rows(6), params)
    assert sum(r["num_preemptions"] for r in got) > 0
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]
    for r in got:
        assert r["finish_reason"] == "stop" and re.fullmatch(PREEMPT_PATTERN, r["text"]), r


def test_a_stop_string_cuts_a_constrained_row(llm):
    rows = [{"id": 0, "prompt": "hello", "stop": [" "], "structured_outputs": {"regex": "[a-z]{3}( [a-z]{3}){3}"}}]
    r = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=20))[0]
    assert r["finish_reason"] == "stop" and re.fullmatch("[a-z]{3}", r["text"])


def test_the_jobs_constraint_applies_to_rows_without_their_own(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, structured_outputs={"regex": "[0-9]{3}"})
    rows = [
        {"id": "job", "prompt": "hello"},
        {"id": "own", "prompt": "hello", "structured_outputs": {"regex": "[a-z]{2}"}},
        {"id": "free", "prompt": "hello", "response_format": {"type": "text"}},
    ]
    by_id = {r["id"]: r for r in llm.generate(rows, params)}
    assert re.fullmatch("[0-9]{3}", by_id["job"]["text"]) and by_id["job"]["finish_reason"] == "stop"
    assert re.fullmatch("[a-z]{2}", by_id["own"]["text"]) and by_id["own"]["finish_reason"] == "stop"
    assert by_id["free"]["finish_reason"] == "length" and by_id["free"]["completion_tokens"] == 6
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        SamplingParams(structured_outputs={"choice": []})


def attached(decoding, spec: StructuredSpec) -> SimpleNamespace:
    """A running constrained sequence as fill() sees it, attached as the engine attaches each one."""
    seq = SimpleNamespace(structured=spec, status=Status.RUNNING, matcher=None, grammar=None, error=None)
    decoding.attach(seq)
    return seq


def test_the_grammar_covers_the_tokenizers_ids_not_the_lm_heads_padding(llm):
    """A 1,000-row LM head over a tokenizer of ~380 ids: xgrammar is told about the tokenizer's ids
    only (it scans the ids past them on every accepted token), and no padded id is ever allowed,
    though xgrammar leaves the last bitmask word's spare bits set."""
    from batchgen.engine.structured import StructuredDecoding
    from batchgen.kernels.token_bitmask import apply_token_bitmask

    decoding = StructuredDecoding(llm.tokenizer, 1000, [1], max_num_seqs=2, pin_memory=False)
    spec = check_structured({"structured_outputs": {"regex": "(.|\\n)*"}})  # any text: every real token
    rows, bitmask, ended = decoding.fill([attached(decoding, spec)])
    ids = len(llm.tokenizer)
    assert ids % 32 and decoding.mask_vocab == ids  # (a partly used last word)
    assert rows == [0] and ended == [] and bitmask.shape == (1, (ids + 31) // 32)
    logits = torch.zeros(1, 1000)
    apply_token_bitmask(logits, bitmask, torch.tensor([0]))
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert len(allowed) > ids // 2 and max(allowed) < ids


def test_bitmasks_filled_on_threads_equal_those_filled_on_one(llm, monkeypatch):
    """Each step's masks are filled the way that was faster per row lately (here the thread pool:
    the one-thread filler is made slow), the other every EXPLORE_STEPS; the masks are the same."""
    import time

    from batchgen.engine import structured

    monkeypatch.setattr(structured, "available_cpus", lambda: 4)
    monkeypatch.setattr(structured, "EXPLORE_STEPS", 3)
    decoding = structured.StructuredDecoding(llm.tokenizer, 384, [EOS], max_num_seqs=8, pin_memory=False)
    spec = check_structured({"structured_outputs": {"regex": "[a-f]{3}(x|yz)[0-9]+"}})
    seqs = [attached(decoding, spec) for _ in range(8)]
    decoding.fill(seqs)  # the matchers, each then in another state
    for seq, prefix in zip(seqs, ["", "a", "ab", "abc", "abcy", "abcyz", "abcx1", "f"]):
        assert seq.matcher.accept_string(prefix) if prefix else True
    calls = []

    def spy(name, filler, delay):
        def fill(*args):
            calls.append(name)
            time.sleep(delay)
            filler.batch_fill_next_token_bitmask(*args)
        return SimpleNamespace(batch_fill_next_token_bitmask=fill)

    one, threaded = decoding._fillers
    assert threaded is not None
    decoding._fillers = (spy("one", one, 0.005), spy("threads", threaded, 0.0))
    decoding._row_seconds, decoding._fill_steps = [0.0, 0.0], 0
    masks = [decoding.fill(seqs)[1].clone() for _ in range(6)]
    assert calls == ["one", "threads", "one", "threads", "threads", "one"]
    assert all(torch.equal(m, masks[0]) for m in masks) and len(masks[0].unique()) > 1


def test_the_compile_cache_keeps_the_most_recently_used_specs(llm, monkeypatch):
    from batchgen.engine import structured

    monkeypatch.setattr(structured, "CACHE_SIZE", 2)
    cache = structured.StructuredDecoding(llm.tokenizer, 384, [EOS], max_num_seqs=4, pin_memory=False)
    a, b, c = (check_structured({"structured_outputs": {"regex": r}}) for r in ("a+", "b+", "c+"))
    first = cache.compile(a)
    assert cache.compile(a) is first  # one compile per distinct spec
    cache.compile(b)
    cache.compile(a)  # used again: b is now the least recently used
    cache.compile(c)
    assert cache.compile(a) is first and set(cache._compiled) == {a.key, c.key}
    assert first.result() is not None


def _checked_rows(free: dict) -> list[dict]:
    """`batchgen run`'s path: the file's rows through the row checks (io/rows.py): row "free" with
    `free`'s fields, row "job" without."""
    from batchgen.io.rows import InputRow, RowChecker

    rows = [{"id": "free", "prompt": "hello", **free}, {"id": "job", "prompt": "hello"}]
    return [RowChecker().check(InputRow(i, row))[0] for i, row in enumerate(rows)]


def _checked_openai_lines(free: dict) -> list[dict]:
    """The same through OpenAI batch input (io/openai_input.py)."""
    pytest.importorskip("openai")  # tests.openai_types checks lines with its types (not on the GPU image)
    from batchgen.io.openai_input import COMPLETIONS_URL, OpenAIRowChecker
    from batchgen.io.rows import InputRow
    from tests.openai_types import line

    lines = [line("free", COMPLETIONS_URL, prompt="hello", **free), line("job", COMPLETIONS_URL, prompt="hello")]
    return [OpenAIRowChecker(None).check(InputRow(i, x))[0] for i, x in enumerate(lines)]


@pytest.mark.parametrize("checked", [_checked_rows, _checked_openai_lines])
def test_a_text_response_format_opts_out_of_the_jobs_constraint_through_the_row_checks(llm, checked):
    """A row's (or line's) {"type": "text"} survives the checks and turns the job's constraint off
    for that row."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, structured_outputs={"regex": "[0-9]{3}"})
    requests = checked({"response_format": {"type": "text"}})
    by_id = {r["id"]: r for r in llm.generate(requests, params)}
    plain, = llm.generate([{"id": "plain", "prompt": "hello"}], params.replace(structured_outputs=None))
    assert by_id["free"]["output_token_ids"] == plain["output_token_ids"] and plain["completion_tokens"] == 6
    assert re.fullmatch("[0-9]{3}", by_id["job"]["text"]) and by_id["job"]["finish_reason"] == "stop"


def test_replace_carries_the_checked_constraint_over_and_checks_the_rest():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    other = params.replace(seed=3, top_k=0, stop=("x",))
    assert other.structured is params.structured and params.seed is None
    assert (other.seed, other.top_k, other.stop) == (3, -1, ["x"])
    assert params.replace(structured_outputs=None).structured is None
    with pytest.raises(ValueError, match="top_p must be in"):
        params.replace(top_p=0.0)
    with pytest.raises(TypeError):
        params.replace(no_such_field=1)
