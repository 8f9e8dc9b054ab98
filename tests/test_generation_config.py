"""Sampling defaults from the model's generation_config.json: read, overridden by the job's options
and by the rows' own fields, recorded in the output and the summary; the default model's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams
from batchgen.models import default_model
from batchgen.models.generation_config import GENERATION_CONFIG, read_sampling_defaults
from batchgen.sampling_params import resolve_defaults
from tests.test_cli_run import read as read_output
from tests.test_cli_run import write_jsonl

REPO = Path(__file__).resolve().parents[1]


def model_with(tiny_model, path: Path, **fields) -> Path:
    """A copy of the tiny llama whose generation_config.json also holds `fields`."""
    model = Path(shutil.copytree(tiny_model("llama"), path))
    config = json.loads((model / GENERATION_CONFIG).read_text())
    (model / GENERATION_CONFIG).write_text(json.dumps({**config, **fields}))
    return model


def read(path: Path) -> tuple[dict, dict]:
    """-> ({id: output row}, the output's batchgen metadata)"""
    rows, meta = read_output(path)
    return {r["id"]: r for r in rows}, meta


def test_the_fields_batchgen_has_are_read_under_its_names(tmp_path):
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "do_sample": True,
        "repetition_penalty": 1.1, "max_length": 4096, "eos_token_id": [2, 7],
    }))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64,
                                                "repetition_penalty": 1.1}
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps({"temperature": None, "top_k": 40.0, "bos_token_id": 1}))
    assert read_sampling_defaults(tmp_path) == {"top_k": 40}
    (tmp_path / GENERATION_CONFIG).unlink()
    assert read_sampling_defaults(tmp_path) == {}


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "not readable as JSON"),
    ("[0.7]", "not a JSON object"),
    ('{"top_k": "many"}', "top_k must be an integer"),
    ('{"temperature": true}', "temperature must be a number"),
])
def test_a_bad_file_is_one_line_naming_it_and_the_field(tmp_path, text, fragment):
    (tmp_path / GENERATION_CONFIG).write_text(text)
    with pytest.raises(ValueError) as error:
        read_sampling_defaults(tmp_path)
    message = str(error.value)
    assert fragment in message and GENERATION_CONFIG in message and "\n" not in message


def test_an_option_beats_the_model_which_beats_the_built_in():
    given = {"max_tokens": None, "temperature": 0.0, "top_p": None, "top_k": None, "stop": ["\n"]}
    params, sources = resolve_defaults(given, {"temperature": 0.7, "top_p": 0.8, "max_tokens": 32})
    assert ((params.temperature, params.top_p, params.max_tokens, params.top_k, params.stop)
            == (0.0, 0.8, 32, -1, ["\n"]))
    assert sources == {"max_tokens": "generation_config", "temperature": "option", "top_p": "generation_config",
                       "top_k": "built-in", "min_p": "built-in", "repetition_penalty": "built-in", "stop": "option"}
    params, sources = resolve_defaults({}, {})
    assert params == SamplingParams() and set(sources.values()) == {"built-in"}
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\].*generation_config.json"):
        resolve_defaults({}, {"top_p": 0.0})
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0$"):
        resolve_defaults({"top_p": 0.0}, {"top_p": 0.5})  # the option's value is the bad one


def test_the_api_takes_the_models_defaults_unless_given_sampling_params(tiny_model, tmp_path):
    model = model_with(tiny_model, tmp_path / "model", max_new_tokens=3, temperature=0.0)
    llm = LLM(str(model), dtype="float32", max_num_seqs=4)
    defaults = llm.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p) == (3, 0.0, 1.0)
    defaults.max_tokens = 9  # a copy: the LLM's own defaults stay
    assert llm.get_default_sampling_params().max_tokens == 3
    requests = [{"id": "model's", "prompt": "the quick brown fox", "ignore_eos": True},
                {"id": "row's", "prompt": "the quick brown fox", "ignore_eos": True, "max_tokens": 5}]
    lengths = {r["id"]: r["completion_tokens"] for r in llm.generate(requests)}
    assert lengths == {"model's": 3, "row's": 5}
    lengths = {r["id"]: r["completion_tokens"] for r in llm.generate(requests, SamplingParams(max_tokens=2))}
    assert lengths == {"model's": 2, "row's": 5}  # explicit SamplingParams: the built-ins and what it sets
    assert llm.describe()["generation_config"] == "auto"
    ignoring = LLM(str(model), dtype="float32", max_num_seqs=4, generation_config="none")
    assert ignoring.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="--generation-config"):
        LLM(str(model), generation_config="vllm")


def test_the_job_takes_the_models_defaults_under_its_options_and_rows(batchgen, tiny_model, tmp_path):
    model = model_with(tiny_model, tmp_path / "model", max_new_tokens=3, temperature=0.0, top_k=7)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello world"},
                                              {"id": "b", "prompt": "hello world", "max_tokens": 5}])
    common = ("--model", model, "--dtype", "float32", "--ignore-eos", "--log-every", "0")

    done = batchgen("run", src, tmp_path / "auto.parquet", *common, "--top-k", "0")
    assert done.returncode == 0, done.stderr
    rows, meta = read(tmp_path / "auto.parquet")
    assert {i: r["completion_tokens"] for i, r in rows.items()} == {"a": 3, "b": 5}
    assert meta["sampling_defaults"] == {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                         "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": True}
    assert meta["sampling_defaults_from"] == {"max_tokens": "generation_config", "temperature": "generation_config",
                                              "top_p": "built-in", "top_k": "option", "min_p": "built-in",
                                              "repetition_penalty": "built-in", "ignore_eos": "option"}
    assert meta["generation_config"] == meta["fingerprint"]["generation_config"] == "auto"
    assert "max_tokens 3, temperature 0.0 from the model's generation_config.json" in done.stdout

    done = batchgen("run", src, tmp_path / "option.parquet", *common, "--max-tokens", "2")
    rows, meta = read(tmp_path / "option.parquet")
    assert {i: r["completion_tokens"] for i, r in rows.items()} == {"a": 2, "b": 5}
    assert meta["sampling_defaults"]["top_k"] == 7 and meta["sampling_defaults_from"]["max_tokens"] == "option"

    done = batchgen("run", src, tmp_path / "none.parquet", *common, "--max-tokens", "4",
                    env={"BATCHGEN_GENERATION_CONFIG": "none"})
    assert done.returncode == 0, done.stderr
    rows, meta = read(tmp_path / "none.parquet")
    assert {i: r["completion_tokens"] for i, r in rows.items()} == {"a": 4, "b": 5}
    assert (meta["sampling_defaults"]["temperature"], meta["sampling_defaults"]["top_k"]) == (1.0, -1)
    assert meta["sampling_defaults_from"]["temperature"] == "built-in" and meta["generation_config"] == "none"


def test_a_changed_generation_config_is_a_changed_job(batchgen, tiny_model, tmp_path):
    model = model_with(tiny_model, tmp_path / "model", max_new_tokens=3)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello world"}])
    args = ("run", src, tmp_path / "out.parquet", "--model", model, "--ignore-eos", "--log-every", "0")
    assert batchgen(*args).returncode == 0
    assert "already complete" in batchgen(*args).stdout
    (model / GENERATION_CONFIG).write_text(json.dumps({"max_new_tokens": 4}))
    refused = batchgen(*args)  # another job's finished OUTPUT: replaced only with --overwrite
    assert refused.returncode == 1 and "max_tokens: 3 then, 4 now" in refused.stderr, refused.stderr
    again = batchgen(*args, "--overwrite")
    assert again.returncode == 0 and "already complete" not in again.stdout
    assert read(tmp_path / "out.parquet")[0]["a"]["completion_tokens"] == 4


@pytest.mark.parametrize("fields, args, fragment", [
    ({"top_p": 0}, [], "top_p must be in (0, 1], got 0.0 (from the model's generation_config.json); "
                       "--generation-config none"),
    ({"top_k": "many"}, [], "top_k must be an integer"),
    ({}, ["--generation-config", "vllm"], "--generation-config"),
])
def test_bad_model_defaults_are_one_line_usage_errors(batchgen, tiny_model, tmp_path, fields, args, fragment):
    model = model_with(tiny_model, tmp_path / "model", **fields)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    done = batchgen("run", src, tmp_path / "out.parquet", "--model", model, *args)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and fragment in done.stderr, done.stderr
    assert batchgen("run", src, tmp_path / "out.parquet", "--model", model, "--top-p", "0.5", "--top-k", "3",
                    "--generation-config", "none", "--max-tokens", "2").returncode == 0


def test_the_default_model_gets_its_sampling_defaults_once(tmp_path, monkeypatch):
    """Also in a cache converted by a batchgen that did not write them; a value the user set stays."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    converted = default_model.default_model_dir()
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    (converted / GENERATION_CONFIG).write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert default_model.ensure_default_model() == converted
    config = json.loads((converted / GENERATION_CONFIG).read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": 2, **default_model.SAMPLING_DEFAULTS}
    assert read_sampling_defaults(converted) == default_model.SAMPLING_DEFAULTS
    (converted / GENERATION_CONFIG).unlink()
    default_model.ensure_default_model()
    assert json.loads((converted / GENERATION_CONFIG).read_text()) == default_model.SAMPLING_DEFAULTS
    (converted / GENERATION_CONFIG).write_text(json.dumps({"temperature": 0.5}))
    default_model.ensure_default_model()
    assert json.loads((converted / GENERATION_CONFIG).read_text()) == {"temperature": 0.5}
    assert [p.name for p in converted.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@pytest.mark.slow
def test_the_default_job_answers_factual_questions(batchgen, tmp_path):
    """The README's first command, on three of its prompts: the default model's own sampling defaults
    give answers, where batchgen's built-in temperature 1.0 gave noise. Three that the 135M model answers
    at its defaults whatever the seed (30 of 30 seeds each; "the capital of France" only 19 of 30: its
    other answers begin "L'Étoile", so that row's text depends on the draw)."""
    examples = {json.loads(line)["id"]: json.loads(line) for line in (REPO / "examples" / "prompts.jsonl").open()}
    expected = {"q003": "Everest", "q004": "Japan", "q006": "South America"}
    src = write_jsonl(tmp_path / "in.jsonl", [examples[i] for i in expected])
    done = batchgen("run", src, tmp_path / "out.parquet", "--log-every", "0")
    assert done.returncode == 0, done.stderr
    rows, meta = read(tmp_path / "out.parquet")
    for id_, word in expected.items():
        assert word in rows[id_]["text"], (id_, rows[id_]["text"])
    assert meta["sampling_defaults"]["temperature"] == default_model.SAMPLING_DEFAULTS["temperature"]
    assert meta["sampling_defaults_from"]["temperature"] == "generation_config"
