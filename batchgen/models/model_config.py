"""Read a checkpoint's config.json (transformers 4.x and 5.x spellings) into one flat dataclass."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.models.errors import UnsupportedModelError
from batchgen.models.quantization import Fp8Scheme, checkpoint_scheme

# architecture -> family traits that config.json does not spell out. qkv_bias None: the config's
# attention_bias; True/False: the config's qkv_bias where it has one (Qwen2-MoE in transformers 5), else
# that. norm_topk_prob None: the config's (default False, as transformers' Qwen MoE configs); Mixtral's
# router always renormalizes its top-k (softmax over the top-k logits is the same thing).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": None, "qk_norm": True, "norm_topk_prob": None},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False, "norm_topk_prob": True},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": False, "norm_topk_prob": None},
}
# config.json's model_type -> its architecture, for configs without "architectures" (a config class's
# save_pretrained writes none: what a --load-format dummy benchmark may start from)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "qwen2_moe": "Qwen2MoeForCausalLM"}
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
    # mixture of experts (the defaults: a dense model). A layer i is sparse where num_experts > 0, i is not
    # in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; dense layers use intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an MLP every token takes, gated by sigmoid

    quantization: Fp8Scheme | None = None  # the checkpoint's FP8 form (models/quantization.py)

    def context_length(self) -> int:
        """The longest sequence the model's positions cover: max_position_embeddings, stretched by linear rope
        scaling's factor (as vLLM derives it)."""
        factor = self.rope_scaling.get("factor", 1) if self.rope_scaling.get("rope_type") == "linear" else 1
        return int(self.max_position_embeddings * factor)

    def is_moe_layer(self, index: int) -> bool:
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)


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


def _moe_settings(raw: dict, arch: str, traits: dict) -> dict:
    """The MoE fields of ModelConfig ({} for a dense architecture). transformers 4.x writes Qwen's expert
    count as num_experts, 5.x as num_local_experts (Mixtral's in both); Mixtral's experts are
    intermediate_size wide and every layer is sparse."""
    if "norm_topk_prob" not in traits:
        return {}
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"{arch}: config.json needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts "
            f"(got {num_experts}, {top_k})"
        )
    mixtral = arch == "MixtralForCausalLM"
    norm = traits["norm_topk_prob"]
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(raw["intermediate_size"] if mixtral else raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if norm is None else norm,
        decoder_sparse_step=1 if mixtral else int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=[] if mixtral else [int(i) for i in raw.get("mlp_only_layers") or []],
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs or [MODEL_TYPES.get(raw.get("model_type"))] if a in SUPPORTED_ARCHITECTURES), None)
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
    qkv_bias = attention_bias if traits["qkv_bias"] is None else bool(raw.get("qkv_bias", traits["qkv_bias"]))
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
        **_moe_settings(raw, arch, traits),
        quantization=quantization,
    )
