"""SIGTERM while `batchgen run` starts (its imports, the default model's first conversion): exit 75, as
for a signal during the job, and no half-converted model left in the cache."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def start(tmp_path: Path, *python_options: str) -> subprocess.Popen:
    """`batchgen run` of one prompt on the default model, with an empty model cache."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    env["BATCHGEN_CACHE"] = str(tmp_path / "cache")
    return subprocess.Popen([sys.executable, *python_options, "-m", "batchgen.cli", "run", str(src),
                             str(tmp_path / "out.parquet"), "--max-tokens", "2"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def terminate(process: subprocess.Popen) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


def test_sigterm_while_converting_the_default_model_exits_75_and_leaves_no_conversion(tmp_path):
    process = start(tmp_path)
    models = tmp_path / "cache" / "models"
    deadline = time.monotonic() + 300
    while not (models.is_dir() and any(p.name.startswith(".converting-") for p in models.iterdir())):
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the conversion did not start"
        time.sleep(0.05)
    code, stderr = terminate(process)
    assert code == 75, stderr
    assert "SIGTERM" in stderr and "rerun the same command" in stderr
    assert [p.name for p in models.iterdir()] == []  # neither a .converting-* directory nor a half model
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "out.parquet.partial").exists()


def test_sigterm_while_importing_torch_exits_75(tmp_path):
    """-X importtime prints a line as each module is imported: SIGTERM once torch's begin to come."""
    process = start(tmp_path, "-X", "importtime")
    for line in process.stderr:
        if re.search(r"\|\s+torch\.", line):
            break
    else:
        pytest.fail(f"torch was not imported (exit {process.wait()})")
    code, stderr = terminate(process)
    assert code == 75, stderr[-2000:]
    assert "SIGTERM: interrupted" in stderr
