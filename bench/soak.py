"""Soak: a local fleet (nats-server, control plane, one agent + gateway, `sim` replicas)
saturated through its gateway, first with valid requests only (the baseline), then with a
mix of valid and hostile ones (seed 2**64, 310-digit max_tokens, deeply nested JSON, lone
surrogates, NaN, broken JSON, bodies over the limit). It prints, per time window, the
request counts by outcome and the valid requests' p50/p99 latency; the RSS of every
component before and after; and the error counts that must stay zero (a 5xx for any
request, a hostile request not refused with a 4xx, a valid request refused).

Not part of CI. The issue's run is 30 minutes:

    PYTHONPATH=. .venv/bin/python -m bench.soak --duration-s 1800
    PYTHONPATH=. .venv/bin/python -m bench.soak --duration-s 120 --baseline-s 30   # a short look

Replicas are simulated (agent/sim: calibrated timing, no model), so the soak exercises
the fleet's own processes; the hostile inputs that only an engine judges (seed) are
refused by the sim replica's request validation as well.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil

from bench.common import console, print_table, run_main
from tests.e2e.sim_fleet import SimFleet, wait_for

NAME = "soak"
REGION = "local-east"


def hostile_bodies() -> list[tuple[str, bytes]]:
    m = NAME.encode()
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]' % m
    return [
        ("seed 2^64", chat + b', "seed": 18446744073709551616}'),
        ("310-digit max_tokens", chat + b', "max_tokens": ' + b"9" * 310 + b"}"),
        ("nested 5000", b'{"model": "%s", "messages": ' % m + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("lone surrogate", b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "\\ud800"}]}' % m),
        ("NaN", chat + b', "temperature": NaN}'),
        ("broken JSON", b'{"model": "%s", "messages": [' % m),
        ("n 10^6", chat + b', "n": 1000000}'),
        ("5 MiB body", b'{"model": "%s", "prompt": "' % m + b"a" * (5 << 20) + b'"}'),
    ]  # fmt: skip


@dataclass
class Sample:
    t: float  # seconds since the start
    kind: str  # "valid" | "hostile"
    status: int  # 0: transport error
    latency_s: float
    name: str = ""  # which hostile input


class Load:
    def __init__(self, url: str, key: str, workers: int, hostile_share: float) -> None:
        self.url, self.key, self.workers = url, key, workers
        self.hostile_share = hostile_share
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._hostile = hostile_bodies()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        headers = {"authorization": f"Bearer {self.key}", "content-type": "application/json"}
        with httpx.Client(timeout=60, headers=headers) as client:
            while not self._stop.is_set():
                hostile = rng.random() < self.hostile_share
                name = ""
                if hostile:
                    name, body = rng.choice(self._hostile)
                    path = "/v1/chat/completions"
                    if b'"prompt"' in body[:40]:
                        path = "/v1/completions"
                else:
                    stream = rng.random() < 0.5
                    body = httpx.Request("POST", "/", json={
                        "model": NAME, "messages": [{"role": "user", "content": "hello " * rng.randint(1, 40)}],
                        "max_tokens": rng.randint(1, 32), "stream": stream, "user": uuid.uuid4().hex,
                    }).content  # fmt: skip
                    path = "/v1/chat/completions"
                began = time.monotonic()
                try:
                    r = client.post(self.url + path, content=body)
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                kind = "hostile" if hostile else "valid"
                self.samples.append(Sample(began - self.t0, kind, status, time.monotonic() - began, name))

    def start(self) -> Load:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(70)


def rss_of_components(fleet: SimFleet) -> dict[str, float]:
    """MiB of every process of the fleet (NATS, control plane, agent, gateway, replicas)."""
    out: dict[str, float] = {}
    state = fleet.local.load()
    records = list(state.processes) + fleet.local.replicas(state)
    for rec in records:
        try:
            proc = psutil.Process(rec.pid)
            rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            continue
        out[f"{rec.kind} {rec.name}".strip()] = rss / 2**20
    return out


def windows(samples: list[Sample], width_s: float) -> list[list[object]]:
    rows = []
    end = max((s.t for s in samples), default=0.0)
    start = 0.0
    while start <= end:
        win = [s for s in samples if start <= s.t < start + width_s]
        valid = [s for s in win if s.kind == "valid"]
        lat = np.array([s.latency_s for s in valid if s.status == 200]) * 1000
        rows.append([
            f"{start:.0f}-{start + width_s:.0f} s", len(valid), sum(s.status == 200 for s in valid),
            len(win) - len(valid), sum(s.status >= 500 or s.status == 0 for s in win),
            f"{np.percentile(lat, 50):.1f}" if lat.size else "-", f"{np.percentile(lat, 99):.1f}" if lat.size else "-",
        ])  # fmt: skip
        start += width_s
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0, help="the mixed phase")
    p.add_argument("--baseline-s", type=float, default=60.0, help="valid requests only, first")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--hostile-share", type=float, default=0.3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--window-s", type=float, default=0.0, help="report window (default: duration / 10)")
    args = p.parse_args(argv)
    window = args.window_s or max(5.0, (args.baseline_s + args.duration_s) / 10)

    with tempfile.TemporaryDirectory(prefix="fleet-soak-") as tmp:
        fleet = SimFleet(Path(tmp) / "home", [REGION], slots=max(2, args.replicas))
        try:
            fleet.up()
            r = fleet.api("POST", "/v1/deployments", json={"name": NAME, "model": "sim", "replicas": args.replicas,
                                                           "engine_args": {"cold_start": 0.2}})  # fmt: skip
            r.raise_for_status()
            wait_for(lambda: sum(p["state"] == "ready" for p in fleet.deployment(NAME)["placements"])
                     == args.replicas, 120, 0.2, "replicas ready")  # fmt: skip
            before = rss_of_components(fleet)
            load = Load(fleet.gateways[REGION], fleet.key, args.workers, 0.0).start()
            console.print(f"baseline: {args.workers} workers, valid requests only, {args.baseline_s:.0f} s")
            time.sleep(args.baseline_s)
            load.hostile_share = args.hostile_share
            console.print(f"mixed: {args.hostile_share:.0%} hostile requests, {args.duration_s:.0f} s")
            time.sleep(args.duration_s)
            load.stop()
            after = rss_of_components(fleet)
            healthy = httpx.get(f"{fleet.gateways[REGION]}/health", timeout=5).status_code == 200
        finally:
            fleet.down()

    samples = load.samples
    print_table(
        "soak: requests per window (valid p50/p99 in ms)",
        ["window", "valid", "valid 200", "hostile", "5xx or error", "p50 ms", "p99 ms"],
        windows(samples, window),
        caption=f"first {args.baseline_s:.0f} s: valid only (the baseline); then {args.hostile_share:.0%} hostile",
    )
    base = [s for s in samples if s.t < args.baseline_s and s.kind == "valid" and s.status == 200]
    mixed = [s for s in samples if s.t >= args.baseline_s and s.kind == "valid" and s.status == 200]

    def p99(xs: list[Sample]) -> str:
        return f"{np.percentile([s.latency_s * 1000 for s in xs], 99):.1f}" if xs else "-"

    print_table("valid requests: baseline vs mixed", ["phase", "requests", "p99 ms"],
                [["valid only", len(base), p99(base)], ["with hostile", len(mixed), p99(mixed)]])  # fmt: skip
    print_table(
        "RSS of every component (MiB)",
        ["process", "before", "after", "growth"],
        [[k, f"{before[k]:.1f}", f"{after.get(k, float('nan')):.1f}", f"{after.get(k, 0) - before[k]:+.1f}"]
         for k in sorted(before)],
    )  # fmt: skip
    hostile = [s for s in samples if s.kind == "hostile"]
    valid = [s for s in samples if s.kind == "valid"]
    errors = {
        "any 5xx or transport error": sum(s.status >= 500 or s.status == 0 for s in samples),
        "hostile not refused with a 4xx": sum(not 400 <= s.status < 500 for s in hostile),
        "valid refused other than 429/503 (load shedding)": sum(
            s.status not in (200, 429, 503) for s in valid
        ),
        "gateway unhealthy after": int(not healthy),
    }
    by_input: dict[str, dict[int, int]] = {}
    for x in hostile:
        per = by_input.setdefault(x.name, {})
        per[x.status] = per.get(x.status, 0) + 1
    print_table("hostile inputs: answers", ["input", "statuses"],
                [[k, ", ".join(f"{st}: {n}" for st, n in sorted(v.items()))] for k, v in sorted(by_input.items())])  # fmt: skip
    print_table("errors (all should be 0)", ["what", "count"], [[k, v] for k, v in errors.items()])
    shed = sum(s.status in (429, 503) for s in valid)
    console.print(f"valid requests shed at saturation (429/503 with Retry-After): {shed} of {len(valid)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
