"""vLLM's options on how a row's prompt and text are made: truncate_prompt_tokens, include_stop_str_in_output,
skip_special_tokens."""
import pytest

from batchgen import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama")), dtype="float32")


def one(llm, **fields):
    result = llm.generate_list([{"prompt": PROMPT, **fields}], GREEDY)[0]
    assert result["error"] is None, result["error"]
    return result


def test_a_stop_string_is_kept_in_the_text_when_asked(llm):
    plain = one(llm)
    text = plain["text"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2])
    cut = one(llm, stop=[stop])
    kept = one(llm, stop=[stop], include_stop_str_in_output=True)
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert cut["text"] == text[:text.find(stop)] and kept["text"] == text[:text.find(stop) + len(stop)]


def test_a_stop_token_is_kept_in_the_text_when_asked(llm):
    plain = one(llm)
    ids = plain["output_token_ids"]
    stop = ids[3]
    first = ids.index(stop)
    cut = one(llm, stop_token_ids=[stop])
    kept = one(llm, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert cut["output_token_ids"] == kept["output_token_ids"] == ids[:first + 1]
    tokenizer = llm.engine.tokenizer
    assert cut["text"] == tokenizer.decode(ids[:first]) and kept["text"] == tokenizer.decode(ids[:first + 1])


def test_special_tokens_stay_in_the_text_when_asked(llm):
    bos = llm.engine.tokenizer.convert_tokens_to_ids("<s>")  # (a special token: the only one allowed)
    skipped = one(llm, allowed_token_ids=[bos], max_tokens=3)
    shown = one(llm, allowed_token_ids=[bos], max_tokens=3, skip_special_tokens=False)
    assert skipped["output_token_ids"] == shown["output_token_ids"] == [bos] * 3
    assert skipped["text"] == "" and shown["text"] == "<s><s><s>"


def test_a_long_prompt_keeps_its_last_tokens(llm):
    ids = llm.engine.tokenizer.encode(PROMPT)
    whole = one(llm)
    truncated = one(llm, truncate_prompt_tokens=3)
    tail = llm.generate_list([{"prompt_token_ids": ids[-3:]}], GREEDY)[0]
    assert whole["prompt_tokens"] == len(ids) > 3 and truncated["prompt_tokens"] == 3
    assert truncated["output_token_ids"] == tail["output_token_ids"]
    assert one(llm, truncate_prompt_tokens=len(ids) + 5)["output_token_ids"] == whole["output_token_ids"]
    bad = llm.generate_list([{"prompt": PROMPT, "truncate_prompt_tokens": 0}], GREEDY)[0]
    assert bad["error"] == "truncate_prompt_tokens must be >= 1, got 0"
