"""The control plane process: upgrade the database, make sure the CLI has an admin token,
and serve the admin API with the control loops (uvicorn; SIGTERM/SIGINT stop cleanly).

`python -m control_plane` and `fleetctl control-plane` both end up in `run()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from control_plane.db.models import ApiKey
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.settings import Settings
from fleet_base.api_keys import key_id_of, verify_secret

log = logging.getLogger("control_plane")

ADMIN_KEY_NAME = "admin (created at first start)"


def write_private(path: Path, text: str) -> None:
    """Write atomically with mode 0600 (tokens)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _token_is_valid_admin(session: Session, token: str) -> bool:
    key_id = key_id_of(token)
    row = session.get(ApiKey, key_id) if key_id else None
    return (
        row is not None
        and row.revoked_at is None
        and "admin" in (row.scopes or [])
        and verify_secret(token, row.salt, row.hash)
    )


def ensure_admin_token(settings: Settings, sessions: sessionmaker[Session]) -> str:
    """The admin token in `settings.token_file`, creating key and file when the file is
    missing or its key is unknown or revoked in this database."""
    from control_plane.api.routers.keys import make_key

    token_file = settings.token_file
    with _home_lock(settings.home / ".admin-token.lock"), sessions() as session:
        if token_file.exists():
            token = token_file.read_text().strip()
            if token and _token_is_valid_admin(session, token):
                return token
        row, secret = make_key(ADMIN_KEY_NAME, ["admin"], None, {})
        session.add(row)
        session.commit()
        write_private(token_file, secret + "\n")
    log.info("created admin key %s; its token is in %s", row.key_id, token_file)
    return secret


@contextlib.contextmanager
def _home_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the control-plane processes sharing one FLEET_HOME, so that
    instances starting together agree on one admin token and one api file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record_api_url(settings: Settings, url: str) -> None:
    """Name this instance in the api file the CLI reads, unless it already does: a launcher
    of several instances (`fleetctl up --control-planes N`) lists them all there first, and
    no instance may shrink that list to itself; a lone instance replaces a stale file."""
    from control_plane.settings import parse_api_urls
    from fleet_base.local_state import atomic_write

    with _home_lock(settings.home / ".api-url.lock"):
        listed = parse_api_urls(settings.api_file.read_text()) if settings.api_file.exists() else []
        if url not in listed:
            atomic_write(settings.api_file, (url + "\n").encode())


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def public_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def run(settings: Settings, *, loops: bool = True) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code. `loops=False` serves the API
    alone (nothing places or publishes: for API tests and debugging)."""
    import uvicorn

    from control_plane.api.app import build_app
    from control_plane.context import ControlPlaneContext
    from fleet_base import heap_trim
    from fleet_base.listener import uvicorn_options
    from fleet_base.nats_io import NatsLink, redact_url

    try:
        listener = uvicorn_options()
        heap_trim.start()
    except ValueError as err:
        log.error("%s", err)
        return 2

    settings.home.mkdir(parents=True, exist_ok=True)
    log.info("database %s: upgrading to head", _redact(settings.db_url))
    upgrade_to_head(settings.db_url)
    # A session idle inside a transaction that long is a paused or partitioned process: past
    # the lease, any successor may be waiting on its row locks. Longer than any legitimate
    # idle span inside a transaction (a placement solve between its reads and its writes);
    # the lease's own writes and the fenced commits hold theirs far shorter (control_plane.ha).
    sessions = make_sessions(
        settings.db_url, idle_in_transaction_s=settings.leader_lease_s + settings.leader_renew_deadline_s
    )
    ensure_admin_token(settings, sessions)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as err:
        log.error("cannot listen on %s:%s: %s", settings.host, settings.port, err)
        return 2
    url = public_url(settings.host, sock.getsockname()[1])

    stopping: list[int] = []

    def _remember(signum, _frame) -> None:  # uvicorn re-raises the signal after shutdown
        stopping.append(signum)

    signal.signal(signal.SIGTERM, _remember)
    signal.signal(signal.SIGINT, _remember)

    async def serve() -> None:
        ctx = ControlPlaneContext(
            settings=settings,
            sessions=sessions,
            nats=NatsLink(settings.nats_url, "control-plane", tls=settings.nats_tls()),
        )
        app = build_app(ctx, run_loops=loops, public_url=settings.advertise_url.rstrip("/") or url)

        def on_ready() -> None:
            record_api_url(settings, url)
            log.info(
                "admin API on %s (docs: %s/docs); NATS %s (%s)",
                url,
                url,
                redact_url(settings.nats_url),
                "TLS, certificate identity" if settings.nats_tls() else "plaintext, anonymous",
            )

        app.state.on_ready = on_ready
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
            **listener,
        )
        await uvicorn.Server(config).serve(sockets=[sock])

    try:
        asyncio.run(serve())
    finally:
        sessions.kw["bind"].dispose()
        sock.close()
    log.info("stopped")
    return 0


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<database url>"


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m control_plane", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default 7070; 0: any free port)")
    parser.add_argument("--nats-url", default=None, help="NATS server (default $FLEET_NATS_URL or local)")
    parser.add_argument(
        "--database-url", default=None, help="default $FLEET_DATABASE_URL or SQLite in $FLEET_HOME"
    )
    parser.add_argument(
        "--no-loops", action="store_true", help="serve the API only, without the control loops"
    )
    args = parser.parse_args(argv)
    configure_logging()
    settings = Settings.from_env(
        host=args.host, port=args.port, nats_url=args.nats_url, database_url=args.database_url
    )
    return run(settings, loops=not args.no_loops)
