"""Tiny FP8 checkpoints in the published forms, written from a tiny fp32 HF checkpoint: real e4m3 tensors,
their scales and config.json's quantization_config laid out as the published ones are:

- "channel-dynamic": compressed-tensors float-quantized, weights per channel (weight_scale [N, 1]),
  activations dynamic per token (RedHatAI Meta-Llama-3.1-8B-Instruct-FP8-dynamic);
- "tensor-static": compressed-tensors, weights per tensor (weight_scale [1]), static activations
  (input_scale [1], from a calibration run), kv_cache_scheme with self_attn.k_scale / v_scale
  (RedHatAI Meta-Llama-3.1-8B-Instruct-FP8 with an FP8 KV cache);
- "block": HF quant_method "fp8" with weight_block_size [128, 128] (weight_scale_inv per block,
  activations dynamic per group of 128) (Qwen/Qwen3-8B-FP8);
- "ignore": channel-dynamic with lm_head and layer 1's mlp.down_proj in `ignore` (left in fp32).

The base model's dims suit 128-blocks and also have dims that are not multiples of 128 (hidden 192), as
some published models do. `reference_model` is HF transformers' model of the base checkpoint with the
same quantization applied: dequantized weights and each quantized Linear's input rounded to e4m3.
`write_moe` writes a per-expert MoE checkpoint in the "block" and "channel-dynamic" forms (experts, attention
and dense MLPs quantized; routers and lm_head not), and `moe_reference_model` is its HF reference.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import EOS, VOCAB, save_tokenizer

E4M3 = torch.float8_e4m3fn
BLOCK = 128
FORMS = ("channel-dynamic", "tensor-static", "block", "ignore")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
IGNORED_DOWN = "model.layers.1.mlp.down_proj"

_GROUP = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
          "symmetric": True, "type": "float"}


def _compressed_tensors(weights: str, activations: str, ignore: list[str], kv_cache: bool) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (FP8_DYNAMIC / FP8 schemes)."""
    dynamic = activations == "token"
    return {
        "config_groups": {"group_0": {
            "input_activations": {**_GROUP, "dynamic": dynamic, "observer": None if dynamic else "minmax",
                                  "strategy": activations},
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {**_GROUP, "dynamic": False, "observer": "minmax", "strategy": weights},
        }},
        "format": "float-quantized",
        "global_compression_ratio": 1.24,
        "ignore": ignore,
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                            "symmetric": True} if kv_cache else None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def quantization_config(form: str) -> dict:
    if form == "channel-dynamic":
        return _compressed_tensors("channel", "token", ["lm_head"], kv_cache=False)
    if form == "tensor-static":
        return _compressed_tensors("tensor", "tensor", ["lm_head"], kv_cache=True)
    if form == "block":
        return dict(QWEN3_FP8)
    if form == "ignore":
        return _compressed_tensors("channel", "token", ["lm_head", IGNORED_DOWN], kv_cache=False)
    raise ValueError(form)


def build_base(path: Path, hidden: int = 192, intermediate: int = 384, heads: int = 4, head_dim: int = 32) -> Path:
    """A tiny fp32 Llama (as many KV heads as heads) whose q/k/v and gate/up shards are, at the default
    sizes, whole 128-row blocks and whose hidden size (192) is not a multiple of 128; an untied LM head."""
    import transformers as tf

    torch.manual_seed(5)
    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=EOS,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 so that they matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


def quantized_modules(form: str, num_layers: int) -> list[str]:
    names = [f"model.layers.{i}.{linear}" for i in range(num_layers) for linear in LINEARS]
    return [n for n in names if not (form == "ignore" and n == IGNORED_DOWN)]


def _to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(E4M3)


def _grid_per_element(grid: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A block scale grid [ceil(N/128), ceil(K/128)] spread over the [N, K] elements it scales."""
    return grid.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3, scale grid [ceil(N/128), ceil(K/128)]), scale = amax(block) / 448."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))  # [N/B, B, K/B, B]
    grid = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    return _to_e4m3(w, _grid_per_element(grid, n, k)), grid


def calibration_amax(base: Path, modules: list[str]) -> dict[str, float]:
    """Each module's largest |input| over a few random prompts (the static form's calibration)."""
    from tests.tiny_models import load_hf

    model = load_hf(base)
    amax = dict.fromkeys(modules, 0.0)
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda mod, args, name=name: amax.__setitem__(name, max(amax[name], float(args[0].abs().max()))))
        for name in modules]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (4, 48), generator=gen))
    for hook in hooks:
        hook.remove()
    return amax


def write(form: str, base: Path, path: Path) -> Path:
    """The base checkpoint written in an FP8 form (see the module docstring)."""
    shutil.copytree(base, path)
    (path / "model.safetensors").unlink()
    config = json.loads((base / "config.json").read_text())
    tensors = load_file(base / "model.safetensors")
    modules = quantized_modules(form, config["num_hidden_layers"])
    amax = calibration_amax(base, modules) if form == "tensor-static" else {}
    out = dict(tensors)
    for name in modules:
        w = tensors[f"{name}.weight"]
        if form == "block":
            out[f"{name}.weight"], out[f"{name}.weight_scale_inv"] = _block_quantize(w)
            continue
        if form == "tensor-static":
            scale = (w.abs().max() / 448).reshape(1)
            # q/k/v (and gate/up) see the same input: the same amax, so the same input scale
            out[f"{name}.input_scale"] = torch.tensor([amax[name] / 448])
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 448  # [N, 1]
        out[f"{name}.weight"] = _to_e4m3(w, scale if scale.dim() == 2 else scale[0])
        out[f"{name}.weight_scale"] = scale
    if form == "tensor-static":  # per-tensor KV-cache scales, as llm-compressor names them
        for i in range(config["num_hidden_layers"]):
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02 + 0.01 * i)
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.03 + 0.01 * i)
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(form)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def checkpoint_maker(root: Path):
    """form -> directory of that form's checkpoint under root ("base": the fp32 one), each written once."""
    made = {}

    def get(form: str) -> Path:
        if "base" not in made:
            made["base"] = build_base(root / "base")
        if form not in made:
            made[form] = write(form, made["base"], root / form)
        return made[form]

    return get


def with_quantization_config(base: Path, path: Path, quant: dict) -> Path:
    """The base checkpoint with only its config.json's quantization_config set (refusal tests)."""
    shutil.copytree(base, path)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# --- the float32 reference: HF transformers with the same quantization -------------------------------

def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(E4M3).float() * scale


def round_input(x: torch.Tensor, activations: str, input_scale: float | None) -> torch.Tensor:
    """x [..., K] rounded to e4m3: per token, with a static scale, or per group of 128 along K."""
    if activations == "token":
        return _round(x, x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448)
    if activations == "tensor":
        return _round(x, torch.tensor(input_scale))
    k = x.shape[-1]
    groups = torch.nn.functional.pad(x, (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))
    return _round(groups, groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448).flatten(-2)[..., :k]


def reference_model(base: Path, quantized: Path | None = None, form: str = "channel-dynamic"):
    """HF's model of base with each quantized Linear's weight dequantized from the quantized checkpoint
    (None: quantized here per output channel, as --quantization fp8 does) and its input rounded to e4m3
    (a forward pre-hook); merged inputs' static scales: the largest of the shards' (one input)."""
    from tests.tiny_models import load_hf

    model = load_hf(base)
    num_layers = model.config.num_hidden_layers
    tensors = load_file(quantized / "model.safetensors") if quantized is not None else None
    activations = {"block": "group", "tensor-static": "tensor"}.get(form, "token")
    for name in quantized_modules(form, num_layers):
        linear = model.get_submodule(name)
        input_scale = None
        if tensors is None:
            w = linear.weight.data
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
            dequantized = _to_e4m3(w, scale).float() * scale
        elif form == "block":
            full = _grid_per_element(tensors[f"{name}.weight_scale_inv"], *linear.weight.shape)
            dequantized = tensors[f"{name}.weight"].float() * full
        else:
            scale = tensors[f"{name}.weight_scale"]
            dequantized = tensors[f"{name}.weight"].float() * (scale if scale.dim() == 2 else scale[0])
            if form == "tensor-static":
                siblings = [s for s in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if name.endswith(s)]
                names = [name.rsplit(".", 1)[0] + "." + s for s in siblings[0]] if siblings else [name]
                input_scale = max(float(tensors[f"{n}.input_scale"]) for n in names)
        linear.weight.data.copy_(dequantized)
        linear.register_forward_pre_hook(
            lambda mod, args, scale=input_scale: (round_input(args[0], activations, scale),))
    return model


def greedy_reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """(HF generate's greedy tokens, each step's top-2 logit margin)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    margins = [float(v[0] - v[1]) for v in (logits[0].topk(2).values for logits in out.logits)]
    return out.sequences[0, len(prompt):].tolist(), margins


# --- a mixture-of-experts model's FP8 checkpoints --------------------------------------------------

MOE_FORMS = ("block", "channel-dynamic")
MOE_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
                           r"\.weight$")


def moe_quantization_config(form: str, routers: list[str]) -> dict:
    """As published: Qwen's fp8 blocks leave lm_head and each layer's router (mlp.gate) alone by name;
    compressed-tensors by a regex."""
    if form == "block":
        return {**QWEN3_FP8, "modules_to_not_convert": ["lm_head", *routers]}
    return _compressed_tensors("channel", "token", ["lm_head", r"re:.*mlp\.gate$"], kv_cache=False)


def write_moe(form: str, base: Path, path: Path, dequantized: Path) -> Path:
    """base (a per-expert MoE checkpoint) in an FP8 form at path: attention, dense MLP and expert weights
    in e4m3 with their scales, routers and lm_head as they are; and at `dequantized` the same weights
    dequantized in fp32 without a quantization_config (the HF reference loads that)."""
    for target in (path, dequantized):
        shutil.copytree(base, target)
        (target / "model.safetensors").unlink()
    config = json.loads((base / "config.json").read_text())
    tensors = load_file(base / "model.safetensors")
    out, plain = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if not MOE_QUANTIZED.match(name):
            continue
        if form == "block":
            q, grid = _block_quantize(w)
            out[name], out[f"{name}_scale_inv"] = q, grid
            plain[name] = q.float() * _grid_per_element(grid, *w.shape)
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 448  # [N, 1]
            out[name], out[f"{name}_scale"] = _to_e4m3(w, scale), scale
            plain[name] = out[name].float() * scale
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors", metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in plain.items()}, dequantized / "model.safetensors",
              metadata={"format": "pt"})
    routers = sorted({n.removesuffix(".weight") for n in tensors if n.endswith(".mlp.gate.weight")})
    config["quantization_config"] = moe_quantization_config(form, routers)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def moe_reference_model(dequantized: Path, form: str):
    """HF's model of the dequantized weights, each dense quantized Linear's input rounded to e4m3 (per group
    of 128 for blocks, else per token), and the experts' too: x before gate/up and silu(gate) * up before
    down (batchgen's FP8 experts round both, as vLLM's do)."""
    from tests.tiny_models import load_hf

    model = load_hf(dequantized)
    activations = "group" if form == "block" else "token"
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and MOE_QUANTIZED.match(f"{name}.weight"):
            module.register_forward_pre_hook(lambda mod, args: (round_input(args[0], activations, None),))
        if name.endswith("mlp.experts"):
            module.forward = _rounded_experts(module, activations)
    return model


def _rounded_experts(experts, activations: str):
    """transformers 5's experts' forward (gate_up_proj [E, 2I, H], down_proj [E, H, I]), pair by pair, with
    each product's input rows rounded to e4m3."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        x = round_input(hidden_states, activations, None)
        for t, j in torch.cartesian_prod(torch.arange(x.shape[0]), torch.arange(top_k_index.shape[1])).tolist():
            e = int(top_k_index[t, j])
            gate, up = torch.nn.functional.linear(x[t], experts.gate_up_proj[e]).chunk(2)
            h = round_input((experts.act_fn(gate) * up)[None], activations, None)[0]
            out[t] += torch.nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[t, j]
        return out

    return forward
