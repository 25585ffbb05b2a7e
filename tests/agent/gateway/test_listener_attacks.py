"""Slow and greedy clients against a real gateway listener, over real sockets.

- slowloris: connections that send their request head a byte at a time are closed at the
  header deadline, and one that sends its head but dribbles the body at the body deadline;
- a connection past the listener's cap is refused at once (503), and a normal client is
  served again as soon as the slow ones are gone.
"""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import GatewayProcess
from tests.polling import wait_for

HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 6
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


class Dribbler:
    """Raw sockets that each send `payload` one byte per tick and notice when the server
    closes them (EOF, a reset, or a final response followed by EOF)."""

    def __init__(self, port: int, n: int, payload: bytes, burst: bytes = b"") -> None:
        self.socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
        for s in self.socks:
            s.sendall(burst)
            s.setblocking(False)
        self.payload = payload
        self.sent = [0] * n
        self.closed_at: list[float | None] = [None] * n
        self.replies = [b""] * n

    def tick(self) -> int:
        """Send each open socket its next byte; the number still open."""
        for i, s in enumerate(self.socks):
            if self.closed_at[i] is not None:
                continue
            readable, _, _ = select.select([s], [], [], 0)
            try:
                if readable:
                    data = s.recv(4096)
                    self.replies[i] += data
                    if not data:
                        raise ConnectionResetError
                if self.sent[i] < len(self.payload):
                    s.send(self.payload[self.sent[i] : self.sent[i] + 1])
                    self.sent[i] += 1
            except OSError:
                self.closed_at[i] = time.monotonic()
        return sum(t is None for t in self.closed_at)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def _dribble_until_closed(d: Dribbler, timeout: float) -> float:
    start = time.monotonic()
    while d.tick() and time.monotonic() - start < timeout:
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def guarded(tmp_path: Path, nats, keys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_HEADER_TIMEOUT_S", str(HEADER_TIMEOUT_S))
    monkeypatch.setenv("FLEET_BODY_TIMEOUT_S", str(BODY_TIMEOUT_S))
    monkeypatch.setenv("FLEET_MAX_CONNECTIONS", str(MAX_CONNECTIONS))
    gw = GatewayProcess(tmp_path / "gw", "east", nats_url=nats.url, lat=EAST[0], lon=EAST[1])
    gw.start()
    gw.write(keys=[record for _, record in keys.values()])
    yield gw
    gw.stop()


def test_slowloris_is_cut_off_and_over_cap_connections_are_refused(
    guarded: GatewayProcess, secret: str
) -> None:
    endless_head = HEAD + b"X-Pad: " + b"a" * 10_000
    heads = Dribbler(guarded.port, MAX_CONNECTIONS, endless_head)
    try:
        heads.tick()  # every slot of the listener is held by a slow head now
        # one more connection: refused at once, not queued behind the slow ones
        t0 = time.monotonic()
        over = httpx.get(f"{guarded.url}/health", timeout=5)
        assert over.status_code == 503, over.text
        assert over.headers.get("retry-after") and time.monotonic() - t0 < 1.0
        took = _dribble_until_closed(heads, HEADER_TIMEOUT_S + 5)
        print(f"\nslowloris: over-cap connection refused in {time.monotonic() - t0 - took:.3f} s; ", end="")
        print(f"{len(heads.socks)} slow heads closed within {took:.2f} s (deadline {HEADER_TIMEOUT_S} s)")
        assert all(t is not None for t in heads.closed_at), f"slow heads still open after {took:.1f} s"
        assert took < HEADER_TIMEOUT_S + 2.0
        assert all(r.startswith(b"HTTP/1.1 408") or not r for r in heads.replies), heads.replies
    finally:
        heads.close()
    # a well-behaved client is served again
    assert wait_for(lambda: httpx.get(f"{guarded.url}/health", timeout=5).status_code == 200, 5, "health")

    head = HEAD + f"Authorization: Bearer {secret}\r\n".encode() + b"Content-Length: 10000\r\n\r\n"
    bodies = Dribbler(guarded.port, 2, b"{" + b" " * 9_999, burst=head)
    try:
        took = _dribble_until_closed(bodies, HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 5)
        print(
            f"slow bodies: {len(bodies.socks)} answered 408 and closed within {took:.2f} s (deadline {BODY_TIMEOUT_S} s)"
        )
        assert all(t is not None for t in bodies.closed_at), f"slow bodies still open after {took:.1f} s"
        assert took < HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 2.0
        for reply in bodies.replies:
            assert reply.startswith(b"HTTP/1.1 408"), reply
    finally:
        bodies.close()
    assert httpx.get(f"{guarded.url}/health", timeout=5).status_code == 200
