"""On a GPU, --batch-invariant (issue #47's probe): 64 requests give the same tokens alone, inside 1,024
others (where their prompts also come from the prefix cache), and at max_num_seqs=8, greedy and
sampled, for the llama-3.2-1b and qwen2.5-0.5b shapes (random weights from config.json alone); a job
killed mid-way and rerun gives the rows of an uninterrupted one."""
import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from benchmarks.throughput import MODELS, build_model
from tests.test_cli_run import batchgen, killed_after_first_part, read, texts, write_jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = ("llama-3.2-1b", "qwen2.5-0.5b")
PROBES, OTHERS, NEW_TOKENS = 64, 1024, 64


def config_only(name: str, root) -> str:
    """The benchmark shape's config.json and a tokenizer (weights: --load-format dummy)."""
    return str(build_model(name, root, weights=False))


def vocab(name: str) -> int:
    return MODELS[name][1]["vocab_size"]


def requests(count: int, vocab: int, seed: int, prefix: str) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"{prefix}{i}", "seed": rng.randrange(1 << 30),
             "prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(8, 900))]} for i in range(count)]


def by_id(results, rows) -> dict:
    return {row["id"]: r["output_token_ids"] for row, r in zip(rows, results)}


@pytest.mark.parametrize("name", SHAPES)
def test_probe_rows_are_the_same_alone_among_others_and_eight_at_a_time(name, tmp_path):
    model = config_only(name, tmp_path)
    probes, others = requests(PROBES, vocab(name), 1, "p"), requests(OTHERS, vocab(name), 2, "o")
    mixed = others[:]
    for i, row in enumerate(probes):  # the probes spread among the others
        mixed.insert(i * (OTHERS // PROBES) + i, row)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = {}  # (run, params) -> {id: tokens}
    for options, jobs in (({}, {"alone": probes, "among, prompts cached": mixed}),
                          ({"enable_prefix_caching": False}, {"among, prompts computed again": mixed}),
                          ({"max_num_seqs": 8}, {"eight at a time": probes})):
        with LLM(model, load_format="dummy", batch_invariant=True, **options) as llm:
            for label, rows in jobs.items():
                for params in (greedy, sampled):
                    runs[label, params.temperature] = by_id(llm.generate_list(rows, params), rows)
    for params in (greedy, sampled):
        alone = runs["alone", params.temperature]
        for label in ("among, prompts cached", "among, prompts computed again", "eight at a time"):
            same = sum(runs[label, params.temperature][r["id"]] == alone[r["id"]] for r in probes)
            assert same == PROBES, f"{name}, temperature {params.temperature}, {label}: {same} of {PROBES} identical"


def test_a_killed_and_rerun_job_gives_the_uninterrupted_rows(tmp_path):
    model = config_only("llama-3.2-1b", tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", requests(3000, vocab("llama-3.2-1b"), 3, "r"))
    options = ["--model", model, "--load-format", "dummy", "--batch-invariant", "--max-tokens", str(NEW_TOKENS),
               "--ignore-eos", "--temperature", "0.8", "--log-every", "0"]
    done = batchgen("run", src, tmp_path / "whole.parquet", *options)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out.parquet"
    saved = killed_after_first_part("run", src, out, *options)
    done = batchgen("run", src, out, *options)
    assert done.returncode == 0, done.stderr
    rows, meta = read(out)
    whole, _ = read(tmp_path / "whole.parquet")
    assert 0 < saved < len(rows) and meta["rows_resumed"] > 0
    assert texts(rows) == texts(whole)
