"""On a GPU: three LLMs built one after another in one process, each with the default
--gpu-memory-utilization, each sizing its KV pool to most of the GPU. Each builds only if the one
before it gave its memory back: dropped (the last reference, with the garbage collector off), closed,
or left by a with block."""
import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from batchgen import LLM, SamplingParams
from batchgen.executor.kv_cache import KVCache
from tests.tiny_models import VOCAB, save_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROWS = [{"id": i, "prompt": f"the quick brown fox {i}"} for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama whose context is so long that its KV pool is bound by the GPU's memory, not by
    max_num_seqs x max_model_len."""
    path = tmp_path_factory.mktemp("llama-long")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=262144)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)
    return path


def test_three_llms_one_after_another_each_get_the_gpu(model_dir):
    total = torch.cuda.mem_get_info()[1]
    per_token = KVCache.bytes_per_token(4, 2, 64, torch.bfloat16)
    ends = ["dropped", "closed", "with"]
    gc.collect()
    gc.disable()
    try:
        for end in ends:
            llm = LLM(str(model_dir))  # each builds: no "no memory left for the KV cache"
            assert llm.describe()["kv_cache_tokens"] * per_token > 0.5 * total  # most of the GPU
            results = llm.generate_list(ROWS, SamplingParams(temperature=0, max_tokens=8))
            assert all(r["error"] is None for r in results)
            runner = llm.engine.runner
            refs = [weakref.ref(t) for t in (runner.kv.k, runner.kv.v, runner.model, next(runner.model.parameters()))]
            del runner
            if end == "dropped":
                llm = None
            elif end == "closed":
                llm.close()
                with pytest.raises(RuntimeError, match="closed"):
                    llm.generate(ROWS)
            else:
                with llm:
                    pass
            assert [r() is None for r in refs] == [True] * len(refs), end
            if end != "dropped":  # close() gave the allocator's blocks back to the driver as well
                assert torch.cuda.memory_reserved() < 0.1 * total
            llm = None
    finally:
        gc.enable()
