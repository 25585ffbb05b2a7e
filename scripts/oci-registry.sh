#!/usr/bin/env bash
# A real OCI registry binary for the oci:// model tests, idempotently: Debian's
# docker-registry (CNCF distribution). The tests start it themselves on a free port;
# this only makes sure `docker-registry` is on PATH. Progress goes to stderr.
set -euo pipefail
if command -v docker-registry >/dev/null || command -v registry >/dev/null; then
  exit 0
fi
echo "oci-registry.sh: installing docker-registry from Debian's packages" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq docker-registry >&2
# The package starts a system service on :5000; the tests do not use it.
(systemctl disable --now docker-registry >/dev/null 2>&1 || service docker-registry stop >/dev/null 2>&1) || true
