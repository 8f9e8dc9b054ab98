"""On two or more GPUs: data-parallel replicas each take their own GPU and give one engine's greedy
tokens (tiny random models; fp32 so that batch differences cannot round a near-tie differently)."""
import gc

import pytest
import torch

from batchgen import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_replicas_use_two_gpus_and_give_one_engines_tokens(tiny_model, kind):
    rows = [{"id": i, "prompt_token_ids": [3 + (i * 11 + j) % 250 for j in range(2 + i % 23)]} for i in range(48)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = LLM(str(tiny_model(kind)), dtype="float32", max_num_seqs=8)
    want = {r["id"]: r["output_token_ids"] for r in one.generate_list(rows, greedy)}
    one.close()
    del one
    gc.collect()
    torch.cuda.empty_cache()
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    two = LLM(str(tiny_model(kind)), dtype="float32", max_num_seqs=8, data_parallel_size=2,
              gpu_memory_utilization=0.3)
    try:
        taken = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in range(2)]
        assert all(t > 2**28 for t in taken), taken  # a replica's context, weights, pool and graphs on each GPU
        got = {r["id"]: r["output_token_ids"] for r in two.generate_list(rows, greedy)}
        assert got == want
        assert all(r["rows"] > 0 for r in two.stats["replicas"])
    finally:
        two.close()
