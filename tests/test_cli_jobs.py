"""jobs/: the cron wrapper, the Airflow DAG and the example job config."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from pathlib import Path

import typer

from batchgen.cli import app
from tests.test_airflow_dag_shards import load_dag

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"


def run_options_envvars() -> set[str]:
    command = typer.main.get_command(app).commands["run"]
    names = set()
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


def test_every_run_option_reads_an_environment_variable():
    command = typer.main.get_command(app).commands["run"]
    for param in command.params:
        if param.param_type_name == "option" and param.name != "help":
            assert param.envvar == "BATCHGEN_" + param.name.upper(), param.name


def test_example_config_sets_only_real_options():
    text = (JOBS / "example.env").read_text()
    names = set(re.findall(r"^#?\s*(BATCHGEN_[A-Z_]+)=", text, re.M)) - {"BATCHGEN_BIN"}
    assert names and names <= run_options_envvars()


def fake_batchgen(tmp_path: Path, rc: int) -> Path:
    fake = tmp_path / "fake-batchgen"
    fake.write_text(f'#!/usr/bin/env bash\necho "args: $*"\necho "max_tokens=$BATCHGEN_MAX_TOKENS"\nexit {rc}\n')
    fake.chmod(0o755)
    return fake


def write_config(tmp_path: Path, rc: int) -> Path:
    config = tmp_path / "job.env"
    config.write_text(
        f"JOB_INPUT={tmp_path}/in-$(echo day).jsonl\nJOB_OUTPUT={tmp_path}/out/result.parquet\n"
        f"JOB_LOG={tmp_path}/logs/job.log\nBATCHGEN_BIN={fake_batchgen(tmp_path, rc)}\nBATCHGEN_MAX_TOKENS=7\n"
    )
    return config


def cron(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(JOBS / "cron.sh"), str(config)], capture_output=True, text=True, timeout=60)


def test_cron_runs_the_job_logs_it_and_passes_the_exit_code_on(tmp_path):
    for rc in (0, 75, 65):
        done = cron(write_config(tmp_path, rc))
        assert done.returncode == rc
    log = (tmp_path / "logs" / "job.log").read_text()
    assert f"args: run {tmp_path}/in-day.jsonl {tmp_path}/out/result.parquet" in log
    assert "max_tokens=7" in log
    assert "exit 0 (done)" in log and "exit 75 (interrupted; the next run resumes)" in log
    assert "exit 65 (done, but some rows failed (--strict))" in log


def test_cron_skips_while_the_previous_run_holds_the_lock(tmp_path):
    config = write_config(tmp_path, 0)
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / "result.parquet.cron.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = cron(config)
    assert done.returncode == 0
    log = (tmp_path / "logs" / "job.log").read_text()
    assert "still going" in log and "args:" not in log


def test_airflow_dag_maps_one_task_per_shard(monkeypatch):
    """Imports the DAG file against a stand-in of the Airflow API it uses (Airflow is not installed here)."""
    expanded = {}

    class Partial:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def expand(self, **kwargs):
            expanded.update(partial=self.kwargs, **kwargs)
            return self

    class BashOperator:
        partial = staticmethod(lambda **kwargs: Partial(**kwargs))

    module = load_dag(monkeypatch, BashOperator)
    commands = expanded["bash_command"]
    assert len(commands) == module.NUM_SHARDS
    for i, cmd in enumerate(commands):
        assert "{{ ds }}" in cmd and f"--shard {i}/{module.NUM_SHARDS}" in cmd
        assert f"shard-{i:03d}-of-{module.NUM_SHARDS:03d}.parquet" in cmd
    assert len(set(commands)) == len(commands)
    assert expanded["partial"]["task_id"] == "generate"
    assert set(expanded["partial"]["env"]) <= run_options_envvars()
    assert module.dag.kwargs["default_args"]["retries"] > 0


def test_boolean_options_read_false_from_the_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    env.update(BATCHGEN_STRICT="false", BATCHGEN_RESUME="no", BATCHGEN_SHARD="9/2")
    done = subprocess.run([sys.executable, "-m", "batchgen.cli", "run", str(REPO / "examples" / "prompts.jsonl"),
                           str(tmp_path / "o.parquet")], capture_output=True, text=True, env=env, timeout=120)
    # the boolean variables parse; the bad shard is then reported as a one-line usage error
    assert done.returncode == 2 and "--shard" in done.stderr and len(done.stderr.strip().splitlines()) == 1
