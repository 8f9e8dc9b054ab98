"""--load-format dummy: random weights from config.json alone (no *.safetensors), the same for a seed,
for dense and MoE models and FP8 checkpoints' configs; a directory without config.json is one clear usage
error."""
import json
import shutil

import pyarrow.parquet as pq
import pytest

from batchgen import LLM, SamplingParams


def config_and_tokenizer_only(model_dir, dest):
    """A copy of model_dir without its weights."""
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return dest


def test_batchgen_run_on_config_and_tokenizer_alone(tiny_model, batchgen, tmp_path):
    model = config_and_tokenizer_only(tiny_model("qwen3-moe"), tmp_path / "no-weights")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"the quick brown fox {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out.parquet"
    done = batchgen("run", src, out, "--model", model, "--load-format", "dummy", "--max-tokens", "5",
                    "--ignore-eos", "--log-every", "0")
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out)
    rows = table.to_pylist()
    assert [r["completion_tokens"] for r in rows] == [5, 5, 5] and all(r["error"] is None for r in rows)
    assert json.loads(table.schema.metadata[b"batchgen"])["load_format"] == "dummy"

    plain = batchgen("run", src, tmp_path / "plain.parquet", "--model", model, "--max-tokens", "5")
    assert plain.returncode != 0 and "no *.safetensors" in plain.stderr  # without the option: the weights


def test_a_directory_without_config_json_is_a_usage_error(batchgen, tmp_path):
    (tmp_path / "model").mkdir()
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    done = batchgen("run", src, tmp_path / "out.parquet", "--model", tmp_path / "model", "--load-format", "dummy")
    assert done.returncode == 2
    assert "the directory has no config.json" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_dummy_weights_are_the_same_for_a_seed(kind, tiny_model, tmp_path):
    model = str(config_and_tokenizer_only(tiny_model(kind), tmp_path / "m"))
    rows = [{"prompt_token_ids": [5, 17, 33, 99, 120]}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def weights_and_tokens(seed):
        llm = LLM(model, dtype="float32", load_format="dummy", seed=seed)
        weights = llm.engine.runner.model.embed_tokens.weight.clone()
        assert 0.01 < float(weights.std()) < 0.03  # normal * 0.02
        return weights, llm.generate_list(rows, greedy)[0]["output_token_ids"]

    weights, tokens = weights_and_tokens(0)
    again, tokens_again = weights_and_tokens(0)
    assert len(tokens) == 6 and tokens_again == tokens and bool((again == weights).all())
    other, _ = weights_and_tokens(1)
    assert not bool((other == weights).all())


def test_a_bad_load_format_is_refused():
    with pytest.raises(ValueError, match="invalid --load-format: 'pt'; choose one of auto, dummy"):
        LLM(load_format="pt")


def test_dummy_weights_under_tensor_parallelism(tiny_model, tmp_path):
    """Each tensor-parallel worker makes its own dummy shards (no rank looks for *.safetensors)."""
    model = str(config_and_tokenizer_only(tiny_model("qwen2-moe"), tmp_path / "m"))
    llm = LLM(model, dtype="float32", device="cpu", load_format="dummy", tensor_parallel_size=2)
    try:
        rows = [{"prompt_token_ids": list(range(1, n))} for n in (3, 20, 41)]
        results = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        llm.close()
    assert [r["completion_tokens"] for r in results] == [4, 4, 4] and all(r["error"] is None for r in results)


@pytest.mark.parametrize("form", ["block", "tensor-static", "moe-channel"])
def test_dummy_weights_of_an_fp8_checkpoints_config(form, tmp_path):
    """An FP8 checkpoint's config.json with --load-format dummy (Qwen3-30B-A3B-FP8 benchmarked without its
    weights): e4m3 weights whose dequantized spread is the bf16 dummies', and a job that runs."""
    import torch

    from tests.fp8_checkpoints import build_base, write, write_moe
    from tests.tiny_models import build

    if form == "moe-channel":
        path = write_moe("channel-dynamic", build("qwen3-moe-blocks", tmp_path / "base"), tmp_path / "q",
                         tmp_path / "dequantized")
    else:
        path = write(form, build_base(tmp_path / "base"), tmp_path / "q")
    model = str(config_and_tokenizer_only(path, tmp_path / "m"))
    with LLM(model, dtype="float32", device="cpu", load_format="dummy") as llm:
        layer = llm.engine.runner.model.layers[0]
        assert layer.self_attn.qkv_proj.fp8 is not None
        if form == "moe-channel":  # (on a CPU the experts are dequantized at load: normal * 0.02)
            assert 0.01 < float(layer.mlp.experts.w13.std()) < 0.03
        rows = [{"prompt_token_ids": [5, 17, 33, 99, 120], "prompt_logprobs": True}]
        result = llm.generate_list(rows, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert result["error"] is None and result["completion_tokens"] == 4
    assert all(torch.isfinite(torch.tensor(result["prompt_logprobs"])))
