"""Mixture-of-experts decoders: Qwen3-MoE (q/k norm), Mixtral, Qwen2-MoE (qkv bias, a shared expert).
The Llama decoder (models/llama.py) with a sparse MLP (layers/moe.py) in the layers that have one:

  norm -> qkv -> [q/k norm] -> rope + store kv -> attention -> o-proj (+all-reduce) -> residual
       -> norm -> router top-k -> experts' weighted sum [+ gated shared expert] (+all-reduce) -> residual

Dense layers (Qwen's mlp_only_layers / decoder_sparse_step) are Llama's own.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from batchgen.layers.forward_batch import ForwardBatch
from batchgen.layers.layernorm import normed_product
from batchgen.layers.moe import SparseMoeBlock
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from batchgen.models.model_config import ModelConfig
from batchgen.parallel.tensor_parallel import TensorParallel

# one expert's weights in a checkpoint (Qwen: mlp.experts.E.{gate,up,down}_proj; Mixtral:
# block_sparse_moe.experts.E.{w1,w3,w2}), and transformers 5's fused experts (mlp.experts.gate_up_proj
# [E, 2I, H], mlp.experts.down_proj [E, H, I])
EXPERT_WEIGHT = re.compile(
    r"^(?P<layer>layers\.\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|weight_scale)$")
FUSED_EXPERTS = re.compile(r"^(?P<layer>layers\.\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
EXPERT_PROJ = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down"),
               "w1": ("w13", "gate"), "w3": ("w13", "up"), "w2": ("w2", "down")}


class MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel):
        moe = SparseMoeBlock(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, cfg.shared_expert_intermediate_size, tp,
        )
        super().__init__(cfg, rotary, tp, mlp=moe)

    def sums_before_norms(self) -> list[nn.Module]:
        return [self.self_attn.o_proj, self.mlp]

    def forward(self, positions, hidden, residual, batch: ForwardBatch):
        qkv, residual = normed_product(self.input_layernorm, hidden, residual, self.self_attn.qkv_proj)
        hidden = self.self_attn(positions, qkv, batch)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed, norm_follows=True), residual  # (the next layer's norm, or the model's)


class MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_layer(cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, index: int) -> nn.Module:
        if cfg.is_moe_layer(index):
            return MoeDecoderLayer(cfg, rotary, tp)
        return LlamaDecoderLayer(cfg, rotary, tp)

    @staticmethod
    def checkpoint_weight(name: str) -> tuple[str, str] | None:
        """(our parameter, its shard) of a checkpoint's expert weight (name without "model."), else None
        (the loader's packed_modules_mapping then names it). Mixtral's block_sparse_moe is our mlp."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if m := EXPERT_WEIGHT.match(name):
            if m["proj"] in EXPERT_PROJ:  # (an FP8 checkpoint's scale: the weight's, w13_scale or w2_scale)
                ours, part = EXPERT_PROJ[m["proj"]]
                scale = "_scale" if m["kind"] == "weight_scale" else ""
                return f"{m['layer']}.mlp.experts.{ours}{scale}", f"{part}:{m['expert']}"
        if m := FUSED_EXPERTS.match(name):
            ours, part = ("w13", "gate_up") if m["proj"] == "gate_up_proj" else ("w2", "down")
            return f"{m['layer']}.mlp.experts.{ours}", part
        if ".mlp.gate.weight" in name:  # Mixtral's router
            return name, None
        return None

    def checkpoint_module(self, name: str) -> str:
        """The checkpoint's name (without "model.") of our module name: Mixtral's mlp is block_sparse_moe."""
        return name.replace(".mlp.", ".block_sparse_moe.") if self.cfg.architecture == "MixtralForCausalLM" else name

    def use_one_row_mlps(self, device: torch.device, tp_size: int) -> None:
        """The one-launch MLP of a one-row decode is for dense MLPs, each in a ring with the next layer's
        (layers/one_row_mlp.py): an MoE model's layers keep their own products."""
        for layer in self.layers:
            layer.one_row_mlp = None

    def use_batch_invariant_kernels(self) -> None:
        """Refused: the fused MoE groups a step's tokens by expert, and its tiles follow the step's size."""
        raise ValueError("--batch-invariant does not cover mixture-of-experts models yet; leave out --batch-invariant")
