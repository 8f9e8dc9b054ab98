"""Airflow DAG: each day's prompts split over N hosts, one mapped task per shard.

Task `generate[i]` runs `batchgen run INPUT OUTPUT_DIR/_unfinished/shard-i-of-N.parquet --shard i/N`,
with paths templated on the run's logical date ({{ ds }}), and renames the finished file to
OUTPUT_DIR/shard-i-of-N.parquet. Readers take the folder (`pq.read_table(OUTPUT_DIR)`, Spark, Hive):
they skip names that begin with `_` or `.`, so they see finished shards only, never a half-written
one or its work directory; the folder is the whole job once it holds all N shards.

Reruns are idempotent: a retried or cleared task resumes its shard from the rows its interrupted run
saved (a killed worker loses at most a few seconds of work), and a task whose shard is in OUTPUT_DIR
does nothing (to generate a shard again, with other settings say, delete it first). Exit codes: 75
(interrupted, e.g. the worker was stopped) and 1 fail the try and Airflow retries it; 2 and 65 (rows
failed with --strict) need a person, retries will not help.

Copy this file into the DAGs folder and set BATCHGEN, INPUT and OUTPUT_DIR for your hosts.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

try:  # Airflow 3
    from airflow.providers.standard.operators.bash import BashOperator
    from airflow.sdk import DAG
except ImportError:  # Airflow 2.x
    from airflow import DAG
    from airflow.operators.bash import BashOperator

NUM_SHARDS = 4
BATCHGEN = "/opt/batchgen/.venv/bin/batchgen"
INPUT = "/data/prompts/{{ ds }}.parquet"
OUTPUT_DIR = "/data/generations/{{ ds }}"
# `batchgen run` options, as their environment variables (the same as jobs/example.env).
SETTINGS = {
    "BATCHGEN_MAX_TOKENS": "256",
    "BATCHGEN_TEMPERATURE": "0.7",
    "BATCHGEN_TOP_P": "0.95",
    "BATCHGEN_SEED": "0",
}


UNFINISHED = "_unfinished"  # in OUTPUT_DIR: where shards are generated, out of readers' sight


def shard_command(index: int, count: int = NUM_SHARDS) -> str:
    """Task `generate[index]`'s bash script: generate the shard under UNFINISHED (resuming what an
    interrupted try saved), then rename it into OUTPUT_DIR (atomic: the same file system)."""
    name = f"shard-{index:03d}-of-{count:03d}.parquet"
    final, work = f"{OUTPUT_DIR}/{name}", f"{OUTPUT_DIR}/{UNFINISHED}/{name}"
    return "\n".join([
        "set -e",
        f'if [ -e "{final}" ]; then echo "{final} is done: nothing to do"; exit 0; fi',
        f'{BATCHGEN} run "{INPUT}" "{work}" --shard {index}/{count}',
        f'mv "{work}" "{final}"',
        f'rmdir "{OUTPUT_DIR}/{UNFINISHED}" 2>/dev/null || true  # (the last shard out tidies up)',
    ])


with DAG(
    dag_id="batchgen_daily",
    schedule="@daily",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 3, "retry_delay": timedelta(minutes=2)},
    tags=["batchgen"],
) as dag:
    generate = BashOperator.partial(
        task_id="generate",
        env=SETTINGS,
        append_env=True,
        execution_timeout=timedelta(hours=12),
    ).expand(bash_command=[shard_command(i) for i in range(NUM_SHARDS)])
