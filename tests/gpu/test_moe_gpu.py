"""On a GPU: the MoE models through the fused Triton MoE kernel (kernels/fused_moe.py), eager and in the
CUDA graphs, against HF transformers in bf16 on the tiny checkpoints; a Qwen3-30B-A3B-shaped model (4 of
its 48 layers) from config.json alone with --load-format dummy, on one GPU and under TP=2."""
import json
import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.tiny_models import VOCAB, load_hf, save_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [1, 5, 40, 64, 29, 17, 3, 50]
NEW_TOKENS = 12
NEAR_TIE = 0.1  # bf16 logits of two implementations differ by ~1e-2; a top-2 gap below this is a tie


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_matches_hf_bf16_on_gpu(kind, cuda_graphs, tiny_model):
    model_dir = tiny_model(kind)
    hf = load_hf(model_dir).to("cuda", torch.bfloat16)
    references = []
    with torch.no_grad():
        for p in prompts():
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            margins = [float(l[0].topk(2).values[0] - l[0].topk(2).values[1]) for l in out.logits]
            references.append((out.sequences[0, len(p):].tolist(), margins))
    del hf
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", cuda_graphs=cuda_graphs, max_num_seqs=8)
    results = llm.generate_list([{"prompt_token_ids": p} for p in prompts()],
                                SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    llm.close()
    for result, (theirs, margins) in zip(results, references):
        ours = result["output_token_ids"]
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if i is None:
            assert ours == theirs
        else:
            assert min(margins[: i + 1]) < NEAR_TIE, f"token {i}: ours {ours} vs HF {theirs}"


def qwen3_30b_a3b_config(path, layers=4):
    """Qwen3-30B-A3B's config.json with fewer layers; no weights."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "eos_token_id": None,
    }))
    save_tokenizer(path)
    return path


@pytest.mark.parametrize("tp", [1, 2])
def test_dummy_weights_at_a_real_moe_shape(tp, tmp_path):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    model_dir = qwen3_30b_a3b_config(tmp_path / "qwen3-30b-a3b-4-layers")
    llm = LLM(str(model_dir), load_format="dummy", tensor_parallel_size=tp, max_num_seqs=64)
    assert llm.describe()["load_format"] == "dummy"
    rows = [{"prompt_token_ids": [random.Random(i).randrange(VOCAB) for _ in range(8 + 37 * i)]} for i in range(40)]
    results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    llm.close()
    assert all(r["error"] is None and r["completion_tokens"] == 16 for r in results)
