"""On two and four GPUs: TP=N (2, 4) against TP=1 on a llama-3.2-1b-shaped random model in bf16 (NCCL, CUDA graphs,
Triton kernels).

- greedy: TP=1's and TP=N's tokens are equal until the first near-tie (a top-2 margin below NEAR_TIE
  in an fp32 forward of TP=1's sequence);
- logprobs: TP=1's sequences fed back (teacher forcing) through both engines' prompt_logprobs
  (chunked prefill), against each other and against an fp32 forward of the same weights: TP=N's bf16
  error must be of the order of TP=1's. Max and mean abs differences are printed.
"""
import gc
import json
import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.gpu.test_hf_parity_gpu import NEAR_TIE, NEW_TOKENS, PROMPT_LENGTHS, build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def run_engine(path, tp, prompts):
    llm = LLM(str(path), dtype="bfloat16", tensor_parallel_size=tp, max_num_batched_tokens=512,
              gpu_memory_utilization=0.5)
    greedy = llm.generate_list([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return llm, [r["output_token_ids"] for r in greedy]


def score(llm, sequences):
    rows = [{"prompt_token_ids": s, "prompt_logprobs": True} for s in sequences]
    return [torch.tensor(r["prompt_logprobs"])
            for r in llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=1))]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1_on_gpu(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    hf = build("llama-3.2-1b", tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(n)] for n in PROMPT_LENGTHS]

    llm, tokens1 = run_engine(tmp_path, 1, prompts)
    sequences = [p + t for p, t in zip(prompts, tokens1)]
    lp1 = score(llm, sequences)
    llm.close()
    del llm
    gc.collect()  # the engine's CUDA graphs hold a cycle: free its KV pool before the next engine sizes its own
    torch.cuda.empty_cache()
    llm, tokens2 = run_engine(tmp_path, tp, prompts)
    lp2 = score(llm, sequences)
    llm.close()
    del llm
    gc.collect()  # the engine's CUDA graphs hold a cycle: free its KV pool before the next engine sizes its own
    torch.cuda.empty_cache()

    hf = hf.float()
    report = {"model": "llama-3.2-1b", "tp": tp, "gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
              "prompts": PROMPT_LENGTHS, "new_tokens": NEW_TOKENS, "equal_prefix": [], "margin_at_divergence": []}
    d21, d1, d2 = [], [], []
    with torch.no_grad():
        for p, a, b, seq, x1, x2 in zip(prompts, tokens1, tokens2, sequences, lp1, lp2):
            full = torch.tensor(seq, device="cuda")
            logits = hf(full[None]).logits[0].float()
            ref = torch.log_softmax(logits, dim=-1)[:-1].gather(1, full[1:, None]).squeeze(1).cpu()
            equal = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            report["equal_prefix"].append(equal)
            if equal < len(a):  # both saw the same context up to here: TP=1's sequence is that context
                top2 = logits[len(p) - 1 + equal].topk(2).values
                margin = float(top2[0] - top2[1])
                report["margin_at_divergence"].append(round(margin, 4))
                assert margin < NEAR_TIE, f"diverged at {equal} without a near-tie ({margin})"
            d21.append((x2 - x1).abs())
            d1.append((x1 - ref).abs())
            d2.append((x2 - ref).abs())
    for key, diffs in (("tpN_vs_tp1", d21), ("tp1_vs_fp32", d1), ("tpN_vs_fp32", d2)):
        diffs = torch.cat(diffs)
        report[f"logprob_diff_{key}"] = {"max": round(diffs.max().item(), 5), "mean": round(diffs.mean().item(), 6)}
    print("TP-PARITY " + json.dumps(report))
    tp1_err, tp2_err = report["logprob_diff_tp1_vs_fp32"], report["logprob_diff_tpN_vs_fp32"]
    assert tp2_err["mean"] <= 1.5 * tp1_err["mean"] + 1e-3, report
    assert tp2_err["max"] <= 2.0 * tp1_err["max"] + 1e-2, report
