"""The soak's attackers: clients that each press on one per-participant bound while the
request mix runs, and record what the fleet did to them.

- `slow reader`: opens a long stream over a socket with a tiny receive window and reads
  nothing for a while (the gateway must cut it at its write deadline and give its slot back);
- `slowloris`: sends a request head one byte at a time and never finishes it (the listener
  must close it at its header deadline);
- `key flood`: a second key with a small `max_concurrent` fires far more requests at once
  (the excess gets 429; the main key's requests keep being served);
- `responses uncapped`: `/v1/responses` with no `max_output_tokens` (reserved for the whole
  window, charged for what it generated; never a 5xx).

Outcomes are strings so the soak can table them; anything that looks like a server error
is `5xx` or `error`, which the soak counts against zero.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx


@dataclass
class AbuseSample:
    t: float  # seconds since the start
    attack: str
    outcome: str
    seconds: float


Attack = Callable[[random.Random], tuple[str, float]]


def _status_outcome(status: int) -> str:
    return "5xx" if status >= 500 else str(status)


def stalled_stream(url: str, body: dict, headers: dict[str, str]) -> socket.socket:
    """A streamed POST whose answer is never read, over a socket with a tiny window."""
    u = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, 1024)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)  # else the sender's buffer grows to MBs
    sock.connect((u.hostname, u.port))
    data = json.dumps(body).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def slow_reader(url: str, key: str, model: str, hold_s: float) -> Attack:
    """One stream of up to 2,000 tokens over a socket with a tiny window, left unread for
    `hold_s`, then read to its end: "cut by server" if the fleet gave up on it."""

    def run(rng: random.Random) -> tuple[str, float]:
        began = time.monotonic()
        body = {"model": model, "stream": True, "max_tokens": 2000, "user": uuid.uuid4().hex,
                "messages": [{"role": "user", "content": "tell me a long story " * rng.randint(1, 8)}]}  # fmt: skip
        head, tail = b"", b""
        try:
            with stalled_stream(url, body, {"authorization": f"Bearer {key}"}) as sock:
                time.sleep(hold_s)  # the attack: nothing is read
                sock.settimeout(30)
                while chunk := sock.recv(65536):
                    head = head or chunk[:64]
                    tail = (tail + chunk)[-64:]
                    if tail.endswith(b"\r\n0\r\n\r\n"):  # the last chunk: the response ended
                        break
        except TimeoutError:
            return "held open", time.monotonic() - began
        except OSError:
            return "cut by server", time.monotonic() - began
        status = _status_line(head)
        if status != 200:
            return ("cut by server" if status is None else _status_outcome(status)), time.monotonic() - began
        return ("completed" if b"[DONE]" in tail else "cut by server"), time.monotonic() - began

    return run


def _status_line(head: bytes) -> int | None:
    parts = head.split(b"\r\n", 1)[0].split()
    return int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None


def slowloris(url: str, give_up_s: float) -> Attack:
    """A request head sent one byte per second that never ends; the outcome says whether the
    server closed the connection before `give_up_s`."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    def run(rng: random.Random) -> tuple[str, float]:
        began = time.monotonic()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nX-Pad-{rng.randint(0, 9999)}: "
        try:
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.settimeout(1.0)
                for byte in head.encode() + b"a" * 100_000:
                    if time.monotonic() - began > give_up_s:
                        return "held open", time.monotonic() - began
                    try:
                        sock.sendall(bytes([byte]))
                        if sock.recv(1, socket.MSG_PEEK) == b"":
                            return "closed by server", time.monotonic() - began
                        return "answered", time.monotonic() - began  # e.g. a 408/431 head
                    except TimeoutError:
                        continue  # nothing from the server yet: the next byte
                    except OSError:
                        return "closed by server", time.monotonic() - began
        except OSError:
            return "refused", time.monotonic() - began
        return "held open", time.monotonic() - began

    return run


def key_flood(url: str, key: str, model: str, burst: int) -> Attack:
    """`burst` requests at once from one key; the outcome counts 200s and 429s."""

    def run(rng: random.Random) -> tuple[str, float]:
        began = time.monotonic()
        statuses: list[int] = []
        lock = threading.Lock()

        def one() -> None:
            body = {"model": model, "max_tokens": rng.randint(8, 64), "user": uuid.uuid4().hex,
                    "messages": [{"role": "user", "content": "flood"}]}  # fmt: skip
            try:
                status = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                                    headers={"authorization": f"Bearer {key}"}).status_code  # fmt: skip
            except httpx.HTTPError:
                status = 0
            with lock:
                statuses.append(status)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        if any(s >= 500 for s in statuses):
            return "5xx", time.monotonic() - began
        if any(s == 0 for s in statuses):
            return "error", time.monotonic() - began
        limited = statuses.count(429)
        return ("excess limited (429)" if limited else "all served"), time.monotonic() - began

    return run


def responses_uncapped(url: str, key: str, model: str) -> Attack:
    def run(rng: random.Random) -> tuple[str, float]:
        began = time.monotonic()
        body = {"model": model, "input": "say something " * rng.randint(1, 20), "user": uuid.uuid4().hex}
        try:
            r = httpx.post(f"{url}/v1/responses", json=body, timeout=120,
                           headers={"authorization": f"Bearer {key}"})  # fmt: skip
        except httpx.HTTPError:
            return "error", time.monotonic() - began
        return _status_outcome(r.status_code), time.monotonic() - began

    return run


class Attackers:
    """Each attack on its own threads, looping until stopped, with a pause between tries."""

    def __init__(self, t0: float, pause_s: float = 1.0) -> None:
        self.t0, self.pause_s = t0, pause_s
        self.samples: list[AbuseSample] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, name: str, attack: Attack, threads: int) -> None:
        for i in range(threads):
            seed = hash((name, i)) & 0xFFFF
            t = threading.Thread(target=self._loop, args=(name, attack, seed), daemon=True)
            self._threads.append(t)

    def _loop(self, name: str, attack: Attack, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            began = time.monotonic() - self.t0
            outcome, seconds = attack(rng)
            self.samples.append(AbuseSample(began, name, outcome, seconds))
            self._stop.wait(self.pause_s)

    def start(self) -> Attackers:
        for t in self._threads:
            t.start()
        return self

    def stop(self, join_s: float = 120) -> None:
        self._stop.set()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def table(self) -> list[list[object]]:
        """attack, outcome, count, median seconds."""
        groups: dict[tuple[str, str], list[float]] = {}
        for s in self.samples:
            groups.setdefault((s.attack, s.outcome), []).append(s.seconds)
        return [[a, o, len(xs), f"{sorted(xs)[len(xs) // 2]:.1f}"] for (a, o), xs in sorted(groups.items())]

    def errors(self) -> int:
        return sum(s.outcome in ("5xx", "error") for s in self.samples)
