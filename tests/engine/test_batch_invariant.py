"""--batch-invariant: a row's tokens do not depend on how the job is batched, chunked or cached; the
setting is recorded and part of an output's settings; models it does not cover are refused in one
line. (The GPU kernels' own invariance: tests/kernels/test_invariant_gemm.py, test_unified_attention.py
and tests/gpu/test_batch_invariant_gpu.py.)"""
import json

import pyarrow.parquet as pq
import pytest

from batchgen import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4], [5, 17, 33, 99, 60, 61, 62], [42] * 20,
           [9, 8, 7, 6, 5, 4, 3, 2, 1], [5, 17, 33, 99, 120, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


def tokens(llm, rows, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
    return [r["output_token_ids"] for r in llm.generate_list(rows, params)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_rows_tokens_do_not_depend_on_the_batch(tiny_model, temperature):
    rows = [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)]
    with LLM(str(tiny_model("llama")), batch_invariant=True) as llm:
        assert llm.describe()["batch_invariant"] is True
        together = tokens(llm, rows, temperature)
        alone = [tokens(llm, [row], temperature)[0] for row in rows]  # (the prefix cache holds the others)
    # two sequences at a time, prompts chunked 4 tokens a step, no prefix cache
    with LLM(str(tiny_model("llama")), batch_invariant=True, max_num_seqs=2, max_num_batched_tokens=4,
             enable_prefix_caching=False) as llm:
        squeezed = tokens(llm, rows, temperature)
    assert alone == together and squeezed == together


@pytest.mark.parametrize("kind,options,what", [
    ("qwen3-moe", {}, "mixture-of-experts"),
    ("llama", {"quantization": "fp8"}, "FP8"),
])
def test_models_it_does_not_cover_are_refused(tiny_model, kind, options, what):
    with pytest.raises(ValueError, match=f"--batch-invariant does not cover {what}"):
        LLM(str(tiny_model(kind)), batch_invariant=True, **options)


def test_the_cli_records_it_and_keeps_it_in_the_outputs_settings(tiny_model, batchgen, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"the quick brown fox {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out.parquet"
    model = tiny_model("llama")
    done = batchgen("run", src, out, "--model", model, "--batch-invariant", "--max-tokens", "4", "--log-every", "0")
    assert done.returncode == 0, done.stderr
    assert json.loads(pq.read_table(out).schema.metadata[b"batchgen"])["batch_invariant"] is True
    other = batchgen("run", src, out, "--model", model, "--max-tokens", "4", "--log-every", "0")
    assert other.returncode == 1 and "batch_invariant: true then" in other.stderr
    assert "--overwrite" in other.stderr and "Traceback" not in other.stderr

    moe = batchgen("run", src, tmp_path / "moe.parquet", "--model", tiny_model("qwen3-moe"), "--batch-invariant")
    assert moe.returncode != 0 and "--batch-invariant does not cover mixture-of-experts" in moe.stderr
    assert "Traceback" not in moe.stderr


def test_tensor_parallel_says_it_is_not_covered(tiny_model, caplog):
    with caplog.at_level("WARNING", logger="batchgen"):
        with LLM(str(tiny_model("llama")), batch_invariant=True, tensor_parallel_size=2) as llm:
            result = llm.generate_list([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))[0]
    assert result["error"] is None
    assert "--batch-invariant: the sums over --tensor-parallel-size 2 GPUs are not pinned" in caplog.text
