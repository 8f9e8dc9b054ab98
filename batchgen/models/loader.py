"""Load a local HF checkpoint directory: config.json, *.safetensors (sharded or not), tokenizer files.
Weights are read only from safetensors (never pickle); load_format "dummy" makes random ones instead,
from config.json alone (benchmarks of large models without writing their checkpoints first)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchgen.kernels.device import use_pdl
from batchgen.layers.fp8 import E4M3
from batchgen.models.fp8_layers import apply_scheme
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from batchgen.models.moe import MoeForCausalLM
from batchgen.models.quantization import kv_scale_target, resolve_scheme
from batchgen.parallel.tensor_parallel import SINGLE, TensorParallel

SKIPPED_WEIGHTS = ("rotary_emb.inv_freq",)

# architecture (config.json's) -> the model class that runs it
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
DUMMY_STD = 0.02  # the spread of dummy weights (transformers' initializer_range): activations stay finite
DUMMY_FP8_SPREAD = 64.0  # dummy e4m3 weights' spread before their scale (well inside e4m3's +-448)
DUMMY_INPUT_SCALE = 0.02  # a dummy static activation scale: rows of a few units stay inside e4m3's range


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (batchgen does not load pickle files)")
    return files


def _our_name(name: str, model: nn.Module) -> tuple[str, str | None]:
    name = name.removeprefix("model.")
    special = getattr(model, "checkpoint_weight", None)  # (an MoE model's experts)
    if special is not None and (found := special(name)) is not None:
        return found
    for theirs, (ours, shard) in model.packed_modules_mapping.items():
        if f".{theirs}." in name:
            return name.replace(f".{theirs}.", f".{ours}."), shard
    return name, None


def load_weights(model: nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    loaded = set()
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_word_embeddings
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith(SKIPPED_WEIGHTS) or (tied and name == "lm_head.weight"):
                    continue
                if _load_kv_scale(model, name, f):
                    continue
                ours, shard = _our_name(_fp8_name(name), model)
                param = params.get(ours)
                if param is None:
                    raise ValueError(f"checkpoint weight {name!r} has no place in the model")
                tensor = _fp8_checked(name, f.get_tensor(name), param).to(param.dtype)
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    param.data.copy_(tensor)
                else:
                    loader(param, tensor, shard)
                loaded.add(ours)
    missing = set(params) - loaded - ({"lm_head.weight"} if tied else set())
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights: {', '.join(sorted(missing)[:5])}")
    for name, module in model.named_modules():  # an MoE layer's experts load piece by piece
        gaps = module.missing_weights() if hasattr(module, "missing_weights") else []
        if gaps:
            raise ValueError(f"checkpoint {model_dir} lacks weights: {name} {', '.join(gaps[:5])}")
    for param in params.values():  # done with: each is a bound method of the parameter's module, a
        if hasattr(param, "weight_loader"):  # reference cycle that would keep the weights after the model
            del param.weight_loader


def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights, normal * DUMMY_STD (norm weights 1), the same for a seed on every run. Each
    parameter draws from its own generator seeded by (seed, its index), so the tensor-parallel ranks
    fill their replicated parameters (norms, routers) alike. An FP8 checkpoint's config: e4m3 weights of
    normal * DUMMY_FP8_SPREAD with every weight scale DUMMY_STD / DUMMY_FP8_SPREAD (the same spread once
    dequantized), static input scales DUMMY_INPUT_SCALE."""
    for index, (name, param) in enumerate(model.named_parameters()):
        if hasattr(param, "weight_loader"):
            del param.weight_loader  # (as load_weights does: it ties the parameter to its module)
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        if name.endswith("input_scale"):
            param.data.fill_(DUMMY_INPUT_SCALE)
            continue
        if name.endswith("_scale"):  # (weight_scale, w13_scale, w2_scale)
            param.data.fill_(DUMMY_STD / DUMMY_FP8_SPREAD)
            continue
        gen = torch.Generator(param.device).manual_seed((seed * 1_000_003 + index) % 2**63)
        if param.dtype == E4M3:  # (torch draws no normal numbers in e4m3)
            values = torch.randn(param.shape, generator=gen, device=param.device) * DUMMY_FP8_SPREAD
            param.data.copy_(values.clamp(-448, 448))
            continue
        param.data.copy_(torch.randn(param.shape, generator=gen, device=param.device, dtype=param.dtype))
        param.data.mul_(DUMMY_STD)


def _fp8_name(name: str) -> str:
    """HF fp8's block scales (weight_scale_inv: dequantized = weight * weight_scale_inv) are our weight_scale."""
    return name.removesuffix("_inv") if name.endswith(".weight_scale_inv") else name


def _fp8_checked(name: str, tensor: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """tensor, unless it is an fp8 weight for a layer the config leaves unquantized, or a 16/32-bit one for a
    layer it quantizes (either would run unscaled)."""
    fp8 = tensor.is_floating_point() and tensor.element_size() == 1
    if fp8 and param.dtype != E4M3:
        raise ValueError(f"checkpoint weight {name!r} is fp8 but its config.json's quantization_config does not "
                         f"quantize that layer (see its ignore list)")
    if param.dtype == E4M3 and not fp8:
        raise ValueError(f"checkpoint weight {name!r} is {tensor.dtype} but its config.json's quantization_config "
                         f"quantizes that layer (see its ignore list)")
    return tensor


def _load_kv_scale(model: nn.Module, name: str, f) -> bool:
    """A checkpoint's per-tensor KV-cache scale goes to its layer's attention (k_scale / v_scale): True."""
    target = kv_scale_target(name)
    if target is None:
        return False
    layer, attribute = target
    setattr(model.attention_layers()[layer], attribute, float(f.get_tensor(name).float().reshape(-1)[0]))
    return True


def build_model(
    cfg: ModelConfig, model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
    tp: TensorParallel = SINGLE, pdl: bool = True, load_format: str = "auto", seed: int = 0,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """The model with its weights (load_format "dummy": random ones from seed); pdl: whether its kernels
    take programmatic dependent launch where the GPU has it (EngineConfig.pdl); quantization:
    EngineConfig.quantization (the checkpoint's own FP8 form needs none: models/quantization.py)."""
    scheme = resolve_scheme(cfg.quantization, quantization, moe=cfg.num_experts > 0)
    use_pdl(pdl)
    with torch.device(device):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = MODEL_CLASSES[cfg.architecture](cfg, max_positions, tp)
        finally:
            torch.set_default_dtype(default_dtype)
        fp8_finishes = [] if scheme is None else apply_scheme(model, scheme, model.packed_modules_mapping)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir)
    for finish in fp8_finishes:
        finish(dtype)
    return model.eval()
