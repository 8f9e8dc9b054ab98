"""A row's own logit changes (allowed_token_ids, logit_bias, the repetition, frequency and presence penalties)
and min-p: the device ops against their definitions, and end to end against HF transformers' generate()
(repetition) or a greedy loop over HF's logits (frequency, presence), each row alone or beside plain rows."""
import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.request import bad_word_ids
from batchgen.executor.logits_processors import (
    allowed_and_bias_reference,
    apply_allowed_and_bias,
    apply_bad_words,
    apply_penalties,
    penalties_reference,
)
from batchgen.executor.sampling import mask_min_p_
from tests.tiny_models import VOCAB, load_hf

MAX_TOKENS = 12


class Row:
    def __init__(self, params: SamplingParams, tokens: list[int], num_prompt: int):
        self.params, self.token_ids, self.num_prompt = params, tokens, num_prompt


def on_cpu(arrays, dtype):
    return [torch.as_tensor(a).to(dtype) for a in arrays]


def test_penalties_match_their_definition_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3  # (positive and negative logits)
    rows = [
        Row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.2),
            [1, 2, 3, 3, 7, 7, 7, 1], 4),
        Row(SamplingParams(), [4, 5, 5], 1),  # unpenalized: untouched
        Row(SamplingParams(frequency_penalty=1.0), [9, 9, 9, 10], 1),  # the prompt's 9 is not counted
        Row(SamplingParams(repetition_penalty=0.5), [0, 39], 2),  # no output yet: the prompt's tokens only
        Row(SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0), [3], 0),
        Row(SamplingParams(repetition_penalty=2.0), list(range(40)) * 2, 40),  # every token
    ]
    got = logits.clone()
    apply_penalties(got, rows, on_cpu)
    for i, row in enumerate(rows):
        p = row.params
        want = penalties_reference(logits[i], row.token_ids[:row.num_prompt], row.token_ids[row.num_prompt:],
                                   p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[1], logits[1])


def test_allowed_tokens_and_logit_bias_match_their_definition():
    torch.manual_seed(2)
    logits = torch.randn(4, 30) * 3
    rows = [Row(SamplingParams(allowed_token_ids=[3, 29, 3], logit_bias={"3": 5.5, 7: -100}), [1], 1),
            Row(SamplingParams(), [2], 1),
            Row(SamplingParams(logit_bias={0: 100, 29: -0.25}), [], 0),
            Row(SamplingParams(allowed_token_ids=[11]), [4, 4], 1)]
    got = logits.clone()
    apply_allowed_and_bias(got, rows, on_cpu)
    for i, row in enumerate(rows):
        want = allowed_and_bias_reference(logits[i], row.params.allowed_token_ids, row.params.logit_bias)
        torch.testing.assert_close(got[i], want, atol=0, rtol=0)
    assert torch.isfinite(got[0]).sum() == 2 and torch.equal(got[1], logits[1])


def test_a_bad_words_last_token_is_banned_where_the_output_ends_with_its_others():
    logits = torch.zeros(3, 20)
    rows = [Row(SamplingParams(), [1, 2, 3, 4], 2), Row(SamplingParams(), [3, 4], 2), Row(SamplingParams(), [5], 1)]
    for row, words in zip(rows, ([[7], [3, 4, 9], [4, 10], [2, 11]], [[3, 4, 12]], None)):
        row.bad_words_ids = words
    apply_bad_words(logits, rows, on_cpu)
    # row 0: 7 always, 9 (output ends 3, 4), 10 (ends 4); not 11 (its 2 is the prompt's); row 1: 3, 4 are prompt
    assert torch.isinf(logits[0]).nonzero().squeeze(1).tolist() == [7, 9, 10]
    assert not torch.isinf(logits[1:]).any()


def test_min_p_keeps_the_tokens_within_min_p_of_the_likeliest():
    torch.manual_seed(1)
    logits = torch.randn(5, 300) * 4
    temperatures = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.0])
    min_ps = torch.tensor([0.1, 0.3, 0.01, 0.5, 0.0])
    got = mask_min_p_(logits.clone(), temperatures, min_ps)
    for i in range(5):
        if temperatures[i] == 0 or min_ps[i] == 0:  # greedy rows and min_p 0: untouched
            assert torch.equal(got[i], logits[i])
            continue
        probs = (logits[i] / temperatures[i]).softmax(-1)
        keep = probs >= min_ps[i] * probs.max()
        assert torch.equal(torch.isfinite(got[i]), keep) and torch.equal(got[i][keep], logits[i][keep])


def prompts(n=4):
    rng = random.Random(3)
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def greedy_with_penalties(model, prompt, frequency, presence):
    """HF's logits, our penalties' definition, argmax -> (tokens, each step's top-2 margin after penalties)."""
    ids, out, margins = list(prompt), [], []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        scores = penalties_reference(logits, prompt, out, 1.0, frequency, presence)
        top = scores.topk(2).values
        margins.append(float(top[0] - top[1]))
        token = int(scores.argmax())
        out.append(token)
        ids.append(token)
    return out, margins


def assert_same_or_near_tie(ours, theirs, margins):
    diverged = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert diverged is None or min(margins[: diverged + 1]) < 1e-3, f"token {diverged}: {ours} vs {theirs}"


def test_repetition_penalty_gives_hf_generates_tokens(llama):
    """HF's RepetitionPenaltyLogitsProcessor is vLLM's repetition penalty (prompt and output tokens)."""
    model = load_hf(llama)
    llm = LLM(str(llama), dtype="float32")
    requests = [{"prompt_token_ids": p, "repetition_penalty": r} for p, r in zip(prompts(), (1.8, 0.6, 1.0, 1.3))]
    results = llm.generate_list(requests, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for request, result in zip(requests, results):
        ids = torch.tensor([request["prompt_token_ids"]])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                            min_new_tokens=MAX_TOKENS, do_sample=False,
                            repetition_penalty=request["repetition_penalty"], output_scores=True,
                            return_dict_in_generate=True, pad_token_id=0)
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in hf.scores]
        assert_same_or_near_tie(result["output_token_ids"], hf.sequences[0, ids.shape[1]:].tolist(), margins)
    plain = llm.generate_list(requests[2:3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert plain[0]["output_token_ids"] == results[2]["output_token_ids"]  # (penalty 1: off)


def test_frequency_and_presence_penalties_follow_their_definition(llama):
    """Penalized rows beside an unpenalized one, in one batch: each row gets its own penalties only."""
    model = load_hf(llama)
    llm = LLM(str(llama), dtype="float32")
    settings = [(2.0, 0.0), (0.0, 2.0), (0.7, -0.5), (0.0, 0.0)]
    requests = [{"prompt_token_ids": p, "frequency_penalty": f, "presence_penalty": q}
                for p, (f, q) in zip(prompts(), settings)]
    results = llm.generate_list(requests, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    changed = 0
    for request, result, (frequency, presence) in zip(requests, results, settings):
        want, margins = greedy_with_penalties(model, request["prompt_token_ids"], frequency, presence)
        assert_same_or_near_tie(result["output_token_ids"], want, margins)
        plain, _ = greedy_with_penalties(model, request["prompt_token_ids"], 0.0, 0.0)
        changed += want != plain
    assert changed >= 2  # (the penalties did change outputs: the test can fail)
    frequent = max(results[0]["output_token_ids"].count(t) for t in set(results[0]["output_token_ids"]))
    assert frequent <= 3  # a 2.0 frequency penalty keeps any one token from dominating


def test_min_p_of_one_samples_the_likeliest_token(llama):
    """min_p 1 leaves only the likeliest token (barring exact ties): a sampled row then equals greedy."""
    llm = LLM(str(llama), dtype="float32")
    requests = [{"prompt_token_ids": p} for p in prompts()]
    greedy = llm.generate_list(requests, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    sampled = llm.generate_list(requests, SamplingParams(temperature=1.5, min_p=1.0, max_tokens=MAX_TOKENS,
                                                         ignore_eos=True, seed=7))
    free = llm.generate_list(requests, SamplingParams(temperature=1.5, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7))
    assert [r["output_token_ids"] for r in sampled] == [r["output_token_ids"] for r in greedy]
    assert [r["output_token_ids"] for r in free] != [r["output_token_ids"] for r in greedy]


def test_allowed_token_ids_and_logit_bias_steer_greedy_and_sampled_rows(llama):
    llm = LLM(str(llama), dtype="float32")
    prompt = prompts()[0]
    plain = llm.generate_list([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                            ignore_eos=True))[0]["output_token_ids"]
    first = plain[0]
    requests = [
        {"prompt_token_ids": prompt, "allowed_token_ids": [5, 9, 200]},
        {"prompt_token_ids": prompt, "allowed_token_ids": [5, 9, 200], "temperature": 1.0, "seed": 3},
        {"prompt_token_ids": prompt, "logit_bias": {"42": 100}},  # OpenAI's form: JSON keys are text
        {"prompt_token_ids": prompt, "logit_bias": {first: -100}},
        {"prompt_token_ids": prompt},  # a plain row beside them keeps its tokens
    ]
    results = llm.generate_list(requests, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    out = [r["output_token_ids"] for r in results]
    assert set(out[0]) <= {5, 9, 200} and set(out[1]) <= {5, 9, 200}
    assert out[2] == [42] * MAX_TOKENS
    assert out[3][0] != first and first not in out[3]
    assert out[4] == plain


def test_bad_words_are_never_completed(llama):
    """Output steered to two one-character tokens (allowed_token_ids); its first token, then its first two
    tokens as one word, banned: neither shows up again (each word tokenizes back to the output's tokens)."""
    llm = LLM(str(llama), dtype="float32")
    tokenizer = llm.engine.tokenizer
    allowed = [tokenizer.encode(c, add_special_tokens=False)[0] for c in ("x", "z")]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    row = {"prompt": "the quick brown fox", "allowed_token_ids": allowed}
    plain = llm.generate_list([row], greedy)[0]["output_token_ids"]
    for n in (1, 2):
        word = tokenizer.decode(plain[:n])
        assert plain[:n] in bad_word_ids(tokenizer, [word])  # (so the ban can fail: the word was generated)
        out = llm.generate_list([{**row, "bad_words": [word]}], greedy)[0]["output_token_ids"]
        assert not any(out[i:i + n] == plain[:n] for i in range(len(out))), (word, out)


@pytest.mark.parametrize("field, value, message", [
    ("bad_words", "word", "bad_words must be a list of strings, got str"),
    ("bad_words", ["ok", " "], "bad_words[1] must be a non-blank string, got a blank string"),
    ("logit_bias", {"7": -101}, "logit_bias['7'] must be in [-100, 100], got -101.0"),
    ("logit_bias", {"a": 1}, "logit_bias key 'a' is not a token id"),
    ("logit_bias", {str(VOCAB + 5): 1}, f"logit_bias holds token id {VOCAB + 5}, outside the vocabulary"),
    ("allowed_token_ids", [], "allowed_token_ids is empty"),
    ("allowed_token_ids", [1, VOCAB], f"allowed_token_ids holds token id {VOCAB}, outside the vocabulary"),
    ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
    ("repetition_penalty", 0, "repetition_penalty must be in (0, 2], got 0"),
    ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2], got 2.5"),
    ("presence_penalty", "high", "presence_penalty must be a number, got str"),
])
def test_an_out_of_range_penalty_is_an_error_row(llama, field, value, message):
    llm = LLM(str(llama), dtype="float32")
    bad, good = llm.generate_list([{"prompt": "a", field: value}, {"prompt": "b"}],
                                  SamplingParams(temperature=0, max_tokens=2))
    assert bad["finish_reason"] == "error" and message in bad["error"] and field not in bad
    assert good["error"] is None
