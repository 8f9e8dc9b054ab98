"""benchmarks/throughput.py's HF continuous-batching baseline on a CPU: every request generates exactly its
max_tokens, counted from the results, even on a model whose every token is an end-of-sequence token."""
import json
import shutil

from benchmarks.throughput import run_hf_continuous
from tests.tiny_models import VOCAB


def test_hf_continuous_generates_each_requests_max_tokens(tiny_model, tmp_path):
    model_dir = tmp_path / "all-eos"
    shutil.copytree(tiny_model("llama"), model_dir)
    for name in ("config.json", "generation_config.json"):  # a request that heeded EOS would end after one token
        config = json.loads((model_dir / name).read_text())
        (model_dir / name).write_text(json.dumps({**config, "eos_token_id": list(range(VOCAB))}))
    requests = [
        {"id": 0, "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 3},
        {"id": 1, "prompt_token_ids": list(range(10, 40)), "max_tokens": 17},
        {"id": 2, "prompt_token_ids": [9] * 11, "max_tokens": 40},
    ]

    result = run_hf_continuous(model_dir, requests, warm_up_requests=1)

    assert set(result) == {"tok_s", "wall_s", "output_tokens", "requests", "attention"}
    assert result["output_tokens"] == 3 + 17 + 40
    assert result["requests"] == 3
    assert result["wall_s"] > 0 and result["tok_s"] == result["output_tokens"] / result["wall_s"]
    assert "sdpa" in result["attention"]  # the manager's CPU choice: paged sdpa (transformers 5.17) or sdpa (5.24)
