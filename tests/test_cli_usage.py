"""`batchgen` usage: help, bad options (one line, exit 2), `batchgen models`. No generation here."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "prompts.jsonl"


def test_help_lists_the_options_and_their_environment_variables(batchgen):
    done = batchgen("run", "--help", env={"COLUMNS": "200"})
    assert done.returncode == 0
    for text in ("--model", "--dtype", "--device", "-tp", "--tensor-parallel-size", "--max-num-seqs",
                 "--max-num-batched-tokens", "--gpu-memory-utilization", "--max-model-len", "--kv-cache-tokens",
                 "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--shard", "--resume",
                 "--no-resume", "--strict", "BATCHGEN_MAX_TOKENS", "BATCHGEN_TENSOR_PARALLEL_SIZE", "--n",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--kv-cache-dtype"):
        assert text in done.stdout, text
    top = batchgen("--help")
    assert top.returncode == 0 and "run" in top.stdout and "models" in top.stdout


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["--temperature", "warm"], {}, "--temperature"),
        (["--shard", "4/4"], {}, "--shard"),
        (["--shard", "half"], {}, "I/N"),
        (["--dtype", "float8"], {}, "--dtype"),
        (["--device", "tpu"], {}, "--device"),
        (["--kv-cache-dtype", "int4"], {}, "--kv-cache-dtype"),
        (["--bogus"], {}, "No such option: --bogus"),
        (["--top-p", "0"], {}, "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], {}, "max_tokens must be >= 1"),
        (["--n", "0"], {}, "n must be in [1, 1024]"),
        (["--min-p", "2"], {}, "min_p must be in [0, 1], got 2.0"),
        (["--presence-penalty", "-3"], {}, "presence_penalty must be in [-2, 2], got -3.0"),
        ([], {"BATCHGEN_REPETITION_PENALTY": "0"}, "repetition_penalty must be in (0, 2], got 0.0"),
        (["--max-num-seqs", "0"], {}, "--max-num-seqs"),
        (["--max-model-len", "100000"], {}, "100000 is past the model's context length (8192"),
        (["--kv-cache-tokens", "1000000000"], {}, "invalid --kv-cache-tokens: 1000000000 tokens of KV cache need"),
        (["--max-num-seqs", "100000000"], {}, "invalid --max-num-seqs: 100000000 sequences of up to 8192 tokens"),
        (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization"),
        ([], {"BATCHGEN_MAX_TOKENS": "lots"}, "BATCHGEN_MAX_TOKENS"),
        (["-tp", "2"], {}, "--tensor-parallel-size"),
        (["--structured-outputs", "{regex"], {}, "--structured-outputs is not valid JSON"),
        (["--response-format", '{"type": "xml"}'], {}, "--response-format.type must be text"),
        (["--structured-outputs", '{"regex": "a"}', "--response-format", '{"type": "json_object"}'], {},
         "both --response-format and --structured-outputs"),
    ],
)
def test_bad_options_are_one_line_usage_errors(batchgen, tmp_path, args, env, fragment):
    done = batchgen("run", EXAMPLE, tmp_path / "out.parquet", *args, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgen: error:") and fragment in lines[0], done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written: no output, no work directory


@pytest.mark.parametrize("name, fragment", [("missing.jsonl", "is not a file"),
                                            ("prompts.csv", "*.jsonl or *.parquet")])
def test_bad_inputs_are_usage_errors(batchgen, tmp_path, name, fragment):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("prompt\nhi\n")
    done = batchgen("run", tmp_path / name, tmp_path / "out.parquet")
    assert done.returncode == 2 and fragment in done.stderr


@pytest.mark.parametrize("args, name", [(["run", EXAMPLE, ""], "OUTPUT"), (["run", "", "out.parquet"], "INPUT"),
                                        (["run", EXAMPLE, "out.jsonl", "--error-file", ""], "--error-file"),
                                        (["submit", "", "--job", "j"], "INPUT"),
                                        (["collect", "", "--job", "j"], "OUTPUT")])
def test_an_empty_file_name_is_a_usage_error_naming_the_argument(batchgen, tmp_path, monkeypatch, args, name):
    """Not reported as '.', the folder pathlib reads an empty name as."""
    monkeypatch.chdir(tmp_path)
    done = batchgen(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"Invalid value for '{name}'" in lines[0] and "is empty; give a file name" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_output_may_not_overwrite_the_input(batchgen):
    done = batchgen("run", EXAMPLE, EXAMPLE)
    assert done.returncode == 2 and "OUTPUT would overwrite INPUT" in done.stderr


def test_unreadable_parquet_is_a_one_line_failure(batchgen, tmp_path):
    (tmp_path / "in.parquet").write_bytes(b"PAR1 but not really")
    done = batchgen("run", tmp_path / "in.parquet", tmp_path / "out.parquet")
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0
    assert "not a readable Parquet file" in done.stderr


def test_models_names_the_default_model_and_its_cache(batchgen, tmp_path):
    done = batchgen("models", env={"BATCHGEN_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert "SmolLM2-135M-Instruct" in done.stdout and str(tmp_path / "cache") in done.stdout
    assert "not converted yet" in done.stdout and "temperature 0.2, top_p 0.9" in done.stdout


def test_bench_passes_its_arguments_to_the_benchmark_script(batchgen):
    done = batchgen("bench", "--help")
    assert done.returncode == 0
    assert "usage: throughput.py" in done.stdout and "--workload" in done.stdout
    done = batchgen("bench", "--workload", "W-nothing")
    assert done.returncode == 2 and "invalid choice" in done.stderr
