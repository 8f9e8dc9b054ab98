"""MoE models (Qwen3-MoE with a dense layer, Mixtral, Qwen2-MoE with its shared expert) on tiny random
checkpoints saved by transformers: greedy tokens equal HF generate()'s through `batchgen run`, with a
squeezed engine (chunked prefill, 2 sequences, a tiny KV pool), under TP=2, with the prefix cache and
with n=2; transformers 5's fused expert tensors load like per-expert ones."""
import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.executor.tp_workers import TensorParallelError
from batchgen.kernels.fused_moe import fused_moe_reference
from batchgen.kernels.moe_router import select_experts
from batchgen.layers.moe import FusedExperts
from batchgen.models.model_config import load_model_config
from batchgen.parallel.tensor_parallel import TensorParallel
from tests.engine.test_hf_equality import MAX_TOKENS, assert_matches_hf, hf_reference, prompts, run  # noqa: F401
from tests.engine.test_prefix_caching import shared_prefix_rows
from tests.engine.test_tensor_parallel import SQUEEZED, assert_tp_matches
from tests.tiny_models import load_hf

KINDS = ["qwen3-moe", "mixtral", "qwen2-moe"]


@pytest.mark.parametrize("kind", KINDS)
def test_batchgen_run_equals_hf_greedy(kind, tiny_model, hf_reference, batchgen, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n" for i, p in enumerate(prompts())))
    out = tmp_path / "out.parquet"
    done = batchgen("run", src, out, "--model", tiny_model(kind), "--dtype", "float32", "--temperature", "0",
                    "--max-tokens", MAX_TOKENS, "--log-every", "0")
    assert done.returncode == 0, done.stderr
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: int(r["id"]))
    assert_matches_hf(rows, hf_reference(kind))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe"])
def test_quantization_fp8_runs_a_moe_model(kind, tiny_model, batchgen, tmp_path):
    """--quantization fp8 on Mixtral (its block_sparse_moe) and Qwen2-MoE (a shared expert and its gate): the
    job runs with the experts in fp8 and records the form (numerics: tests/engine/test_fp8_moe_checkpoints.py)."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 0, "prompt_token_ids": [1, 2, 3], "max_tokens": 3}) + "\n")
    done = batchgen("run", src, tmp_path / "out.parquet", "--model", tiny_model(kind), "--quantization", "fp8")
    assert done.returncode == 0, done.stderr
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("completion_tokens").to_pylist() == [3]
    meta = json.loads(table.schema.metadata[b"batchgen"])
    assert meta["quantization"] == "fp8 quantized at load: weights per channel, activations per token"


# a tiny token budget (prefill in chunks of 7) and KV pool; with 4 sequences the pool runs dry (preemption)
SQUEEZES = {"two_sequences": dict(max_num_seqs=2, max_num_batched_tokens=7, kv_cache_tokens=80),
            "preempting": dict(max_num_seqs=4, max_num_batched_tokens=7, kv_cache_tokens=80)}


@pytest.mark.parametrize("squeeze", SQUEEZES)
@pytest.mark.parametrize("kind", KINDS)
def test_squeezed_engine_equals_hf_greedy(kind, squeeze, tiny_model, hf_reference):
    requests = [{"prompt_token_ids": p} for p in prompts()]
    results = run(tiny_model(kind), requests, **SQUEEZES[squeeze])
    assert_matches_hf(results, hf_reference(kind))
    if squeeze == "preempting":
        assert sum(r["num_preemptions"] for r in results) > 0


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen2-moe"])
def test_tensor_parallel_equals_tp1(kind, tiny_model):
    """Each rank holds half of every expert's intermediate features (and of the shared expert's)."""
    assert_tp_matches(tiny_model(kind), **SQUEEZED)


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_expert_parallel_equals_tp1(kind, tiny_model):
    """--expert-parallel: each rank holds half of the experts whole (the shared expert still split)."""
    assert_tp_matches(tiny_model(kind), expert_parallel=True, **SQUEEZED)
    with LLM(str(tiny_model(kind)), dtype="float32", device="cpu", tensor_parallel_size=2,
             expert_parallel=True) as llm:
        assert llm.describe()["expert_parallel"] is True
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
        routed = experts[0].routed_experts
        assert experts and all(e.w13.shape[0] == routed // 2 and e.first_expert == 0 for e in experts)


def test_expert_parallel_needs_experts_that_divide(tiny_model):
    """6 experts over 4 ranks: one clear error naming the option (rank 0's, or a worker's that failed first)."""
    with pytest.raises((ValueError, TensorParallelError),
                       match="--expert-parallel: the number of routed experts \\(6\\) is not divisible"):
        LLM(str(tiny_model("qwen2-moe")), dtype="float32", device="cpu", tensor_parallel_size=4, expert_parallel=True)


def test_prefix_cache_and_n_samples(tiny_model):
    """Rows sharing prefixes give the tokens they give with the cache off; n=2 of a greedy row: two rows
    of the same tokens, the prompt computed once."""
    model_dir = tiny_model("mixtral")
    rows = shared_prefix_rows()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    on, off = [LLM(str(model_dir), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                   enable_prefix_caching=cache).generate_list(rows, greedy) for cache in (True, False)]
    assert [r["output_token_ids"] for r in on] == [r["output_token_ids"] for r in off]
    assert sum(r["cached_prompt_tokens"] for r in on) >= 39 + 20  # the repeated prompt, the 20-token prefix
    llm = LLM(str(model_dir), dtype="float32")
    pair = llm.generate_list([{"id": "a", "prompt_token_ids": rows[3]["prompt_token_ids"], "n": 2}], greedy)
    assert [r["sample_index"] for r in pair] == [0, 1]
    assert pair[0]["output_token_ids"] == pair[1]["output_token_ids"] == on[3]["output_token_ids"]
    assert sorted(r["cached_prompt_tokens"] for r in pair) == [0, 39]


def test_fused_expert_tensors_load_like_per_expert_ones(tiny_model, hf_reference, tmp_path):
    """transformers 5 holds each layer's experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I] (its
    save_pretrained writes them per expert): a checkpoint of that state dict gives the same tokens."""
    fused = tmp_path / "fused"
    shutil.copytree(tiny_model("qwen3-moe"), fused)
    state = {k: v.contiguous() for k, v in load_hf(fused).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (fused / "model.safetensors").unlink()
    save_file(state, fused / "model.safetensors")
    assert_matches_hf(run(fused, [{"prompt_token_ids": p} for p in prompts()]), hf_reference("qwen3-moe"))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_experts_load_each_ranks_slice_from_either_form(expert_parallel):
    """Each rank's half of every expert's features, or (expert parallel) its half of the experts whole,
    from per-expert tensors and from fused ones alike; every expert counts as loaded on every rank."""
    num_experts, hidden, inter = 4, 8, 6
    gate_up, down = torch.randn(num_experts, 2 * inter, hidden), torch.randn(num_experts, hidden, inter)
    for rank in (0, 1):
        tp = TensorParallel(rank=rank, size=2, expert_parallel=expert_parallel)
        per_expert, whole = FusedExperts(num_experts, hidden, inter, tp), FusedExperts(num_experts, hidden, inter, tp)
        for e in range(num_experts):
            per_expert.weight_loader(per_expert.w13, gate_up[e, :inter], f"gate:{e}")
            per_expert.weight_loader(per_expert.w13, gate_up[e, inter:], f"up:{e}")
            per_expert.weight_loader(per_expert.w2, down[e], f"down:{e}")
        whole.weight_loader(whole.w13, gate_up, "gate_up")
        whole.weight_loader(whole.w2, down, "down")
        if expert_parallel:
            own = slice(rank * num_experts // 2, (rank + 1) * num_experts // 2)
            want_w13, want_w2 = gate_up[own], down[own]
        else:
            half = slice(rank * inter // 2, (rank + 1) * inter // 2)
            want_w13 = torch.cat([gate_up[:, :inter][:, half], gate_up[:, inter:][:, half]], dim=1)
            want_w2 = down[:, :, half]
        for experts in (per_expert, whole):
            torch.testing.assert_close(experts.w13.data, want_w13, rtol=0, atol=0)
            torch.testing.assert_close(experts.w2.data, want_w2, rtol=0, atol=0)
            assert experts.missing_weights() == []


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_expert_loop_equals_each_tokens_sum(dtype, tol):
    """The CPU path (kernels/fused_moe.fused_moe_reference) against the formula token by token (fp32): 13 tokens,
    5 experts (one unused), top-2, routed by select_experts."""
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, num_experts = 13, 16, 12, 5
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.3
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, 4] = -1e4  # expert 4 gets no token
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.softmax(logits, -1).topk(2).values)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    got = fused_moe_reference(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_config_json_spellings(tmp_path):
    """transformers 4.x configs (Qwen's num_experts, no qkv_bias key) and 5.x (num_local_experts); which
    layers are sparse; an architecture named by model_type alone."""
    base = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, vocab_size=384)
    cases = {
        "Qwen3MoeForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                    norm_topk_prob=True, mlp_only_layers=[0]),
        "Qwen2MoeForCausalLM": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=96, decoder_sparse_step=2),
        "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
    }
    got = {}
    for arch, extra in cases.items():
        # (Mixtral's by model_type alone: a config class's save_pretrained writes no architectures)
        named = {"model_type": "mixtral"} if arch.startswith("Mixtral") else {"architectures": [arch]}
        (tmp_path / "config.json").write_text(json.dumps({**named, **base, **extra}))
        got[arch] = load_model_config(tmp_path)
    qwen3, qwen2, mixtral = got.values()
    assert (qwen3.num_experts, qwen3.moe_intermediate_size, qwen3.norm_topk_prob, qwen3.qk_norm) == (8, 48, True, True)
    assert [qwen3.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert (qwen2.num_experts, qwen2.norm_topk_prob, qwen2.qkv_bias, qwen2.o_bias) == (6, False, True, False)
    assert qwen2.shared_expert_intermediate_size == 96
    assert [qwen2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (4, 160, True)
    assert all(mixtral.is_moe_layer(i) for i in range(4)) and not mixtral.qkv_bias
    assert [c.architecture for c in got.values()] == list(cases)


def test_a_checkpoint_without_one_experts_weight_is_refused(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model("mixtral"), broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights: layers\.1\.mlp\.experts up:2$"):
        LLM(str(broken), dtype="float32")
