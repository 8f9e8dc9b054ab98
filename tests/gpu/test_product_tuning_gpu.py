"""On a Hopper GPU: start-up tuning of the products of 65-256 rows (executor/product_tuning.py) times
cuBLAS against the candidate tiles for each product of a model whose shapes the tile kernel takes,
keeps the choices, and a forward whose products go to the tiles gives cuBLAS's logits."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import batchgen.executor.product_tuning as tuning
import batchgen.kernels.tile_gemm as tg
from batchgen import LLM
from batchgen.executor.warmup import reset_synthetic_rows, synthetic_batch
from tests.tiny_models import VOCAB, save_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer llama whose K are whole 128-column steps (the tile kernel's)."""
    path = tmp_path_factory.mktemp("llama-tiles")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)
    return path


def test_tuned_products(model_dir, tmp_path, monkeypatch):
    if not tg.tile_gemm_supported(torch.device("cuda")):
        pytest.skip("the tile kernel needs a Hopper or datacenter Blackwell GPU")
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(tg, "tuned", {})
    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=96, gpu_memory_utilization=0.3)
    sizes = [80, 96, 128, 192, 256]
    shapes = [(2048, 256, "bfloat16", True, False), (256, 256, "bfloat16", False, True),
              (256, 1024, "bfloat16", False, True)]
    assert set(tg.tuned) == {(*s, m) for s in shapes for m in sizes}
    for (n, k, _, silu, _, m), tile in tg.tuned.items():
        assert tile is None or tile in tg.candidate_tiles(m, n // 2 if silu else n, k, silu)
    kept = json.loads((tmp_path / "tuned_products.json").read_text())
    assert len(kept) == 15 and torch.cuda.get_device_name() in next(iter(kept))

    # every tuned product through its first candidate tile, then through cuBLAS: the same logits (bf16)
    runner = llm.engine.runner
    with torch.inference_mode():
        fb = synthetic_batch(runner.kv, runner.device, [30] * 40, [(56, 90)])  # 96 tokens
        fb.record_slots()
        for (n, k, _, silu, _, m) in list(tg.tuned):
            tg.tuned[(n, k, "bfloat16", silu, not silu, m)] = tg.candidate_tiles(m, n // 2 if silu else n, k, silu)[0]
        with tg.recording_products() as asked:
            tiled = runner.forward(fb)
        assert len(asked) == 3
        tg.tuned.clear()
        plain = runner.forward(fb)
        reset_synthetic_rows(runner.kv)
    torch.testing.assert_close(tiled, plain, atol=0.05, rtol=0.05)
    assert (tiled.argmax(-1) == plain.argmax(-1)).float().mean() > 0.9
    llm.close()

    # the next start reads the choices: nothing timed
    monkeypatch.setattr(tuning, "time_choice", lambda *a: pytest.fail("timed again"))
    llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=96, gpu_memory_utilization=0.3)
    assert len(tg.tuned) == 15
    llm.close()
