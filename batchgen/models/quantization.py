"""Which FP8 form a checkpoint's config.json `quantization_config` declares (or --quantization fp8 asks
for), and which of the model's linear layers it quantizes (models/fp8_layers.py makes them FP8; this
module reads configs only, so the host may import it without the layers and kernels).

Supported, as published:
- compressed-tensors (RedHatAI / neuralmagic *-FP8-dynamic, *-FP8, *-FP8-block): format float-quantized
  (or naive-quantized), one config group targeting Linear, 8-bit float weights per channel, per tensor
  or in 128x128 blocks, activations dynamic per token, static per tensor, or (with blocks) dynamic per
  group of 128; its `ignore` list; kv_cache_scheme's per-tensor k/v scales.
- HF `quant_method: "fp8"` with weight_block_size [128, 128] and dynamic activations (Qwen3-*-FP8,
  DeepSeek-style): weight_scale_inv per block, activations per group of 128.
Anything else is refused before the job starts (UnsupportedModelError): a checkpoint never runs with
its scales ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from batchgen.models.errors import UnsupportedModelError

BLOCK = 128  # the one block size the kernels take
SUPPORTED = ("compressed-tensors fp8 (float-quantized: weights per channel, per tensor or in 128x128 blocks; "
             "activations dynamic per token, static per tensor, or per 128-group with blocks), "
             "fp8 with weight_block_size [128, 128] and dynamic activations, "
             "or --quantization fp8 on a bf16/fp16/fp32 checkpoint")


@dataclass(frozen=True)
class Fp8Scheme:
    """weights: "channel" | "tensor" | "block"; activations: "token" | "tensor-static" | "group";
    ignore: module names (HF's, e.g. "model.layers.0.mlp.down_proj") left unquantized, each exact or
    "re:<regex>" (compressed-tensors), or a substring of the name (substring_ignore: HF fp8's
    modules_to_not_convert); kv_cache_scales: the checkpoint has per-tensor k/v scales;
    quantize_at_load: --quantization fp8 (the checkpoint is not quantized)."""
    weights: str
    activations: str
    ignore: tuple[str, ...] = ()
    substring_ignore: bool = False
    kv_cache_scales: bool = False
    quantize_at_load: bool = False

    def quantizes(self, module: str) -> bool:
        """Whether the HF module named so (e.g. "model.layers.0.self_attn.q_proj") is quantized."""
        for entry in self.ignore:
            if self.substring_ignore and entry in module:
                return False
            if entry == module or (entry.startswith("re:") and re.match(entry[3:], module)):
                return False
        return True


QUANTIZE_AT_LOAD = Fp8Scheme("channel", "token", quantize_at_load=True)  # as vLLM's quantization="fp8"


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization {what} is not supported; supported: {SUPPORTED}")


def _float8(args: dict | None) -> bool:
    return bool(args) and args.get("num_bits") == 8 and args.get("type") == "float" and args.get("symmetric", True)


def _compressed_tensors(config: dict) -> Fp8Scheme:
    fmt = config.get("format")
    groups = list((config.get("config_groups") or {}).values())
    if fmt not in ("float-quantized", "naive-quantized") or len(groups) != 1:
        raise _refuse(f"compressed-tensors {fmt!r} with {len(groups)} config groups")
    group = groups[0]
    weights, inputs = group.get("weights"), group.get("input_activations")
    if (not _float8(weights) or not _float8(inputs) or group.get("output_activations")
            or list(group.get("targets") or []) != ["Linear"] or group.get("format", fmt) != fmt):
        raise _refuse(f"compressed-tensors {fmt!r} with weights {weights} and input activations {inputs}")
    w_strategy, a_strategy = weights.get("strategy"), inputs.get("strategy")
    dynamic = bool(inputs.get("dynamic"))
    if w_strategy in ("channel", "tensor") and not weights.get("dynamic"):
        activations = {("token", True): "token", ("tensor", False): "tensor-static"}.get((a_strategy, dynamic))
    elif w_strategy == "block" and list(weights.get("block_structure") or []) == [BLOCK, BLOCK]:
        activations = "group" if (a_strategy, dynamic, inputs.get("group_size")) == ("group", True, BLOCK) else None
    else:
        activations = None
    if activations is None:
        blocks = f" {weights['block_structure']}" if weights.get("block_structure") else ""
        raise _refuse(f"compressed-tensors fp8 with weights {w_strategy}{blocks} and activations {a_strategy} "
                      f"({'dynamic' if dynamic else 'static'})")
    kv = config.get("kv_cache_scheme")
    if kv and not (_float8(kv) and kv.get("strategy") == "tensor" and not kv.get("dynamic")):
        raise _refuse(f"compressed-tensors kv_cache_scheme {kv}")
    return Fp8Scheme(w_strategy, activations, tuple(config.get("ignore") or ()), kv_cache_scales=bool(kv))


def _hf_fp8(config: dict) -> Fp8Scheme:
    block = config.get("weight_block_size")
    scheme = config.get("activation_scheme", "dynamic")
    if list(block or []) != [BLOCK, BLOCK] or scheme != "dynamic":
        raise _refuse(f"fp8 with weight_block_size {block} and activation_scheme {scheme!r}")
    ignore = tuple(config.get("modules_to_not_convert") or config.get("ignored_layers") or ())
    return Fp8Scheme("block", "group", ignore, substring_ignore=True)


def checkpoint_scheme(raw_config: dict) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json (its parsed dict), None for an unquantized checkpoint;
    UnsupportedModelError for any other quantization_config."""
    config = raw_config.get("quantization_config") or raw_config.get("compression_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _hf_fp8(config)
    raise _refuse(repr(method))


def resolve_scheme(checkpoint: Fp8Scheme | None, quantization: str | None, moe: bool = False) -> Fp8Scheme | None:
    """The scheme a model runs: its checkpoint's, or QUANTIZE_AT_LOAD for --quantization fp8 on an
    unquantized checkpoint (on a quantized one: UnsupportedModelError). moe: a mixture-of-experts model,
    whose FP8 checkpoint runs unless its activations take static scales (the experts round theirs
    dynamically)."""
    if moe and checkpoint is not None and checkpoint.activations == "tensor-static":
        raise UnsupportedModelError("FP8 mixture-of-experts checkpoints with static activation scales "
                                    "(input_scale) are not supported yet; a dynamic one (*-FP8-dynamic, or "
                                    "weight_block_size [128, 128]) runs")
    if quantization is None:
        return checkpoint
    assert quantization == "fp8", quantization  # (EngineConfig checked it)
    if checkpoint is not None:
        raise UnsupportedModelError(
            "--quantization fp8 quantizes a bf16/fp16/fp32 checkpoint, but this checkpoint is already "
            "quantized (its config.json's quantization_config): leave --quantization out to run it as it is"
        )
    return QUANTIZE_AT_LOAD


def describe_scheme(scheme: Fp8Scheme | None) -> str | None:
    """A scheme in a few words for the engine's description (the output's metadata), e.g. "fp8 checkpoint:
    weights per channel, activations per token"; None: not quantized."""
    if scheme is None:
        return None
    origin = "fp8 quantized at load" if scheme.quantize_at_load else "fp8 checkpoint"
    weights = {"block": f"{BLOCK}x{BLOCK} blocks"}.get(scheme.weights, f"per {scheme.weights}")
    activations = {"token": "per token", "tensor-static": "static per tensor",
                   "group": f"per group of {BLOCK}"}[scheme.activations]
    return f"{origin}: weights {weights}, activations {activations}"


# checkpoint names of per-tensor KV-cache scales -> the attention's attribute
KV_SCALE_NAMES = {".self_attn.k_scale": "k_scale", ".self_attn.v_scale": "v_scale",
                  ".self_attn.k_proj.output_scale": "k_scale", ".self_attn.v_proj.output_scale": "v_scale"}


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer index, "k_scale" | "v_scale") of a checkpoint's KV-cache scale, else None."""
    for suffix, attribute in KV_SCALE_NAMES.items():
        if name.endswith(suffix):
            match = re.search(r"layers\.(\d+)\.", name)
            return (int(match.group(1)), attribute) if match else None
    return None
