"""On a GPU: constrained rows (the bitmask copied once and applied by the Triton kernel, outside the
CUDA graphs) give the same tokens with and without CUDA graphs, follow their constraint, and leave
the free rows beside them as they are alone."""
import re

import pytest
import torch

from batchgen import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("xgrammar")

PATTERN = "[a-z]{2,3}( [0-9a-z]{2,3}){2,6}"


def rows():
    constrained = [{"id": f"c{i}", "prompt": "the quick brown fox"[: 5 + i], "seed": i, "top_logprobs": 2,
                    "structured_outputs": {"regex": PATTERN}} for i in range(12)]
    free = [{"id": f"f{i}", "prompt": "hello world"[: 3 + i], "seed": i, "ignore_eos": True} for i in range(6)]
    return constrained + free


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_constrained_rows_with_and_without_cuda_graphs(tiny_model, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=24)
    results = {}
    for graphs in (True, False):
        llm = LLM(str(tiny_model("qwen2")), dtype="float32", device="cuda", cuda_graphs=graphs, max_num_seqs=32,
                  gpu_memory_utilization=0.3)
        results[graphs] = llm.generate_list(rows(), params)
        alone = llm.generate_list([r for r in rows() if r["id"].startswith("f")], params)
        del llm
        by_id = {r["id"]: r for r in results[graphs]}
        for r in alone:
            assert by_id[r["id"]]["output_token_ids"] == r["output_token_ids"]
    for a, b in zip(results[True], results[False]):
        assert a["output_token_ids"] == b["output_token_ids"], (a["id"], a["text"], b["text"])
        if a["id"].startswith("c"):
            assert a["finish_reason"] == "stop" and re.fullmatch(PATTERN, a["text"]), a
            assert len(a["top_logprobs"]) == len(a["output_token_ids"])
