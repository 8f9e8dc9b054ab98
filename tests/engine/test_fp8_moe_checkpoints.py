"""FP8 checkpoints of a mixture-of-experts model (tiny Qwen3-MoE with a dense layer, tests/tiny_models.py),
in the published forms with dynamic activations (Qwen's 128x128 blocks, compressed-tensors per channel), and
--quantization fp8 on its bf16 checkpoint: the attention's and the dense MLP's products run in fp8 as a dense
model's do, and the experts' products round their inputs to e4m3 too (on a CPU with the weights dequantized at
load, as the dense layers'). Greedy tokens equal HF transformers' float32 model of the dequantized weights with
every quantized product's inputs rounded alike (a difference only after a near tie, as in
test_fp8_checkpoints.py), also under TP=2 (per channel); an expert weight without its scale, and static
activation scales, are refused."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.kernels.e4m3 import dequantize_weight_ref, quantize_weight_ref
from batchgen.kernels.fused_moe import dequantize_experts
from batchgen.layers.moe import FusedExperts
from batchgen.models.fp8_layers import _check_expert_blocks
from batchgen.models.model_config import UnsupportedModelError
from batchgen.parallel.tensor_parallel import TensorParallel
from tests.engine.test_fp8_checkpoints import GREEDY, MAX_TOKENS, assert_tokens_match, prompts
from tests.fp8_checkpoints import MOE_FORMS, greedy_reference, moe_reference_model, write_moe
from tests.tiny_models import build


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """form -> (the FP8 checkpoint, its dequantized fp32 copy), each written once."""
    root = tmp_path_factory.mktemp("fp8-moe")
    base = build("qwen3-moe-blocks", root / "base")
    made = {}

    def get(form: str):
        if form not in made:
            made[form] = write_moe(form, base, root / form, root / f"{form}-dequantized"), root / f"{form}-dequantized"
        return made[form]

    get.base = base
    return get


def generate(model_dir, **options):
    with LLM(str(model_dir), dtype="float32", device="cpu", **options) as llm:
        return llm.generate_list([{"prompt_token_ids": p} for p in prompts()], GREEDY)


@pytest.mark.parametrize("tp,expert_parallel", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("form", MOE_FORMS)
def test_fp8_moe_checkpoint_gives_the_reference_tokens(form, tp, expert_parallel, moe_checkpoints):
    """At TP=2 each rank holds its slice of every expert's weights and scales, or (expert parallel) its
    experts' whole."""
    if form == "block" and tp == 2:
        pytest.skip("the tiny model's q shard under TP=2 cuts its 128-row blocks (refused)")
    path, dequantized = moe_checkpoints(form)
    reference = moe_reference_model(dequantized, form)
    refs = [greedy_reference(reference, p, MAX_TOKENS) for p in prompts()]
    assert_tokens_match(generate(path, tensor_parallel_size=tp, expert_parallel=expert_parallel), refs)


def test_quantize_at_load_gives_the_per_channel_reference_tokens(moe_checkpoints):
    """--quantization fp8 on the bf16 checkpoint: every linear layer but the routers and lm_head, experts
    included, per channel with per-token inputs: the channel-dynamic checkpoint's numbers."""
    _, dequantized = moe_checkpoints("channel-dynamic")
    reference = moe_reference_model(dequantized, "channel-dynamic")
    refs = [greedy_reference(reference, p, MAX_TOKENS) for p in prompts()]
    assert_tokens_match(generate(moe_checkpoints.base, quantization="fp8"), refs)


def test_fp8_moe_layers_keep_fp8_products_and_round_the_experts_inputs(moe_checkpoints):
    path, _ = moe_checkpoints("block")
    with LLM(str(path), dtype="float32", device="cpu") as llm:
        model = llm.engine.runner.model
        moe_layer = model.layers[0]
        assert moe_layer.self_attn.qkv_proj.fp8 is not None and moe_layer.mlp.gate.fp8 is None  # (router left)
        assert model.layers[1].mlp.gate_up_proj.fp8 is not None  # (the dense layer)
        experts = moe_layer.mlp.experts
        # (a CPU: weights dequantized into fp32 at load, inputs rounded per group of 128)
        assert experts.w13.dtype == torch.float32 and experts.fp8.block and experts.fp8.w13_scale is None


def test_expert_weight_without_its_scale_is_refused(moe_checkpoints, tmp_path):
    path, _ = moe_checkpoints("channel-dynamic")
    broken = shutil.copytree(path, tmp_path / "broken")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight_scale"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts up:3 \(its scale missing\)"):
        LLM(str(broken), dtype="float32", device="cpu")


def test_static_activation_scales_on_a_moe_checkpoint_are_refused(moe_checkpoints, tmp_path):
    path, _ = moe_checkpoints("channel-dynamic")
    static = shutil.copytree(path, tmp_path / "static")
    config = json.loads((path / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["strategy"] = "tensor"
    group["input_activations"].update(strategy="tensor", dynamic=False)
    (static / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="static activation scales"):
        LLM(str(static), dtype="float32", device="cpu")


def test_expert_scales_of_each_form_dequantize_as_the_dense_layers_do():
    """Per tensor, per channel ([N] or [N, 1]) and 128x128 blocks, including a block grid with as many
    entries as the weight has rows (N = 256, K = 16,384): told apart by shape, not size."""
    w = torch.randn(256, 16384)
    q, grid = quantize_weight_ref(w, block=True)
    assert grid.numel() == w.shape[0]
    per_element = grid.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(dequantize_weight_ref(q, grid), q.float() * per_element)
    q, rows = quantize_weight_ref(w)
    for scale in (rows, rows[:, None]):
        assert torch.equal(dequantize_weight_ref(q, scale), q.float() * rows[:, None])
    one = torch.tensor([0.01])
    assert torch.equal(dequantize_weight_ref(q, one), q.float() * 0.01)


@pytest.mark.parametrize("form", [*MOE_FORMS, "quantize-at-load"])
def test_prompt_logprobs_are_the_references(form, moe_checkpoints):
    """Where tokens cannot tell (a tiny model's few greedy steps), the prompt log-probabilities do: the experts'
    rounded inputs move them by ~1e-2 here; the same rounding on both sides leaves fp32 noise.
    (quantize-at-load: --quantization fp8 on the bf16 checkpoint, against the per-channel checkpoint's reference.)"""
    path, dequantized = moe_checkpoints("channel-dynamic" if form == "quantize-at-load" else form)
    reference = moe_reference_model(dequantized, "channel-dynamic" if form == "quantize-at-load" else form)
    options = {"quantization": "fp8"} if form == "quantize-at-load" else {}
    if options:
        path = moe_checkpoints.base
    rows = [{"prompt_token_ids": p, "prompt_logprobs": True} for p in prompts()]
    with LLM(str(path), dtype="float32", device="cpu", **options) as llm:
        results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=1))
    for p, r in zip(prompts(), results):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = reference(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r["prompt_logprobs"]), want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("form", ["channel", "tensor", "block"])
def test_a_ranks_experts_take_their_slice_of_each_scale(form):
    """Rank 1 of 2: its gate/up rows and down columns of each expert's e4m3 weight, and the matching rows (or
    block rows, or down's block columns) of its scales (a per-tensor scale: for every row); dequantized, the
    rank's slice of the whole layer."""
    torch.manual_seed(0)
    num_experts, hidden, inter = 2, 256, 512
    block = form == "block"
    experts = FusedExperts(num_experts, hidden, inter, TensorParallel(rank=1, size=2))
    experts.accept_fp8(block)
    whole = {}
    for e in range(num_experts):
        for part, shape, param in (("gate", (inter, hidden), experts.w13), ("up", (inter, hidden), experts.w13),
                                   ("down", (hidden, inter), experts.w2)):
            q, scale = quantize_weight_ref(torch.randn(shape), block)
            if form == "tensor":  # (a checkpoint's [1]: every row takes it)
                scale = scale.max().reshape(1)
            experts.weight_loader(param, q, f"{part}:{e}")
            scale_param = experts.w2_scale if part == "down" else experts.w13_scale
            experts.scale_loader(scale_param, scale[:, None] if form == "channel" else scale, f"{part}:{e}")
            whole[part, e] = dequantize_weight_ref(q, scale)
    assert experts.missing_weights() == []
    w13, w2 = dequantize_experts(experts.w13, experts.w2, experts.fp8)
    mine = slice(inter // 2, inter)
    for e in range(num_experts):
        assert torch.equal(w13[e], torch.cat([whole["gate", e][mine], whole["up", e][mine]]))
        assert torch.equal(w2[e], whole["down", e][:, mine])


def test_blocks_that_a_tensor_parallel_slice_cuts_are_refused():
    experts = FusedExperts(2, 256, 384, TensorParallel(rank=0, size=2))  # 192 features a rank: 1.5 blocks
    with pytest.raises(UnsupportedModelError, match="whole blocks of 128"):
        _check_expert_blocks(experts, "model.layers.0.mlp.experts")
