"""`batchgen run` with --n and the prefix cache on a tiny model, in process: one output row per
sample, the reuse in the file's metadata."""
from __future__ import annotations

import json

import pyarrow.parquet as pq


def test_run_writes_every_sample_and_the_cache_totals(batchgen, tiny_model, tmp_path):
    system = list(range(10, 60))  # 50 tokens in front of every row
    rows = [{"id": f"r{i}", "prompt_token_ids": system + [100 + i] * (i + 1)} for i in range(4)]
    rows[3]["n"] = 1  # a row's n overrides --n
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    args = ["run", src, out, "--model", tiny_model("llama"), "--dtype", "float32", "--n", "3", "--max-tokens", "4",
            "--ignore-eos", "--log-every", "0"]
    done = batchgen(*args)
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out)
    got = sorted((r["id"], r["sample_index"]) for r in table.to_pylist())
    assert got == [(f"r{i}", s) for i in range(3) for s in range(3)] + [("r3", 0)]
    meta = json.loads(table.schema.metadata[b"batchgen"])
    cached = sum(table.column("cached_prompt_tokens").to_pylist())
    assert meta["cached_prompt_tokens"] == cached >= 3 * 50  # the shared 50 tokens, computed once
    assert meta["prefix_cache_hit_rate"] == round(cached / meta["prompt_tokens"], 4)
    assert meta["rows"] == 10 and meta["enable_prefix_caching"] is True
    again = batchgen(*args)
    assert again.returncode == 0 and "already complete" in again.stdout
