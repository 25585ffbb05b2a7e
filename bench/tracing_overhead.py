"""What tracing costs on the gateway's request path: the same load through identical
gateway + simulated-replica pairs in one run: tracing off (no OTEL_* env), on with every
request sampled (the default `parentbased_always_on`), and on sampling 10% of requests
(`parentbased_traceidratio`, 0.1), exporting OTLP/HTTP protobuf to a local receiver in its
own process. Batches rotate over the pairs, so a shared box's background load falls on all
alike; prints throughput and latency p50/p99 per mode and their ratios to "off". A second
"off" pair (the control) shows how far two identical pairs differ in the same run: a ratio
within that spread is noise. It never asserts a timing.

    PYTHONPATH=. .venv/bin/python -m bench.tracing_overhead --rounds 4 --requests 200

The replica is a simulated one with a near-zero-time profile (its prefill and decode step
take 1 ms), so the gateway (and the tracing in the gateway and the replica) is most of what
a request costs: the ratio is an upper bound for a real model's requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import console, print_table, run_main
from fleet_base.ports import free_port
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, make_key, peer, replica, route, start_sim

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)
FAST_PROFILE = {
    "name": "bench-fast",
    "description": "a replica whose work takes ~nothing: the request path is what is measured",
    "gpu_model": "sim",
    "gpus_per_replica": 1,
    "hourly_price": 1.0,
    "prefill_tokens": [128.0, 8192.0],
    "prefill_s": [0.001, 0.001],
    "decode_batch": [1.0, 64.0],
    "decode_step_s": [0.001, 0.001],
    "kv_capacity_tokens": 1_000_000,
    "max_num_seqs": 64,
    "max_prefill_tokens": 8192,
    "cold_start_s": 0.0,
    "error_rate": 0.0,
}


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with the OTEL_* variables replaced by `values` for the block (children inherit it)."""
    saved = {k: os.environ.get(k) for k in (*OTEL_VARS, *values)}
    for k in OTEL_VARS:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_ok(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {url}")


@dataclass
class Pair:
    """One gateway and its simulated replica, started with the environment of their mode."""

    mode: str
    gateway: GatewayProcess
    sim: subprocess.Popen[bytes]
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    requests: int = 0
    failed: int = 0

    def stop(self) -> None:
        self.gateway.stop()
        if self.sim.poll() is None:
            os.killpg(self.sim.pid, signal.SIGTERM)
        self.sim.wait(10)


def start_pair(home: Path, mode: str, profile: Path, record) -> Pair:
    proc, sim_url = start_sim("--profile", str(profile), "--max-num-seqs", "64")
    gw = GatewayProcess(
        home / mode.split(",")[0] / str(proc.pid),
        "bench",
        nats_url=f"nats://127.0.0.1:{free_port()}",
        queue_size=256,
    )
    gw.start()
    wait_ok(f"{sim_url}/health")
    gw.write(
        replicas=[replica("r1", sim_url)],
        keys=[record],
        routes=[route(DEPLOYMENT, [peer("bench", gw.url, 0, 0)])],
    )
    return Pair(mode, gw, proc)


async def batch(pair: Pair, secret: str, requests: int, concurrency: int, max_tokens: int) -> None:
    """`requests` streamed chat requests at `concurrency`, each timed to its last byte."""
    body = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": True}  # fmt: skip
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=pair.gateway.url, limits=limits, timeout=60,
                                 headers={"Authorization": f"Bearer {secret}"}) as client:  # fmt: skip

        async def one() -> None:
            async with gate:
                started = time.perf_counter()
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for _ in r.aiter_raw():
                            pass
                        ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    pair.latencies.append(time.perf_counter() - started)
                else:
                    pair.failed += 1

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        pair.seconds += time.perf_counter() - started
        pair.requests += requests


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="batches per mode, alternating off/on")
    p.add_argument("--requests", type=int, default=200, help="requests per batch")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="skip the second tracing-off pair (an A/A control: the run's noise)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fleet-bench-tracing-") as tmp:
        home = Path(tmp)
        profile = home / "fast.json"
        profile.write_text(json.dumps(FAST_PROFILE))
        secret, record = make_key("bench")
        rx_port = free_port()
        receiver = subprocess.Popen(
            [sys.executable, "-m", "tests.tracing_receiver", "--port", str(rx_port)],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            start_new_session=True,
        )
        pairs: list[Pair] = []
        try:
            wait_ok(f"http://127.0.0.1:{rx_port}/count")
            endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rx_port}"}
            sampled = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
            modes = [("off", {}), ("on", endpoint), ("on, 10% sampled", endpoint | sampled)]
            if args.control:
                modes.append(("off (control)", {}))
            for mode, env in modes:
                with environment(env):
                    pairs.append(start_pair(home, mode, profile, record))
            console.print(f"warming up; then {args.rounds} rounds of {args.requests} requests per mode ...")
            for pair in pairs:
                asyncio.run(batch(pair, secret, 2 * args.concurrency, args.concurrency, args.max_tokens))
                pair.latencies.clear()
                pair.seconds, pair.requests, pair.failed = 0.0, 0, 0
            for r in range(args.rounds):
                for pair in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:  # each mode leads in turn
                    asyncio.run(batch(pair, secret, args.requests, args.concurrency, args.max_tokens))
            time.sleep(1.0)  # the last batch's spans reach the receiver
            spans = httpx.get(f"http://127.0.0.1:{rx_port}/count", timeout=5).json()["spans"]
        finally:
            for pair in pairs:
                pair.stop()
            os.killpg(receiver.pid, signal.SIGTERM)
            receiver.wait(10)
    report = report_rows(pairs, spans, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def report_rows(pairs: list[Pair], spans: int, args: argparse.Namespace) -> dict:
    figures: dict[str, dict[str, float]] = {}
    for pair in pairs:
        rps = len(pair.latencies) / pair.seconds if pair.seconds else 0.0
        p50, p99 = pct(pair.latencies, 0.5), pct(pair.latencies, 0.99)
        figures[pair.mode] = {"requests_per_s": rps, "p50_ms": 1000 * (p50 or 0), "p99_ms": 1000 * (p99 or 0),
                              "ok": len(pair.latencies), "failed": pair.failed}  # fmt: skip
    off = figures["off"]
    ratios: dict[str, dict[str, float | None]] = {}
    rows = []
    for mode, f in figures.items():
        ratios[mode] = {
            k: (f[k] / off[k] if off[k] else None) for k in ("requests_per_s", "p50_ms", "p99_ms")
        }
        r = ratios[mode]
        rows.append([f"tracing {mode}", int(f["ok"]), int(f["failed"]), f["requests_per_s"], f["p50_ms"],
                     f["p99_ms"], r["requests_per_s"], r["p50_ms"], r["p99_ms"]])  # fmt: skip
    print_table(
        f"Gateway + simulated replica, {args.rounds} x {args.requests} streamed requests per mode, "
        f"concurrency {args.concurrency}, {args.max_tokens} tokens",
        ["mode", "ok", "failed", "req/s", "p50 ms", "p99 ms", "req/s vs off", "p50 vs off", "p99 vs off"],
        rows,
        caption=f"{spans:,} spans exported. Batches rotate over the pairs in one run; a shared, loaded "
        "machine is noisy.",
    )
    return {"figures": figures, "ratio_to_off": ratios, "spans_exported": spans}


if __name__ == "__main__":
    raise SystemExit(run_main(main))
