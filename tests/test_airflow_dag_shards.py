"""jobs/airflow_dag.py's shard tasks, without Airflow: their bash scripts run as BashOperator would
run them (bash, the DAG's settings in the environment), on a tiny model. Readers of the output folder
(`pq.read_table(OUTPUT_DIR)`) see finished shards only; a retried task does nothing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
ROWS = 24


def load_dag(monkeypatch, bash_operator=None) -> types.ModuleType:
    """The DAG file, imported against a stand-in of the Airflow API it uses (Airflow is not installed);
    bash_operator: a stand-in of BashOperator that records what the DAG gives it (default: one that
    records nothing)."""

    class DAG:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class BashOperator:
        partial = staticmethod(lambda **kwargs: types.SimpleNamespace(expand=lambda **expanded: None))

    for name in ("airflow", "airflow.providers", "airflow.providers.standard", "airflow.providers.standard.operators"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "airflow.sdk", types.SimpleNamespace(DAG=DAG))
    monkeypatch.setitem(sys.modules, "airflow.providers.standard.operators.bash",
                        types.SimpleNamespace(BashOperator=bash_operator or BashOperator))
    spec = importlib.util.spec_from_file_location("batchgen_dag", REPO / "jobs" / "airflow_dag.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def visible(folder: Path) -> list[str]:
    """What a reader of the folder takes: names that do not begin with `_` or `.`."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(("_", ".")))


def test_a_shard_appears_in_the_output_folder_only_when_finished(monkeypatch, tiny_model, tmp_path):
    dag = load_dag(monkeypatch)
    src = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(ROWS)],
                             "prompt": [f"the quick fox {i}" for i in range(ROWS)]}), src)
    folder = tmp_path / "generations" / "2026-01-01"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    env.update(dag.SETTINGS, BATCHGEN_MODEL=str(tiny_model("llama")), BATCHGEN_MAX_TOKENS="16",
               BATCHGEN_IGNORE_EOS="true", BATCHGEN_MAX_NUM_SEQS="2", BATCHGEN_FLUSH_ROWS="1")
    # the hosts' paths, as a user sets them in the DAG file
    monkeypatch.setattr(dag, "BATCHGEN", f"{sys.executable} -m batchgen.cli")
    monkeypatch.setattr(dag, "INPUT", str(src))
    monkeypatch.setattr(dag, "OUTPUT_DIR", str(folder))

    def task(index: int) -> subprocess.Popen:
        script = dag.shard_command(index, 2)
        return subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    first = task(0)
    deadline = time.monotonic() + 300
    while not list(folder.rglob("part-*.parquet")):  # a row of shard 0 is saved: the shard is unfinished
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline, "no row saved in time"
        time.sleep(0.02)
    assert visible(folder) == []
    assert pq.read_table(folder).num_rows == 0
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, output

    shard = folder / "shard-000-of-002.parquet"
    assert visible(folder) == [shard.name] and pq.read_table(shard).num_rows == ROWS // 2
    assert [p.name for p in folder.iterdir()] == [shard.name]  # (no work directory left behind)
    finished_at = shard.stat().st_mtime_ns
    retried = task(0)  # a retry, or a task cleared after it succeeded
    output, _ = retried.communicate(timeout=300)
    assert retried.returncode == 0 and "nothing to do" in output, output
    assert shard.stat().st_mtime_ns == finished_at

    second = task(1)
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output
    assert visible(folder) == ["shard-000-of-002.parquet", "shard-001-of-002.parquet"]
    assert sorted(pq.read_table(folder).column("id").to_pylist()) == sorted(f"r{i}" for i in range(ROWS))
