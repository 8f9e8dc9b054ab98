"""--kv-cache-dtype fp8: the pool holds float8_e4m3fn (a quarter of fp32's bytes: four times the
tokens in the same budget), the model reads it back, and the answers stay the model's. (Eviction and
preemption on an fp8 pool: tests/engine/test_prefix_caching.py's small_fp8 setting.)"""
import pytest
import torch

from batchgen import LLM, EngineConfig, SamplingParams
from batchgen.engine.runner import resolve_kv_dtype
from tests.engine.test_default_model import pytestmark as needs_default_model


def test_a_bad_kv_cache_dtype_names_the_option():
    with pytest.raises(ValueError, match=r"invalid --kv-cache-dtype: 'int4'; choose one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int4")


def test_fp8_needs_an_ada_or_hopper_gpu(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"invalid --kv-cache-dtype: fp8 needs .* 8.9 or newer .* this one is 8.0"):
        resolve_kv_dtype("fp8", torch.bfloat16, cuda)
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16, cuda) == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8", torch.float32, torch.device("cpu")) == torch.float8_e4m3fn


def test_fp8_pool_holds_four_times_the_fp32_tokens(tiny_model):
    options = dict(dtype="float32", device="cpu", cpu_kv_cache_gb=0.0001, max_num_seqs=4)
    auto = LLM(str(tiny_model("llama")), **options)
    fp8 = LLM(str(tiny_model("llama")), kv_cache_dtype="fp8", **options)
    assert fp8.engine.kv.k.dtype == torch.float8_e4m3fn and auto.engine.kv.k.dtype == torch.float32
    assert 4 * auto.engine.kv.num_slots <= fp8.engine.kv.num_slots < 4 * (auto.engine.kv.num_slots + 1)  # (floors)
    assert fp8.describe()["kv_cache_dtype"] == "float8_e4m3fn" and auto.describe()["kv_cache_dtype"] == "float32"


@needs_default_model
def test_default_model_changes_no_more_from_an_fp8_pool_than_from_bf16():
    """Greedy answers of the real model: K/V rounded to fp8 (fp32 compute) keep the fp32 answers at
    least as often as computing in bf16 does. (The 135M model is often on a near-tie: fp32 says
    "Il Coriobella, Italy." for Italy's capital, bf16 and the fp8 pool "The capital of Italy is
    Rome.")"""
    questions = ["What is the capital of France?", "What is the capital of Italy?", "Name a river in Germany.",
                 "What is 2 + 3?", "Who wrote Hamlet?", "What color is the sky?", "Translate 'cat' to French.",
                 "What is the largest planet?"]
    rows = [{"id": i, "messages": [{"role": "user", "content": q}]} for i, q in enumerate(questions)]
    sampling = SamplingParams(temperature=0, max_tokens=16)

    def texts(**options):
        return [r["text"] for r in LLM(max_num_seqs=8, **options).generate_list(rows, sampling)]

    fp32 = texts(dtype="float32")
    fp8_pool = texts(dtype="float32", kv_cache_dtype="fp8")
    bf16 = texts(dtype="bfloat16")
    assert "Paris" in fp8_pool[0]
    kept_fp8 = sum(a == b for a, b in zip(fp8_pool, fp32))
    kept_bf16 = sum(a == b for a, b in zip(bf16, fp32))
    assert kept_fp8 >= max(kept_bf16, 4), (fp32, fp8_pool, bf16)
