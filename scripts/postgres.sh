#!/usr/bin/env bash
# A throwaway PostgreSQL for tests and CI, idempotently: installs Debian's packages if
# no initdb/pg_ctl is found, initialises a cluster in $FLEET_PG_DIR (default
# /tmp/fleet-pg) owned by `postgres`, starts it on 127.0.0.1:$FLEET_PG_PORT (default
# 5432), and makes role `fleet` (password `fleet`, CREATEDB: tests make a database per
# module) and database `fleet_test`. Prints the SQLAlchemy URL as the last stdout line;
# progress goes to stderr. Running it again with the server up only prints the URL.
set -euo pipefail
dir="${FLEET_PG_DIR:-/tmp/fleet-pg}"
port="${FLEET_PG_PORT:-5432}"
log() { echo "postgres.sh: $*" >&2; }
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

find_bindir() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && { echo "$d"; return 0; }
  done
  if command -v pg_ctl >/dev/null && command -v initdb >/dev/null; then
    dirname "$(readlink -f "$(command -v pg_ctl)")"
    return 0
  fi
  return 1
}

bindir="$(find_bindir || true)"
if [ -z "$bindir" ]; then
  log "installing PostgreSQL from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq postgresql >&2
  bindir="$(find_bindir)"
fi

as_pg() {
  if command -v runuser >/dev/null; then runuser -u postgres -- "$@"; else su postgres -s /bin/sh -c "$(printf '%q ' "$@")"; fi
}
id postgres >/dev/null 2>&1 || useradd --system --home-dir "$dir" --shell /bin/sh postgres

mkdir -p "$dir"
chown postgres "$dir"
chmod 700 "$dir"
data="$dir/data"
if [ ! -f "$data/PG_VERSION" ]; then
  log "initdb in $data"
  as_pg "$bindir/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >/dev/null 2>&1 \
    || as_pg "$bindir/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --no-locale >/dev/null
fi

if as_pg "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
  port="$(sed -n 4p "$data/postmaster.pid")"  # already running: on whatever port it took
else
  # Another PostgreSQL (say Debian's own cluster, started by the package) may hold the port.
  tries=0
  while port_busy "$port"; do
    log "port $port is taken; trying $((port + 1))"
    port=$((port + 1)); tries=$((tries + 1))
    [ "$tries" -lt 20 ] || { log "no free port"; exit 1; }
  done
  log "starting on 127.0.0.1:$port"
  as_pg "$bindir/pg_ctl" -D "$data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=200" start >/dev/null \
    || { tail -n 20 "$dir/server.log" >&2; exit 1; }
fi

psql_pg() { as_pg "$bindir/psql" -h "$dir" -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtAc "$1"; }
if [ "$(psql_pg "SELECT 1 FROM pg_roles WHERE rolname='fleet'")" != "1" ]; then
  psql_pg "CREATE ROLE fleet LOGIN CREATEDB PASSWORD 'fleet'"
fi
if [ "$(psql_pg "SELECT 1 FROM pg_database WHERE datname='fleet_test'")" != "1" ]; then
  psql_pg "CREATE DATABASE fleet_test OWNER fleet"
fi
echo "postgresql+psycopg://fleet:fleet@127.0.0.1:${port}/fleet_test"
