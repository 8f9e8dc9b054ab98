"""Read a checkpoint's config.json (transformers 4.x and 5.x spellings) into one flat dataclass."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.models.errors import UnsupportedModelError
from batchgen.models.quantization import Fp8Scheme, checkpoint_scheme

# architecture -> family traits that config.json does not spell out
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},  # None: config's attention_bias
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., scaling fields}
    torch_dtype: str = "float32"
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    quantization: Fp8Scheme | None = None  # the checkpoint's FP8 form (models/quantization.py)


def _rope_settings(raw: dict) -> tuple[float, dict]:
    # transformers 5 writes {"rope_parameters": {"rope_theta", "rope_type", ...}};
    # 4.x writes rope_theta at the top and an optional rope_scaling dict.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    merged["rope_type"] = rope_type
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return float(theta), merged


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    traits = SUPPORTED_ARCHITECTURES[arch]
    quantization = checkpoint_scheme(raw)  # (an unsupported one: refused before anything loads)
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported; supported: silu")
    theta, scaling = _rope_settings(raw)
    num_heads = raw["num_attention_heads"]
    attention_bias = bool(raw.get("attention_bias", False))
    qkv_bias = attention_bias if traits["qkv_bias"] is None else traits["qkv_bias"]
    eos = _as_list(raw.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = _as_list(json.loads(gen_path.read_text()).get("eos_token_id")) or eos
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch,
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        vocab_size=raw["vocab_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=attention_bias and arch != "Qwen2ForCausalLM",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=traits["qk_norm"],
        rope_theta=theta,
        rope_scaling=scaling,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        eos_token_ids=eos,
        sliding_window=sliding,
        quantization=quantization,
    )
