"""batchgen.ray.Generate on a local Ray (2 CPUs), with the embedded default model: the same greedy texts
and error rows as `batchgen run` on the same rows, in every batch format, on one actor or two, and
jobs/ray_job.py end to end. One Ray and one in-process stage are shared by the module (Ray starts slowly
on 2 cores); a handful of rows, 8 tokens each.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
from ray.data.block import BlockAccessor  # noqa: E402

from batchgen.cli import app  # noqa: E402
from batchgen.ray import Generate  # noqa: E402
from tests.test_generation_config import model_with  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# fp32: greedy texts of rows batched differently (Ray batches, actors) match `run`'s; in bf16 a different
# batch can round a near-tie the other way
SAMPLING = {"max_tokens": 8, "temperature": 0}
ENGINE = {"dtype": "float32", "max_num_seqs": 4}
RUN_OPTIONS = ["--max-tokens", "8", "--temperature", "0", "--dtype", "float32", "--max-num-seqs", "4"]

ROWS = [  # `tag` (carried through) names a row in every output: ids are generated where a row has none
    {"tag": "prompt", "id": 11, "prompt": "The capital of France is"},
    {"tag": "chat", "id": 12, "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"tag": "token_ids", "id": 13, "prompt_token_ids": [504, 3575, 282, 4649, 314]},
    {"tag": "stop", "id": 14, "prompt": "Count with me: one, two, three,", "stop": [" five"]},
    {"tag": "no_id", "id": None, "prompt": "Once upon a time"},
    {"tag": "two_samples", "id": 16, "prompt": "My favourite colour is", "n": 2},
    {"tag": "bad_temperature", "id": 17, "prompt": "Hello", "temperature": 500.0},
    {"tag": "no_prompt", "id": 18},
    {"tag": "bad_token_id", "id": 19, "prompt_token_ids": [10**9]},
]
SCHEMA = pa.schema([
    ("tag", pa.string()), ("id", pa.int64()), ("prompt", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("prompt_token_ids", pa.list_(pa.int64())), ("stop", pa.list_(pa.string())), ("n", pa.int64()),
    ("temperature", pa.float64()),
])
FORMATS = ["numpy", "pandas", "pyarrow"]


def environment() -> dict:
    """The environment of a script run here: this checkout first on the path."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def by_tag(rows: list[dict]) -> dict:
    """Each result's (tag, sample_index) -> what it says: its text, tokens, finish and error."""
    results = {}
    for r in rows:
        key = (r["tag"], r["sample_index"])
        assert key not in results, f"{key} twice"
        results[key] = (r["text"], list(r["output_token_ids"]), r["finish_reason"], r["error"])
    return results


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The rows as one Parquet file (for `run`) and as three (a Ray dataset of several blocks)."""
    tmp = tmp_path_factory.mktemp("ray")
    pq.write_table(table(ROWS), tmp / "all.parquet")
    (tmp / "parts").mkdir()
    for i in range(3):
        pq.write_table(table(ROWS[i::3]), tmp / "parts" / f"part-{i}.parquet")
    return tmp


@pytest.fixture(scope="module")
def expected(data) -> dict:
    """`batchgen run` on the rows, in this process."""
    with pytest.raises(SystemExit) as done:
        app(["run", str(data / "all.parquet"), str(data / "run.parquet"), *RUN_OPTIONS])
    assert done.value.code == 0
    results = by_tag(pq.read_table(data / "run.parquet").to_pylist())
    assert {key[0] for key, (_, _, finish, _) in results.items() if finish == "error"} == {
        "bad_temperature", "no_prompt", "bad_token_id"}
    assert ("two_samples", 1) in results
    return results


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def dataset(local_ray, data):
    """The rows as a Ray dataset, read once."""
    return ray.data.read_parquet(str(data / "all.parquet")).materialize()


@pytest.fixture(scope="module")
def stage():
    """One Generate in this process, as an actor holds it; `stage.pulled` records the ids of the
    requests its engine takes and of the results it gives, in order; `stage.break_device` set makes
    the engine raise (as for a device error) at the next request it takes."""
    generate = Generate(sampling=SAMPLING, **ENGINE)
    generate.pulled = []
    generate.break_device = False
    real = generate.llm.generate

    def recording(requests, *args, **kwargs):
        def taken():
            for request in requests:
                if request is not None:
                    generate.pulled.append(("in", request["id"]))
                    if generate.break_device:
                        generate.break_device = False
                        raise RuntimeError("CUDA error: an illegal memory access was encountered")
                yield request
        for result in real(taken(), *args, **kwargs):
            generate.pulled.append(("out", result["id"]))
            yield result

    generate.llm.generate = recording  # (before the first batch starts the engine thread)
    yield generate
    generate.close()


@pytest.mark.parametrize("batch_format", FORMATS)
def test_every_batch_format_gives_runs_results_in_its_own_format(dataset, expected, stage, batch_format):
    batch = dataset.take_batch(len(ROWS), batch_format=batch_format)  # as map_batches would hand it over
    out = asyncio.run(stage(batch))
    assert type(out) is type(batch)
    result = BlockAccessor.batch_to_block(out)  # what Ray makes of it
    assert by_tag(result.to_pylist()) == expected
    assert result.column_names[:len(SCHEMA)] == ["id", *[n for n in SCHEMA.names if n != "id"]]
    assert pa.types.is_integer(result.schema.field("id").type)
    for name in ("messages", "prompt_token_ids", "stop"):  # (not Ray's tensor type for numpy's arrays)
        assert pa.types.is_list(result.schema.field(name).type), result.schema
    assert result.schema.field("output_token_ids").type.value_type in (pa.int32(), pa.int64())
    ids = result.column("id").to_pylist()
    assert ids[:4] == [11, 12, 13, 14]
    assert ids[4] not in {r["id"] for r in ROWS}  # the row without an id got one


def test_numpy_batches_give_list_columns_back_as_lists(local_ray, stage):
    # Ray hands a list column over as numpy arrays, and would make its tensor type of them again: a
    # batch of one-length lists would not concatenate with a batch of nulls
    ds = ray.data.from_arrow(pa.table({"prompt_token_ids": [[504, 3575, 282], [4649, 314, 504]]}))
    out = BlockAccessor.batch_to_block(asyncio.run(stage(ds.take_batch(2))))
    assert out.schema.field("prompt_token_ids").type == pa.list_(pa.int64())
    assert out.column("prompt_token_ids").to_pylist() == [[504, 3575, 282], [4649, 314, 504]]


def test_a_batch_that_has_no_ids_gets_ids_of_this_actor(stage):
    out = asyncio.run(stage(pa.table({"prompt": ["Hello", "Hi"]})))
    first, second = out.column("id").to_pylist()
    assert re.fullmatch(r"[0-9a-f]{32}-\d+", first) and re.fullmatch(r"[0-9a-f]{32}-\d+", second)
    assert first.split("-")[0] == second.split("-")[0] and first != second
    assert out.column("finish_reason").to_pylist() == ["length", "length"]


def test_the_next_batch_joins_the_engine_while_the_current_one_finishes(stage, expected):
    first = table([{**r, "id": 100 + i} for i, r in enumerate(ROWS[:4])])
    second = table([{**r, "id": 200 + i} for i, r in enumerate(ROWS[:4])])
    stage.pulled.clear()

    async def both():
        return await asyncio.gather(stage(first), stage(second))

    out_first, out_second = asyncio.run(both())
    taken = [i for i, (what, row_id) in enumerate(stage.pulled) if what == "in" and row_id >= 200]
    finished = [i for i, (what, row_id) in enumerate(stage.pulled) if what == "out" and row_id < 200]
    assert taken and finished and min(taken) < max(finished), stage.pulled
    want = {key: value for key, value in expected.items() if key[0] in {r["tag"] for r in ROWS[:4]}}
    assert by_tag(out_first.to_pylist()) == want == by_tag(out_second.to_pylist())


def test_an_engine_failure_fails_its_batches_and_the_next_batch_runs(stage, expected):
    stage.break_device = True
    with pytest.raises(RuntimeError, match="illegal memory access"):
        asyncio.run(stage(table(ROWS[:2])))
    out = asyncio.run(stage(table(ROWS[:2])))
    assert by_tag(out.to_pylist()) == {key: value for key, value in expected.items() if key[0] in ("prompt", "chat")}


def test_ray_job_script_on_two_actors_gives_runs_results(local_ray, data, expected):
    """jobs/ray_job.py joins the running Ray; its two actors give what `run` (and one actor, above) gives."""
    address = local_ray.get_runtime_context().gcs_address
    out = data / "job-out"
    done = subprocess.run(
        [sys.executable, "jobs/ray_job.py", str(data / "parts"), str(out), "--address", address,
         "--actors", "2", "--batch-size", "2", "--num-cpus", "0.5", "--max-tokens", "8", "--temperature", "0",
         "--dtype", "float32", "--max-num-seqs", "4"],
        cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert by_tag(pq.read_table(out).to_pylist()) == expected


def test_ray_job_script_refuses_a_bad_option_with_a_usage_error(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ray_job", REPO / "jobs" / "ray_job.py")
    ray_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ray_job)
    assert ray_job.main([str(tmp_path), str(tmp_path / "out"), "--dtype", "float8"]) == 2
    assert "invalid --dtype: 'float8'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sampling_options_are_resolved_as_runs_are(tiny_model, tmp_path):
    # a given option takes the place of the model's value before it is checked, as in `run`
    model = model_with(tiny_model, tmp_path / "model", top_p=0, max_new_tokens=3)
    generate = Generate(model=str(model), sampling={"top_p": 0.5, "temperature": 0})
    try:
        assert (generate.sampling.top_p, generate.sampling.max_tokens, generate.sampling.temperature) == (0.5, 3, 0.0)
    finally:
        generate.close()
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0 \(from the model's generation_config"):
        Generate(model=str(model))
