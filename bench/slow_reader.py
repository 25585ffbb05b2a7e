"""Slow readers: what a client that opens streams and reads nothing costs a replica and a
gateway, before and after the bounds (streamed deltas, --max-unread-bytes,
gateway.client_write_timeout_s).

One real SmolLM2 replica, a nats-server and a real gateway (the state files written here,
playing the agent) per scenario. The slow client opens `--streams` chat streams of
`--max-tokens` tokens through the gateway and as many straight at the replica (behind a
gateway, socket buffers hold megabytes before a replica's writes block; the direct ones
stand for a gateway whose buffers are full), each over a socket with a tiny receive window
that it never reads. Meanwhile a well-behaved client sends short requests through the
gateway. Sampled every `--sample-s`: the replica's and gateway's RSS (psutil), the
gateway's slots held (fleet_gateway_in_flight) and the engine's running sequences.

Scenarios: `before` runs the code of `--before-rev` (default: the commit before the bounds
came in) from a `git archive` of it; `off` this code with the bounds made huge; `after`
this code with its defaults. Measures, never asserts. From a checkout:

    nice -n 10 python -m bench.slow_reader --window 60
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.common import mib, print_table, run_main
from bench.soak_abuse import stalled_stream
from control_plane.local.nats_server import NatsServer
from engine.server.process import ROOT, ServerProcess
from tests.agent.gateway.harness import GatewayProcess, make_key, peer, replica, route

DEPLOYMENT = "smollm2"
PROMPT = "Write a very long story about a lighthouse keeper."
HUGE_S = 1e9


@dataclass
class Scenario:
    name: str
    root: Path
    replica_args: list[str]
    gateway: dict[str, float]


@dataclass
class Sample:
    t: float
    replica_mib: float
    gateway_mib: float
    slots: float
    running: float


@dataclass
class Outcome:
    samples: list[Sample] = field(default_factory=list)
    good_ok: int = 0
    good_failed: int = 0
    good_latency: list[float] = field(default_factory=list)
    engine_aborted: float = 0.0
    gateway_ended: float = 0.0
    tokens: float = 0.0


def before_rev() -> str:
    """The commit before the unread-output bound came in."""
    out = subprocess.run(
        ["git", "log", "--reverse", "-S", "max_unread_bytes", "--format=%H", "--", "engine/config.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    rev = f"{out[0]}^" if out else "HEAD"
    return subprocess.run(
        ["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def checkout(rev: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def rss_mib(pid: int) -> float:
    try:
        return mib(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0.0


def run_scenario(sc: Scenario, args: argparse.Namespace, workdir: Path) -> Outcome:
    secret, record = make_key("bench")
    auth = {"Authorization": f"Bearer {secret}"}
    rep = ServerProcess(*sc.replica_args, log_path=workdir / "replica.log", root=sc.root)
    nats = NatsServer(workdir / "nats")
    gw = GatewayProcess(workdir / "gw", "east", nats_url="nats://127.0.0.1:1", root=sc.root, **sc.gateway)
    out = Outcome()
    socks: list[socket.socket] = []
    stop = threading.Event()
    try:
        rep.start(timeout=600)
        nats.start()
        gw.config.nats_url = nats.url
        gw.start(timeout=120)
        gw.write(
            replicas=[replica("r1", rep.url, deployment=DEPLOYMENT)],
            keys=[record],
            routes=[route(DEPLOYMENT, [peer("east", gw.url, 40.7, -74.0)])],
        )
        assert rep.proc is not None and gw.proc is not None
        body = {
            "model": DEPLOYMENT,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "n": args.n,
            "logprobs": args.top_logprobs > 0,
            "top_logprobs": args.top_logprobs or None,
            "stream": True,
        }
        body = {k: v for k, v in body.items() if v is not None}

        def good_client() -> None:
            small = {
                "model": DEPLOYMENT,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 8,
            }
            with httpx.Client(base_url=gw.url, headers=auth, timeout=120) as c:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        ok = c.post("/v1/chat/completions", json=small).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok:
                        out.good_ok += 1
                        out.good_latency.append(time.monotonic() - t0)
                    else:
                        out.good_failed += 1
                    stop.wait(1.0)

        t0 = time.monotonic()
        for _ in range(args.streams):
            socks.append(stalled_stream(gw.url, body, auth))
            socks.append(stalled_stream(rep.url, body, {}))
        good = threading.Thread(target=good_client, daemon=True)
        good.start()
        while (t := time.monotonic() - t0) < args.window:
            g, r = metrics(gw.url), metrics(rep.url)
            out.samples.append(
                Sample(
                    t,
                    rss_mib(rep.proc.pid),
                    rss_mib(gw.proc.pid),
                    value(g, "fleet_gateway_in_flight", deployment=DEPLOYMENT),
                    value(r, "fleet_engine_requests_running", model=DEPLOYMENT),
                )
            )
            time.sleep(args.sample_s)
        stop.set()
        good.join(130)
        r, g = metrics(rep.url), metrics(gw.url)
        out.engine_aborted = value(
            r, "fleet_engine_requests_aborted_total", model=DEPLOYMENT, reason="slow_reader"
        )
        out.tokens = value(r, "fleet_engine_generation_tokens_total", model=DEPLOYMENT)
        out.gateway_ended = value(
            g, "fleet_gateway_streams_aborted_total", deployment=DEPLOYMENT, reason="slow_reader"
        )
        return out
    finally:
        stop.set()
        for s in socks:
            s.close()
        gw.stop()
        rep.stop(timeout=10)
        nats.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slow_reader", description=__doc__)
    p.add_argument(
        "--streams", type=int, default=8, help="slow streams through the gateway, and as many direct"
    )
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--n", type=int, default=1, help="sequences per slow stream")
    p.add_argument("--top-logprobs", type=int, default=5, help="0: none (bigger chunks fill buffers sooner)")
    p.add_argument("--window", type=float, default=60.0, help="seconds observed per scenario")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--scenarios", default="before,after", help="of before, off, after")
    p.add_argument("--before-rev", default=None, help="the code of `before` (default: before the bounds)")
    p.add_argument("--threads", type=int, default=1, help="the replica's torch threads")
    p.add_argument(
        "--after-max-unread-bytes", default=None, help="`after` with this bound (default: the engine's)"
    )
    p.add_argument(
        "--after-write-timeout-s",
        type=float,
        default=None,
        help="`after` with this deadline (default: the gateway's)",
    )
    args = p.parse_args(argv)

    common = ["--served-model-name", DEPLOYMENT, "--max-model-len", str(args.max_tokens + 256)]
    common += ["--threads", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="slow-reader-") as tmp:
        rev = args.before_rev or before_rev()
        after_note = ", ".join(
            f"{k} {v}"
            for k, v in (
                ("unread", args.after_max_unread_bytes),
                ("write timeout s", args.after_write_timeout_s),
            )
            if v
        )
        scenarios = {
            "before": lambda: Scenario(
                f"before ({rev[:12]})", checkout(rev, Path(tmp) / "before"), common, {}
            ),
            "off": lambda: Scenario(
                "bounds off",
                ROOT,
                [*common, "--max-unread-bytes", "1TiB"],
                {"client_write_timeout_s": HUGE_S},
            ),
            "after": lambda: Scenario(
                "after" + (f" ({after_note})" if after_note else " (defaults)"),
                ROOT,
                common
                + (
                    ["--max-unread-bytes", args.after_max_unread_bytes] if args.after_max_unread_bytes else []
                ),
                {"client_write_timeout_s": args.after_write_timeout_s} if args.after_write_timeout_s else {},
            ),
        }
        results: list[tuple[Scenario, Outcome]] = []
        for name in args.scenarios.split(","):
            sc = scenarios[name.strip()]()
            results.append((sc, run_scenario(sc, args, Path(tmp) / f"run-{name}")))

    for sc, o in results:
        step = max(1, round(10 / args.sample_s))
        print_table(
            f"{sc.name}: over time",
            ["t (s)", "replica RSS MiB", "gateway RSS MiB", "gateway slots held", "engine running"],
            [[s.t, s.replica_mib, s.gateway_mib, s.slots, s.running] for s in o.samples[::step]],
        )
    rows = []
    for sc, o in results:
        s0, s1 = o.samples[0], o.samples[-1]
        lat = sorted(o.good_latency)
        rows.append(
            [
                sc.name,
                s0.replica_mib,
                s1.replica_mib,
                max(s.replica_mib for s in o.samples) - s0.replica_mib,
                s1.gateway_mib - s0.gateway_mib,
                max(s.slots for s in o.samples),
                s1.slots,
                s1.running,
                int(o.tokens),
                int(o.engine_aborted),
                int(o.gateway_ended),
                f"{o.good_ok}/{o.good_ok + o.good_failed}",
                lat[len(lat) // 2] if lat else float("nan"),
            ]
        )
    print_table(
        f"Slow readers: {args.streams} streams through the gateway + {args.streams} at the replica, "
        f"{args.max_tokens} tokens, n={args.n}, top_logprobs={args.top_logprobs}, nothing read, "
        f"{args.window:.0f} s",
        ["scenario", "replica RSS start", "end", "peak growth", "gateway RSS growth", "slots held max",
         "slots at end", "engine running at end", "tokens generated", "engine aborted", "gateway ended", "good ok", "good p50 s"],
        rows,
        caption="MiB; slots: fleet_gateway_in_flight; aborted/ended: the slow_reader counters (absent before)",
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
