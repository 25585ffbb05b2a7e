"""Local TCP ports: a free one to bind, and waiting for one to accept connections.

The one home for the agent (replica ports, through `fleet_base.ports`), the local fleet
(nats-server, control plane, gateways), the engine's test/bench harness
(`engine.server.process`) and the tests.
"""

from __future__ import annotations

import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick); bind it soon, another may take it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout: float) -> bool:
    """Whether `host:port` accepts a TCP connection within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False
