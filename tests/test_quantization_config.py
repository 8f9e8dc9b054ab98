"""config.json's quantization_config -> the FP8 scheme batchgen runs (models/quantization.py), for the
forms published (compressed-tensors FP8-dynamic / FP8 / FP8-block, HF fp8 128x128 blocks), which modules
their ignore lists leave alone, and one-line refusals of anything else."""
import pytest

from batchgen.models.model_config import UnsupportedModelError
from batchgen.models.quantization import (
    QUANTIZE_AT_LOAD,
    Fp8Scheme,
    checkpoint_scheme,
    kv_scale_target,
    resolve_scheme,
)
from tests.fp8_checkpoints import QWEN3_FP8, quantization_config


def _fp8_block_dynamic() -> dict:
    """compressed-tensors' FP8_BLOCK preset (RedHatAI *-FP8-block)."""
    config = quantization_config("channel-dynamic")
    group = config["config_groups"]["group_0"]
    group["weights"].update(strategy="block", block_structure=[128, 128])
    group["input_activations"].update(strategy="group", group_size=128)
    return config


@pytest.mark.parametrize("config,weights,activations", [
    (quantization_config("channel-dynamic"), "channel", "token"),
    (quantization_config("tensor-static"), "tensor", "tensor-static"),
    (QWEN3_FP8, "block", "group"),
    (_fp8_block_dynamic(), "block", "group"),
])
def test_published_forms(config, weights, activations):
    scheme = checkpoint_scheme({"quantization_config": config})
    assert (scheme.weights, scheme.activations) == (weights, activations)
    assert scheme.kv_cache_scales == (config.get("kv_cache_scheme") is not None)
    assert not scheme.quantizes("lm_head") or config is QWEN3_FP8  # (Qwen's lists nothing: its head is bf16)


def test_ignore_lists():
    ct = Fp8Scheme("channel", "token", ("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$", "model.layers.0.mlp.up_proj"))
    assert not ct.quantizes("model.layers.1.mlp.down_proj") and ct.quantizes("model.layers.11.mlp.down_proj")
    assert not ct.quantizes("model.layers.0.mlp.up_proj") and ct.quantizes("model.layers.10.mlp.up_proj")
    qwen = checkpoint_scheme({"quantization_config": {**QWEN3_FP8, "modules_to_not_convert": ["lm_head", "mlp.gate"]}})
    assert not qwen.quantizes("model.layers.3.mlp.gate") and qwen.quantizes("model.layers.3.self_attn.q_proj")


def test_unquantized_and_quantize_at_load():
    assert checkpoint_scheme({"architectures": ["LlamaForCausalLM"]}) is None
    assert resolve_scheme(None, None) is None and resolve_scheme(None, "fp8") is QUANTIZE_AT_LOAD
    scheme = checkpoint_scheme({"quantization_config": QWEN3_FP8})
    assert resolve_scheme(scheme, None) is scheme
    with pytest.raises(UnsupportedModelError, match="already quantized"):
        resolve_scheme(scheme, "fp8")
    # a mixture of experts: its dynamic FP8 checkpoint runs, and --quantization fp8 quantizes it; static
    # activation scales are refused
    assert resolve_scheme(scheme, None, moe=True) is scheme
    assert resolve_scheme(None, "fp8", moe=True) == QUANTIZE_AT_LOAD
    with pytest.raises(UnsupportedModelError, match="static activation scales"):
        resolve_scheme(Fp8Scheme("tensor", "tensor-static"), None, moe=True)


@pytest.mark.parametrize("edit,names", [
    (lambda g: g["weights"].update(num_bits=4, type="int"), "compressed-tensors 'float-quantized' with weights"),
    (lambda g: g.update(input_activations=None), "input activations None"),  # weight-only FP8
    (lambda g: g["input_activations"].update(strategy="tensor"), "activations tensor (dynamic)"),
    (lambda g: g.update(targets=["re:.*mlp.*"]), "compressed-tensors 'float-quantized' with weights"),
])
def test_other_compressed_tensors_forms_are_refused(edit, names):
    config = quantization_config("channel-dynamic")
    edit(config["config_groups"]["group_0"])
    with pytest.raises(UnsupportedModelError, match="not supported; supported: compressed-tensors fp8") as error:
        checkpoint_scheme({"quantization_config": config})
    assert names in str(error.value) and "\n" not in str(error.value)


def test_fp8_without_blocks_or_with_static_activations_is_refused():
    static = {"quant_method": "fp8", "activation_scheme": "static"}
    for config in (static, {**QWEN3_FP8, **static}):
        with pytest.raises(UnsupportedModelError, match="quantization fp8 with weight_block_size"):
            checkpoint_scheme({"quantization_config": config})


def test_kv_cache_scale_names():
    """llm-compressor's names now (self_attn.k_scale) and before (k_proj.output_scale)."""
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k_scale")
    assert kv_scale_target("model.layers.12.self_attn.v_proj.output_scale") == (12, "v_scale")
    assert kv_scale_target("model.layers.3.self_attn.k_proj.weight_scale") is None
