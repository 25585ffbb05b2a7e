#!/usr/bin/env bash
# Installs what the tests need (idempotently) and runs the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
bash scripts/oci-registry.sh
export FLEET_REQUIRE_OCI_REGISTRY=1
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"  # derandomized property tests
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 "$@"
