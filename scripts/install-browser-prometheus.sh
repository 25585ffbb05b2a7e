#!/usr/bin/env bash
# Debian's prometheus (prometheus + promtool) and chromium (+ chromium-driver) for the
# observability and console browser tests, idempotently: nothing is done when all four
# binaries are on PATH; `apt-get update` runs only when a package is missing and the
# package lists are older than a day (or absent). Progress goes to stderr.
# The tests drive /usr/bin/chromium through the `playwright` Python package; never
# `playwright install` (that downloads a browser build).
set -euo pipefail
log() { echo "install-browser-prometheus.sh: $*" >&2; }
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || { [[ " ${need[*]-} " == *" prometheus "* ]] || need+=(prometheus); }
[ -x /usr/bin/chromium ] || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
lists=/var/lib/apt/lists
if [ -z "$(find "$lists" -maxdepth 1 -name '*_Packages*' -mtime -1 -print -quit 2>/dev/null)" ] \
  || ! apt-cache show "${need[@]}" >/dev/null 2>&1; then
  log "apt-get update"
  apt-get update -qq >&2
fi
log "installing ${need[*]}"
apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
