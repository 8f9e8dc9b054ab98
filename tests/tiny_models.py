"""Tiny random-weight checkpoints saved by transformers (fp32), with a tiny BPE tokenizer, for
comparing batchgen against HF transformers on CPU."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
EOS = VOCAB - 1  # an id the tokenizer never produces; random weights emit it now and then
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "batch generation of text with a small language model",
    "paris is the capital of france and berlin is the capital of germany",
    "hello world, this is a test of the tokenizer 0123456789",
] * 20


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def build(kind: str, path: Path) -> Path:
    """kind: llama | llama3 (llama3 rope scaling, untied) | mistral | qwen2 | qwen3 | llama-sharded
    (llama saved in several safetensors files with an index) | qwen3-moe (layer 1 of 3 dense through
    mlp_only_layers) | qwen3-moe-blocks (the same, its q/k/v and dense gate/up shards whole 128-row blocks, for
    FP8 block checkpoints) | mixtral | qwen2-moe (a shared expert; layer 0 of 2 dense: decoder_sparse_step)."""
    import transformers as tf

    torch.manual_seed({"llama": 0, "llama3": 1, "qwen2": 2, "qwen3": 3, "mistral": 4, "llama-sharded": 0,
                       "qwen3-moe": 5, "qwen3-moe-blocks": 5, "mixtral": 6, "qwen2-moe": 7}[kind])
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=EOS,
        bos_token_id=None, pad_token_id=None,
    )
    if kind in ("llama", "llama-sharded"):
        config = tf.LlamaConfig(**common, tie_word_embeddings=True)
    elif kind == "mistral":
        config = tf.MistralConfig(**common, tie_word_embeddings=False, sliding_window=256)
    elif kind == "llama3":
        config = tf.LlamaConfig(
            **common, tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
    elif kind == "qwen2":
        config = tf.Qwen2Config(**common, tie_word_embeddings=False)
    elif kind == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    elif kind in ("qwen3-moe", "qwen3-moe-blocks"):
        blocks = dict(num_key_value_heads=4, intermediate_size=256) if kind == "qwen3-moe-blocks" else {}
        config = tf.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3, **blocks}, head_dim=32, tie_word_embeddings=False, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1],
        )
    elif kind == "mixtral":
        config = tf.MixtralConfig(
            **{**common, "intermediate_size": 32}, tie_word_embeddings=False, num_local_experts=4,
            num_experts_per_tok=2,
        )
    elif kind == "qwen2-moe":
        config = tf.Qwen2MoeConfig(
            **common, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=2,
        )
    else:
        raise ValueError(kind)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: randomize them so they matter
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # routers: clear choices
                p.copy_(0.5 * torch.randn_like(p))
            elif ".experts." in name or ".shared_expert." in name:  # large enough that a wrong one changes tokens
                p.copy_(0.25 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="100KB" if kind == "llama-sharded" else "5GB")
    save_tokenizer(path)
    return path


def load_hf(path: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
