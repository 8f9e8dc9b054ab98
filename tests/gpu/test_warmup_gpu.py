"""On a GPU: after an engine's warm-up, jobs of many shapes (odd row counts, every sampling path,
logprobs, prompt_logprobs' eager steps, n samples, banned stop ids, constrained rows) compile no Triton
kernel, with CUDA graphs and without (issue #11: no compilation inside a job's timing). Each engine
runs in a fresh process: kernels compiled by earlier tests of this process would hide a gap. Qwen3: its
q/k norms and head_dim 32 (the one-launch attention of a lone sequence)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("xgrammar")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind, mode", [("llama", "graphs"), ("llama", "eager"), ("qwen3", "graphs")])
def test_no_kernel_compiles_inside_jobs(tiny_model, kind, mode):
    pytest.importorskip("triton.knobs")
    run = subprocess.run([sys.executable, "-m", "tests.gpu.jobs_after_warmup", str(tiny_model(kind)), mode],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert result["compiled"] == []
