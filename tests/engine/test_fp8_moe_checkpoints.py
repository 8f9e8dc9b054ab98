"""FP8 checkpoints of a mixture-of-experts model (tiny Qwen3-MoE with a dense layer, tests/tiny_models.py),
in the published forms with dynamic activations (Qwen's 128x128 blocks, compressed-tensors per channel): the
attention's and the dense MLP's products run in fp8 as a dense model's do, and each expert's e4m3 weight is
dequantized with its scale as it loads. Greedy tokens equal HF transformers' float32 model of the
dequantized weights with the dense products' inputs rounded alike (a difference only after a near tie, as in
test_fp8_checkpoints.py), also under TP=2 (per channel); an expert weight without its scale, and static
activation scales, are refused."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM
from batchgen.kernels.e4m3 import dequantize_weight_ref, quantize_weight_ref
from batchgen.models.model_config import UnsupportedModelError
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

    return get


def generate(model_dir, **options):
    with LLM(str(model_dir), dtype="float32", device="cpu", **options) as llm:
        return llm.generate_list([{"prompt_token_ids": p} for p in prompts()], GREEDY)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("form", MOE_FORMS)
def test_fp8_moe_checkpoint_gives_the_reference_tokens(form, tp, moe_checkpoints):
    if form == "block" and tp == 2:
        pytest.skip("the tiny model's q shard under TP=2 cuts its 128-row blocks (refused)")
    path, dequantized = moe_checkpoints(form)
    reference = moe_reference_model(dequantized, form)
    refs = [greedy_reference(reference, p, MAX_TOKENS) for p in prompts()]
    assert_tokens_match(generate(path, tensor_parallel_size=tp), refs)


def test_fp8_moe_layers_keep_fp8_products_and_dequantized_experts(moe_checkpoints):
    path, _ = moe_checkpoints("block")
    with LLM(str(path), dtype="float32", device="cpu") as llm:
        model = llm.engine.runner.model
        moe_layer = model.layers[0]
        assert moe_layer.self_attn.qkv_proj.fp8 is not None and moe_layer.mlp.gate.fp8 is None  # (router left)
        assert model.layers[1].mlp.gate_up_proj.fp8 is not None  # (the dense layer)
        experts = moe_layer.mlp.experts
        assert experts.w13.dtype.is_floating_point and experts.w13.element_size() == 4 and not experts.pending


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
