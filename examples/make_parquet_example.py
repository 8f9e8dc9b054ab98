"""Writes examples/prompts.parquet: 8 plain-text prompts with an integer id, a per-row max_tokens on
some rows, and two columns that are carried through to the output (`source`, `tags`).

    .venv/bin/python examples/make_parquet_example.py
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PROMPTS = [
    "The capital of France is",
    "A recipe for pancakes needs flour, eggs and",
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
    "The quickest way to learn to type is",
    "Water boils at",
    "def add(a, b):\n    return",
    "The planets of the solar system, in order, are",
]

table = pa.table(
    {
        "id": pa.array(range(100, 100 + len(PROMPTS)), pa.int64()),
        "prompt": PROMPTS,
        "max_tokens": pa.array([None, 8, None, 12, None, 6, 10, None], pa.int64()),
        "source": ["example"] * len(PROMPTS),
        "tags": pa.array([["geo"], ["food"], ["art"], ["story"], [], ["science"], ["code"], ["science"]]),
    }
)
pq.write_table(table, Path(__file__).with_name("prompts.parquet"))
