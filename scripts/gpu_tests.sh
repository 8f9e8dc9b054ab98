#!/usr/bin/env bash
# The GPU tests, on a machine with CUDA: tests/gpu and tests/kernels (the Triton kernels compiled for
# the GPU, not interpreted as on CPU), and, where two or more GPUs are visible, the tensor-parallel
# tests of tests/engine over NCCL (tests/gpu's multi-GPU tests run then too; with one GPU they skip).
# Arguments go to pytest (-x, -k EXPR, ...).
#
#   bash scripts/gpu_tests.sh                    # after bash scripts/setup.sh --test
#   PYTHON=python3 bash scripts/gpu_tests.sh     # an interpreter that has batchgen's dependencies already
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

gpus="$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")"
if [ "$gpus" -lt 1 ]; then
    echo "gpu_tests: no CUDA GPU visible (on CPU the kernels are tested by the plain test command)" >&2
    exit 2
fi
paths=(tests/gpu tests/kernels)
if [ "$gpus" -ge 2 ]; then
    paths+=(tests/engine/test_tensor_parallel.py tests/engine/test_shard_sampling.py)
fi
echo "gpu_tests: $gpus GPU(s): ${paths[*]}"
exec "$PYTHON" -m pytest -q "${paths[@]}" "$@"
