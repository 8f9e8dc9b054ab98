"""One decoder for the Llama family: Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm),
SmolLM2. A layer's dataflow:

  norm -> qkv -> [q/k norm] -> rope + store kv -> attention -> o-proj (+all-reduce) -> residual
       -> norm -> gate/up -> silu*mul -> down (+all-reduce) -> residual

Under tensor parallelism on GPUs with symmetric memory each all-reduce is one kernel with the
residual add and RMSNorm after it (the products hand on PartialSums: all of a model's, or none where one
of them cannot, as an FP8 product); on one Hopper GPU the o and down projections of 2 to 64 rows hand
on split-K parts to theirs the same way (kernels/tile_gemm.py).
On one GPU a decode of one sequence runs each layer's norm + MLP in one launch, which hands on its
fp32 sum the same way (layers/one_row_mlp.py).
"""
from __future__ import annotations

import torch
from torch import nn

from batchgen.layers.attention import Attention
from batchgen.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from batchgen.layers.forward_batch import ForwardBatch
from batchgen.layers.layernorm import RMSNorm, normed_product, qk_rmsnorm_
from batchgen.layers.linear import (
    DeferredSum,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    agree_on_deferred_sums,
)
from batchgen.layers.one_row_mlp import OneRowMLP, one_row_mlps
from batchgen.layers.packed_linear import PackableWeight
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.models.model_config import ModelConfig
from batchgen.parallel.tensor_parallel import SINGLE, TensorParallel


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """qkv: [T, (Hq + 2 Hk) D], from qkv_proj (which the layer runs with its norm)."""
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # strided views into qkv: no copies
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head before rope, in place (q, k stay views)
            qk_rmsnorm_(qkv, self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm)
        o = self.attn(q, k, v, positions, self.rotary.cos_sin_cache, batch)  # rope, store kv, attention
        return self.o_proj(o.view(-1, self.num_heads * self.head_dim), norm_follows=True)


class LlamaMLP(nn.Module):
    """gate/up and down; the layer runs them (its norm goes into gate/up, SiLU-and-mul into down, or
    into gate/up's output where the tile kernel takes it: layers/packed_linear.py)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, tp, gate_up=True)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, mlp: nn.Module | None = None):
        """mlp: another MLP than the dense LlamaMLP (a subclass's: models/moe.py)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp) if mlp is None else mlp
        self.one_row_mlp: OneRowMLP | None = None  # LlamaForCausalLM.use_one_row_mlps

    def sums_before_norms(self) -> list[nn.Module]:
        """The modules whose output an add + RMSNorm takes next (the post-attention one, the next layer's)."""
        return [self.self_attn.o_proj, self.mlp.down_proj]

    def forward(self, positions, hidden, residual, batch: ForwardBatch):
        # each norm and the product after it: one launch for one row on a GPU (layernorm.normed_product)
        qkv, residual = normed_product(self.input_layernorm, hidden, residual, self.self_attn.qkv_proj)
        hidden = self.self_attn(positions, qkv, batch)
        if self.one_row_mlp is not None and self.one_row_mlp.takes(hidden, residual):
            return self.one_row_mlp(self.post_attention_layernorm, hidden, residual)  # the MLP in one launch
        gate_up, residual = normed_product(self.post_attention_layernorm, hidden, residual, self.mlp.gate_up_proj)
        return self.mlp.down_proj(gate_up, silu_mul=True, norm_follows=True), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our parameter name, shard of it)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "0"),
        "up_proj": ("gate_up_proj", "1"),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # one cos/sin table shared by every layer
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(self.make_layer(cfg, self.rotary, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def make_layer(cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, index: int) -> nn.Module:
        """Decoder layer `index` (a subclass may make some of them otherwise: models/moe.py)."""
        return LlamaDecoderLayer(cfg, rotary, tp)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden states of the tokens in batch.logits_indices, [S, H]."""
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(batch.positions, hidden, residual, batch)
        if batch.samples_every_token:  # (no gather of every row)
            return self.norm(hidden, residual)[0]
        idx = batch.logits_indices  # the final norm only where logits are needed
        if isinstance(hidden, DeferredSum):  # (summed with the norm, on every row)
            return self.norm(hidden, residual)[0][idx]
        hidden, _ = self.norm(hidden[idx], residual[idx])
        return hidden

    def agree_on_deferred_sums(self) -> None:
        """After loading (FP8 layers known) and the batch-invariant choice: the layers' sums go to the norms
        after them unsummed all, or none (layers/linear.agree_on_deferred_sums)."""
        agree_on_deferred_sums([module for layer in self.layers for module in layer.sums_before_norms()])

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.lm_head(hidden, fp32)

    def use_one_row_mlps(self, device: torch.device, tp_size: int) -> None:
        """A GPU's decodes of one sequence run each MLP in one launch where that pays
        (layers/one_row_mlp.py; it keeps a transposed copy of each down projection)."""
        mlps = one_row_mlps([layer.mlp for layer in self.layers], device, tp_size)
        for i, layer in enumerate(self.layers):
            layer.one_row_mlp = None if mlps is None else mlps[i]

    def use_batch_invariant_kernels(self) -> None:
        """GPU: every product through kernels/invariant_gemm.py and every attention through unified
        attention's one tile (EngineConfig.batch_invariant; the runner then makes no one-row MLPs). FP8
        layers are refused: their products are not batch-invariant yet."""
        for module in self.modules():
            if isinstance(module, PackableWeight):
                if module.fp8 is not None:
                    raise ValueError("--batch-invariant does not cover FP8 models yet; leave out --quantization, "
                                     "or --batch-invariant")
                module.batch_invariant = True
            elif isinstance(module, Attention):
                module.batch_invariant = True

    def pack_weights(self) -> None:
        """CPU: every matrix product through a packed weight (layers/packed_linear.py)."""
        for module in self.modules():
            if isinstance(module, PackableWeight) and module is not self.lm_head:
                module.pack()
        self.lm_head.pack(keep_plain=self.cfg.tie_word_embeddings)  # tied: the embedding reads it

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]
