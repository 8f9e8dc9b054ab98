"""A bad request fails alone with a one-line reason; the others are unaffected."""
import json

import pytest

from batchgen import LLM, SamplingParams
from batchgen.models.model_config import UnsupportedModelError, load_model_config


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("qwen2")), max_num_seqs=4, kv_cache_tokens=200, max_model_len=128)


BAD_ROWS = [
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "more than one prompt field"),
    ({"max_tokens": 3}, "no prompt"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"prompt": "   "}, "prompt is empty"),
    ({"prompt_token_ids": [1, 2, 100000]}, "outside the vocabulary"),
    ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
    ({"prompt_token_ids": [1, "a"]}, "prompt_token_ids[1] must be an integer"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature must be in"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p must be in"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens must be an integer"),
    ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"prompt": "hi", "stop": [""]}, "stop holds an empty string"),
    ({"prompt_token_ids": [1] * 100, "max_tokens": 50}, "exceeds the limit of 128"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_request_becomes_an_error_row(llm, row, message):
    good = {"id": "good", "prompt_token_ids": [3, 4, 5]}
    results = llm.generate_list([good, {"id": "bad", **row}], SamplingParams(temperature=0, max_tokens=4))
    bad = results[1]
    assert bad["finish_reason"] == "error" and message in bad["error"] and "\n" not in bad["error"]
    assert bad["text"] is None and bad["output_token_ids"] == []
    assert results[0]["finish_reason"] == "length" and results[0]["completion_tokens"] == 4


def test_whole_pool_limit(tiny_model):
    llm = LLM(str(tiny_model("qwen2")), max_num_seqs=2, kv_cache_tokens=20)
    r = llm.generate_list([{"prompt_token_ids": [1] * 18, "max_tokens": 5}, {"prompt_token_ids": [1] * 10}],
                          SamplingParams(temperature=0, max_tokens=5))
    assert r[0]["finish_reason"] == "error" and "limit of 20" in r[0]["error"]
    assert r[1]["finish_reason"] == "length"


def test_extra_columns_are_carried_through(llm):
    r = llm.generate_list([{"id": 7, "prompt_token_ids": [1, 2], "source": "x", "score": 0.5}],
                          SamplingParams(temperature=0, max_tokens=2))[0]
    assert r["id"] == 7 and r["source"] == "x" and r["score"] == 0.5


def test_metrics_are_consistent(llm):
    rows = [{"id": i, "prompt_token_ids": list(range(1, 2 + 3 * i))} for i in range(6)]
    for r in llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=5)):
        assert r["completion_tokens"] == len(r["output_token_ids"]) == 5
        assert r["prompt_tokens"] == 1 + 3 * r["id"]
        assert 0 <= r["queue_s"] <= r["ttft_s"] <= r["e2e_s"]
        assert r["ttft_s"] == pytest.approx(r["queue_s"] + r["prefill_s"])
        assert r["e2e_s"] == pytest.approx(r["ttft_s"] + r["decode_s"])


def test_unsupported_architecture_and_rope_are_one_line_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM, MistralForCausalLM"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4}}'
    )
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn' is not supported; supported: default"):
        load_model_config(tmp_path)


def test_context_length_is_the_positions_stretched_by_linear_rope_scaling(tmp_path):
    shape = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    assert load_model_config(tmp_path).context_length() == 4096
    (tmp_path / "config.json").write_text(json.dumps({**shape, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    assert load_model_config(tmp_path).context_length() == 16384


def test_max_model_len_past_the_models_context_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"invalid --max-model-len: 513 is past the model's context length \(512"):
        LLM(str(tiny_model("llama")), max_model_len=513, device="cpu")


def test_bad_engine_option_is_a_clear_error():
    with pytest.raises(ValueError, match="invalid --dtype"):
        LLM("unused", dtype="float8")
    with pytest.raises(ValueError, match="invalid --max-num-batched-tokens"):
        LLM("unused", max_num_seqs=64, max_num_batched_tokens=8)


def test_a_live_source_may_have_nothing_for_a_while(llm):
    """None from the source means "nothing now": running requests go on, and later rows still come."""
    seen_running = []

    def source():
        yield {"id": "first", "prompt_token_ids": [1, 2, 3]}
        for _ in range(3):
            seen_running.append(len(llm.engine.scheduler.running))
            yield None
        yield {"id": "second", "prompt_token_ids": [4, 5]}

    results = list(llm.generate(source(), SamplingParams(temperature=0, max_tokens=8)))
    assert sorted(r["id"] for r in results) == ["first", "second"]
    assert all(r["completion_tokens"] == 8 for r in results)
    assert max(seen_running) == 1  # "first" was running while the source had nothing


def test_a_plain_string_is_a_request_of_that_prompt(llm):
    """As vLLM's generate(["..."]): the string is the row's prompt; its id is its place, as for any row without one."""
    greedy = SamplingParams(temperature=0, max_tokens=3)
    by_string, by_row, other = llm.generate_list(["hi there", {"id": "r", "prompt": "hi there"}, "   "], greedy)
    assert by_string["id"] == 0 and by_string["error"] is None
    assert by_string["output_token_ids"] == by_row["output_token_ids"]
    assert other["id"] == 2 and "prompt is empty" in other["error"]


def test_a_rows_max_tokens_below_the_jobs_min_tokens_names_the_jobs_default(llm):
    """The 2 came from the job (--min-tokens), not the row: the error row says so; a row that gives both is fine."""
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2)
    short, both = llm.generate_list([{"prompt_token_ids": [3, 4], "max_tokens": 1},
                                     {"prompt_token_ids": [3, 4], "max_tokens": 1, "min_tokens": 0}], params)
    assert short["error"].startswith("max_tokens 1 is below the job's min_tokens (2, --min-tokens")
    assert both["error"] is None and both["completion_tokens"] == 1
