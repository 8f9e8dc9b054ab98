"""On a GPU: random-weight checkpoints at real shapes (llama-3.2-1b, Qwen3-0.6B) in bf16, batchgen
(Triton kernels) against HF transformers on the same GPU.

- greedy: HF generate()'s tokens and ours are equal until the first near-tie (HF top-2 margin small);
- logprobs: HF's greedy sequence fed back (teacher forcing) through our prompt_logprobs (chunked
  prefill) against HF's log_softmax of the same sequence (bf16), and both against an fp32 forward of
  the same weights: our bf16 error must be of the order of HF's own bf16 error. Max and mean abs
  differences are printed.
"""
import json
import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.tiny_models import save_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = {
    "llama-3.2-1b": dict(
        arch="LlamaConfig", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072,
    ),
    "qwen3-0.6b": dict(
        arch="Qwen3Config", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
}
PROMPT_LENGTHS = [7, 130, 517, 1000]
NEW_TOKENS = 32
NEAR_TIE = 0.1  # bf16 logits of two implementations differ by ~1e-2; a top-2 gap below this is a tie


def build(name, path):
    import transformers as tf

    spec = dict(SHAPES[name])
    config = getattr(tf, spec.pop("arch"))(**spec, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_tokenizer(path)
    return model.eval()


# On Hopper, qwen3-0.6b's LM head (rows of 1,024) is read through TMA at one row; with TMA_MIN_WEIGHT
# at 1 its qkv and gate/up are too, each after its norm kernel (kernels/skinny_gemm.py)
@pytest.mark.parametrize("name,tma_min_weight", [("llama-3.2-1b", None), ("qwen3-0.6b", None), ("qwen3-0.6b", 1)])
def test_matches_hf_on_gpu(name, tma_min_weight, tmp_path, monkeypatch):
    import batchgen.kernels.skinny_gemm as skinny
    import batchgen.layers.one_row_mlp as one_row_mlp

    one_row_launches = []  # llama-3.2-1b's one-row MLPs run in one launch (layers/one_row_mlp.py)
    one_row = one_row_mlp.OneRowMLP.__call__  # (whichever kernel it launches: Triton's or the Gluon one)
    monkeypatch.setattr(one_row_mlp.OneRowMLP, "__call__",
                        lambda self, *a: one_row_launches.append(1) or one_row(self, *a))
    tma_launches = []
    if tma_min_weight is not None:
        monkeypatch.setattr(skinny, "TMA_MIN_WEIGHT", tma_min_weight)
        launch = skinny._launch_tma
        monkeypatch.setattr(skinny, "_launch_tma", lambda *args: tma_launches.append(args[1].shape) or launch(*args))
    hf = build(name, tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(n)] for n in PROMPT_LENGTHS]
    references = []

    def target_logprobs(model, full):
        logprobs = torch.log_softmax(model(full[None]).logits[0].float(), dim=-1)[:-1]
        return logprobs.gather(1, full[1:, None]).squeeze(1).cpu()

    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(p):].tolist()
            margins = [float(l[0].float().topk(2).values.diff().abs()) for l in out.logits]
            full = out.sequences[0]
            references.append((tokens, margins, full.tolist(), target_logprobs(hf, full)))
        hf = hf.float()  # the same weights in fp32: the reference both bf16 implementations approximate
        fp32 = [target_logprobs(hf, torch.tensor(ref[2], device="cuda")) for ref in references]
    del hf, out
    torch.cuda.empty_cache()

    llm = LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=512, gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    greedy = llm.generate_list([{"prompt_token_ids": p} for p in prompts], params)
    # one sequence alone decodes one row a step: the skinny products and the decode graph of size 1
    alone = llm.generate_list([{"prompt_token_ids": prompts[1]}], params)[0]
    scored = llm.generate_list([{"prompt_token_ids": ref[2], "prompt_logprobs": True} for ref in references],
                               SamplingParams(temperature=0, max_tokens=1))
    del llm
    torch.cuda.empty_cache()
    if name == "llama-3.2-1b":
        assert one_row_launches
    if tma_min_weight is not None and skinny.tma_supported(torch.device("cuda")):
        assert {(16 * 128 + 2 * 8 * 128, 1024), (2 * 3072, 1024)} <= set(tma_launches)  # qkv, gate/up
    report = {"model": name, "tma_min_weight": tma_min_weight, "gpu": torch.cuda.get_device_name(),
              "prompts": PROMPT_LENGTHS, "equal_prefix": []}

    def equal_prefix(ours, tokens, margins):
        equal = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a != b), len(tokens))
        if equal < len(tokens):
            assert min(margins[: equal + 1]) < NEAR_TIE, f"diverged at {equal} without a near-tie: {margins}"
        return equal

    report["equal_prefix_alone"] = equal_prefix(alone["output_token_ids"], *references[1][:2])
    vs_hf, ours_vs_fp32, hf_vs_fp32 = [], [], []
    for result, (tokens, margins, _full, hf_bf16), s, ref32 in zip(greedy, references, scored, fp32):
        report["equal_prefix"].append(equal_prefix(result["output_token_ids"], tokens, margins))
        ours_lp = torch.tensor(s["prompt_logprobs"])
        vs_hf.append((ours_lp - hf_bf16).abs())
        ours_vs_fp32.append((ours_lp - ref32).abs())
        hf_vs_fp32.append((hf_bf16 - ref32).abs())
    for key, diffs in (("ours_vs_hf", vs_hf), ("ours_vs_fp32", ours_vs_fp32), ("hf_vs_fp32", hf_vs_fp32)):
        diffs = torch.cat(diffs)
        report[f"logprob_diff_{key}"] = {"max": round(diffs.max().item(), 5), "mean": round(diffs.mean().item(), 6)}
    print("HF-PARITY " + json.dumps(report))
    ours_err, hf_err = report["logprob_diff_ours_vs_fp32"], report["logprob_diff_hf_vs_fp32"]
    assert ours_err["mean"] <= 1.5 * hf_err["mean"] + 1e-3, report
    assert ours_err["max"] <= 2.0 * hf_err["max"] + 1e-2, report
