"""Shared fixtures. Without a GPU, Triton kernels are tested under its interpreter, which must be
switched on before triton is first imported (by batchgen or the kernel tests)."""
import gc
import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.tiny_models import build  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind) -> directory of a tiny random-weight checkpoint (built once per session)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return get


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each LLM sizes its KV pool from the GPU's free memory: give back what earlier tests held."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


class Done(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def call_cli(args, env: dict | None = None) -> int:
    """The `batchgen` entry point on args in this process, without the caller's BATCHGEN_* settings (the
    model cache's aside), with env's -> its exit code."""
    from batchgen.cli import app

    with pytest.MonkeyPatch.context() as m:
        for key in list(os.environ):
            if key.startswith("BATCHGEN_") and key != "BATCHGEN_CACHE":
                m.delenv(key)
        for key, value in (env or {}).items():
            m.setenv(key, value)
        with pytest.raises(SystemExit) as exit_info:
            app([str(a) for a in args])
    return exit_info.value.code


@pytest.fixture
def batchgen(capsys, monkeypatch):
    """Runs the `batchgen` entry point in this process (imports are paid once) -> Done, which also
    unpacks as (exit code, stdout, stderr). `env` sets environment variables for one call."""
    for key in list(os.environ):
        if key.startswith("BATCHGEN_") and key != "BATCHGEN_CACHE":
            monkeypatch.delenv(key)

    def call(*args, env: dict | None = None) -> Done:
        capsys.readouterr()
        code = call_cli(args, env)
        out = capsys.readouterr()
        return Done(code, out.out, out.err)

    return call


@pytest.fixture(scope="session")
def run_job(tmp_path_factory):
    """tests/test_cli_run.py's shared job (JOB_ROWS) and its uninterrupted `batchgen run` output under
    JOB_OPTIONS -> (input, rows): the reference of the interruption, shard and replica tests of several
    modules, run once per session, in this process."""
    from tests.test_cli_run import JOB_OPTIONS, JOB_ROWS, read, write_jsonl

    tmp = tmp_path_factory.mktemp("job")
    src = write_jsonl(tmp / "job.jsonl", JOB_ROWS)
    assert call_cli(["run", src, tmp / "whole.parquet", *JOB_OPTIONS]) == 0
    rows, _ = read(tmp / "whole.parquet")
    return src, rows


@pytest.fixture(scope="session")
def worker_job(tmp_path_factory):
    """tests/test_worker.py's job (ROWS) and `batchgen run`'s output of it under its OPTIONS -> (input,
    table): the reference of every queue job of the worker tests, single or with replicas, run once, in
    this process."""
    import pyarrow.parquet as pq

    from tests.test_cli_run import write_jsonl
    from tests.test_worker import OPTIONS, ROWS

    tmp = tmp_path_factory.mktemp("worker-job")
    src = write_jsonl(tmp / "job.jsonl", ROWS)
    assert call_cli(["run", src, tmp / "run.parquet", *OPTIONS]) == 0
    return src, pq.read_table(tmp / "run.parquet")
