"""Soak: a local fleet (nats-server, control plane, one agent + gateway, `sim` replicas)
saturated through its gateway, first with valid requests only (the baseline), then with a
mix of valid and hostile ones (seed 2**64, 310-digit max_tokens, deeply nested JSON, lone
surrogates, NaN, broken JSON, bodies over the limit) while attackers press on the
per-participant bounds (bench/soak_abuse.py: streams nobody reads, request heads that never
end, one key flooding every slot, /v1/responses with no output cap). It prints, per time
window, the request counts by outcome and the valid requests' p50/p99 latency; what each
attack met; every process's RSS, sampled through the run, with its growth per hour after
the warm-up; and the error counts that must stay zero (a 5xx for any request, a hostile
request not refused with a 4xx, a valid request refused).

Not part of CI. The long run (two hours, growth read after the first 15 minutes), and a
short look:

    PYTHONPATH=. .venv/bin/python -m bench.soak --duration-s 7200 --heap-profile
    PYTHONPATH=. .venv/bin/python -m bench.soak --duration-s 300 --baseline-s 30 --warmup-s 60
    PYTHONPATH=. .venv/bin/python -m bench.soak --replot /tmp/fleet-soak-rss-XXXX/rss.json --plot rss.png

nats-server's memory steps up once the usage stream reaches its retention limit (its file
store then holds a message-block buffer where it deletes beside the one it writes: 8 MiB
each at the default store, `getMsgBlockBuf` in its heap profile), with no trend in the 7.5
minutes measured after (docs/hardening.md). At the
soak's ~17 records/s and the default 2 GiB store that is about minute 72, inside the
measured window; `--jetstream-store-bytes 67108864` reaches it in the warm-up (every stream
is then smaller, and so are its blocks: the level is lower than the default store's, the
shape the same).

Run it alone on the machine: other work starves the replicas' health probes, the agent
replaces them, and both the error counts and every replica's growth then measure that (the
events table at the end says how many replicas were replaced, and why). The control plane
keeps request samples for canary guards (`UsageWindows`): an hour for a deployment with an
open rollout, five minutes for the others (this soak runs none).

`--heap-profile` starts every Python process of the fleet under tracemalloc
(bench/heap_profile) and prints, for each process that still grows, the allocation sites
whose live memory grew most between the end of the warm-up and the end of the run; for
nats-server, the same from Go's heap profile (`bench.go_heap`, its `--profile` port).

Replicas are simulated (agent/sim: calibrated timing, no model), so the soak exercises
the fleet's own processes; the hostile inputs that only an engine judges (seed) are
refused by the sim replica's request validation as well.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil

from bench import go_heap
from bench.common import console, print_table, run_main
from bench.soak_abuse import Attackers, key_flood, responses_uncapped, slow_reader, slowloris
from fleet_base.jetstream_budget import STORE_ENV, JetStreamBudget
from fleet_base.ports import free_port
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


class RssSampler:
    """Every process's RSS every `every_s` seconds, on a thread, for growth over the run."""

    def __init__(self, fleet: SimFleet, t0: float, every_s: float, nats_profile: int | None = None) -> None:
        self.fleet, self.t0, self.every_s = fleet, t0, every_s
        self.series: list[tuple[float, dict[str, float]]] = []
        self.nats_profile = nats_profile  # also sample nats-server's live Go heap (after a GC)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            sample = rss_of_components(self.fleet)
            heap = go_heap.try_fetch(self.nats_profile)
            if heap is not None and "HeapAlloc" in heap.memstats:
                sample["nats live Go heap"] = heap.memstats["HeapAlloc"] / 2**20
            self.series.append((time.monotonic() - self.t0, sample))
            if self._stop.wait(self.every_s):
                return

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def growth(self, warmup_s: float) -> list[list[object]]:
        """process, RSS at the end of the warm-up, at the end, growth %/h two ways, verdict.
        The verdict reads the Theil-Sen slope (the median of the slopes between every pair
        of samples): one transient spike, a burst of connections that comes and goes, tilts
        a least-squares line for the whole run, while a leak moves every pair. The
        least-squares slope is shown beside it. Both are over the RSS at the warm-up's end."""
        rows = []
        names = sorted({k for _, rss in self.series for k in rss})
        for name in names:
            pts = [(t, rss[name]) for t, rss in self.series if t >= warmup_s and name in rss]
            if len(pts) < 3:
                rows.append([name, "-", "-", "-", "-", "too few samples"])
                continue
            ts, ms = np.array([p[0] for p in pts]) / 3600, np.array([p[1] for p in pts])
            ols = 100 * float(np.polyfit(ts, ms, 1)[0]) / ms[0]
            robust = 100 * theil_sen(ts, ms) / ms[0]
            verdict = "ok" if robust < 2.0 else "GROWS"
            rows.append([name, f"{ms[0]:.1f}", f"{ms[-1]:.1f}", f"{robust:+.2f}", f"{ols:+.2f}", verdict])
        return rows

    def dump(self, path: Path) -> None:
        """The raw samples, for reading a run again without running it again."""
        path.write_text(json.dumps([{"t": t, "rss_mib": rss} for t, rss in self.series]))


def plot_rss(series: list[tuple[float, dict[str, float]]], path: Path, warmup_s: float) -> None:
    """Every process's RSS over the run, relative to its value at the end of the warm-up (so
    the 2 %/h line reads the same for all), with the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    names = sorted({k for _, rss in series for k in rss})
    end_h = max((t for t, _ in series), default=0.0) / 3600
    for name in names:
        pts = [(t / 3600, rss[name]) for t, rss in series if name in rss]
        base = next((m for t, m in pts if t >= warmup_s / 3600), None)
        if not pts or not base:
            continue
        ax.plot([t for t, _ in pts], [100 * (m / base - 1) for _, m in pts], label=f"{name} ({base:.0f} MiB)")
    w = warmup_s / 3600
    ax.axvspan(0, w, color="0.9", label="warm-up")
    ax.plot([w, end_h], [0, 2 * (end_h - w)], "k--", label="2 %/h")
    ax.set_xlabel("hours")
    ax.set_ylabel("RSS vs the end of the warm-up (%)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def theil_sen(xs: np.ndarray, ys: np.ndarray) -> float:
    """The median of the slopes between every pair of points with distinct x."""
    i, j = np.triu_indices(len(xs), k=1)
    dx = xs[j] - xs[i]
    keep = dx != 0
    return float(np.median((ys[j] - ys[i])[keep] / dx[keep]))


def python_pids(fleet: SimFleet) -> list[int]:
    """The fleet's Python processes (never nats-server: SIGUSR2 puts it in lame-duck mode)."""
    state = fleet.local.load()
    pids = []
    for rec in list(state.processes) + fleet.local.replicas(state):
        try:
            procs = [psutil.Process(rec.pid), *psutil.Process(rec.pid).children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                if "python" in proc.name():
                    pids.append(proc.pid)
            except psutil.Error:
                continue
    return pids


def heap_snapshot(fleet: SimFleet) -> None:
    for pid in python_pids(fleet):
        try:
            os.kill(pid, signal.SIGUSR2)
        except OSError:
            continue


def control_plane_counter(fleet: SimFleet, name: str, reason: str) -> int:
    """A counter of the control plane's `/metrics`, summed over the series with `reason`
    (-1 when it cannot be read)."""
    try:
        text = fleet.api("GET", "/metrics").text
    except httpx.HTTPError:
        return -1
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def fleet_events(fleet: SimFleet, most: int = 2000) -> list[dict]:
    """The control plane's events, newest first: replicas started, failed, restarted and
    why, so a run whose replicas churned says so (their RSS growth means nothing then)."""
    try:
        r = fleet.api("GET", "/v1/events", params={"limit": min(most, 1000)})
        return list(r.json()["items"]) if r.status_code == 200 else []
    except (httpx.HTTPError, KeyError, ValueError):
        return []


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
    p.add_argument("--warmup-s", type=float, default=900.0, help="RSS growth is read after this")
    p.add_argument("--rss-every-s", type=float, default=30.0)
    p.add_argument("--slow-readers", type=int, default=2, help="threads opening streams they do not read")
    p.add_argument("--slow-hold-s", type=float, default=60.0, help="how long a slow reader reads nothing")
    p.add_argument("--slowloris", type=int, default=2, help="threads sending never-ending request heads")
    p.add_argument("--flood-burst", type=int, default=16, help="requests at once from the flooding key")
    p.add_argument("--flood-max-concurrent", type=int, default=2, help="the flooding key's max_concurrent")
    p.add_argument("--heap-profile", action="store_true", help="tracemalloc in every Python process")
    p.add_argument("--plot", type=Path, help="a PNG of every process's RSS over the run")
    p.add_argument("--replot", type=Path, help="no run: plot the rss.json of an earlier one (--plot)")
    p.add_argument(
        "--jetstream-store-bytes",
        type=int,
        help="the fleet's JetStream store (FLEET_JETSTREAM_STORE_BYTES): small enough that the usage"
        " stream reaches its retention limit in the warm-up, so nats-server is read at steady state",
    )
    args = p.parse_args(argv)
    if args.replot is not None:
        series = [(x["t"], x["rss_mib"]) for x in json.loads(args.replot.read_text())]
        plot_rss(series, args.plot or args.replot.with_suffix(".png"), args.warmup_s)
        return 0
    window = args.window_s or max(5.0, (args.baseline_s + args.duration_s) / 10)
    if args.jetstream_store_bytes is not None:  # read by fleetctl's config and the control plane
        os.environ[STORE_ENV] = str(JetStreamBudget(store_bytes=args.jetstream_store_bytes).store_bytes)
    profile_dir = Path(tempfile.mkdtemp(prefix="fleet-soak-heap-")) if args.heap_profile else None
    if profile_dir is not None:  # inherited by every process the fleet starts
        os.environ["FLEET_HEAP_PROFILE_DIR"] = str(profile_dir)
        here = str(Path(__file__).resolve().parent / "heap_profile")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))

    nats_prof = free_port() if args.heap_profile else None
    nats_heaps: list[go_heap.GoHeap | None] = []
    out_dir = Path(tempfile.mkdtemp(prefix="fleet-soak-rss-"))
    with tempfile.TemporaryDirectory(prefix="fleet-soak-") as tmp:
        fleet = SimFleet(
            Path(tmp) / "home", [REGION], slots=max(2, args.replicas), nats_profile_port=nats_prof
        )
        try:
            fleet.up()
            r = fleet.api("POST", "/v1/deployments", json={"name": NAME, "model": "sim", "replicas": args.replicas,
                                                           "engine_args": {"cold_start": 0.2}})  # fmt: skip
            r.raise_for_status()
            wait_for(lambda: sum(p["state"] == "ready" for p in fleet.deployment(NAME)["placements"])
                     == args.replicas, 120, 0.2, "replicas ready")  # fmt: skip
            flood_key = fleet.api("POST", "/v1/keys", json={
                "name": "flood", "scopes": ["inference"], "quotas": {"max_concurrent": args.flood_max_concurrent},
            }).json()["key"]  # fmt: skip
            url = fleet.gateways[REGION]
            before = rss_of_components(fleet)
            load = Load(url, fleet.key, args.workers, 0.0).start()
            rss = RssSampler(fleet, load.t0, args.rss_every_s, nats_prof).start()
            attackers = Attackers(load.t0)
            attackers.add(
                "slow reader", slow_reader(url, fleet.key, NAME, args.slow_hold_s), args.slow_readers
            )
            attackers.add("slowloris", slowloris(url, give_up_s=120), args.slowloris)
            attackers.add("key flood", key_flood(url, flood_key, NAME, args.flood_burst), 1)
            attackers.add("responses uncapped", responses_uncapped(url, fleet.key, NAME), 1)
            console.print(f"baseline: {args.workers} workers, valid requests only, {args.baseline_s:.0f} s")
            time.sleep(args.baseline_s)
            load.hostile_share = args.hostile_share
            attackers.start()
            console.print(
                f"mixed: {args.hostile_share:.0%} hostile requests and the attackers, {args.duration_s:.0f} s"
            )
            warm_at = load.t0 + args.warmup_s
            if profile_dir is not None:
                time.sleep(max(0.0, warm_at - time.monotonic()))
                heap_snapshot(fleet)  # tracing starts: what is still alive at the end is growth
                nats_heaps.append(go_heap.try_fetch(nats_prof))
            time.sleep(max(0.0, load.t0 + args.baseline_s + args.duration_s - time.monotonic()))
            if profile_dir is not None:
                heap_snapshot(fleet)
                nats_heaps.append(go_heap.try_fetch(nats_prof))
                time.sleep(5)  # each process writes its own file
            rss.stop()  # before the load winds down: its last samples are of the mix
            load.stop()
            attackers.stop()
            after = rss_of_components(fleet)
            healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
            events = fleet_events(fleet)
            db_refused = control_plane_counter(
                fleet, "fleet_control_plane_rejected_messages_total", "database"
            )
        finally:
            fleet.down()
            # the fleet's logs outlive the run (its home is temporary): why a replica was
            # replaced or a cluster declared silent is read there
            shutil.copytree(Path(tmp) / "home" / "local" / "logs", out_dir / "logs", dirs_exist_ok=True)

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
    growth = rss.growth(args.warmup_s)
    series_out = out_dir / "rss.json"
    rss.dump(series_out)
    if args.plot is not None:
        plot_rss(rss.series, args.plot, args.warmup_s)
    print_table(
        f"RSS growth after the first {args.warmup_s:.0f} s (sampled every {args.rss_every_s:.0f} s)",
        [
            "process",
            "MiB at warm-up",
            "MiB at end",
            "growth %/h (Theil-Sen)",
            "least squares %/h",
            "under 2%/h",
        ],
        growth,
    )
    print_table("attacks: what each met", ["attack", "outcome", "count", "median s"], attackers.table())
    if len(nats_heaps) == 2 and None not in nats_heaps:
        print_table("nats-server: Go runtime memory (MiB; NumGC a count), warm-up vs end",
                    ["MemStats", "warm-up", "end"], go_heap.memstats_rows(*nats_heaps))  # fmt: skip
        print_table("nats-server: live heap by allocation site (MiB, sampled and scaled), warm-up vs end",
                    ["site <- caller", "warm-up", "end", "growth"], go_heap.growth(*nats_heaps))  # fmt: skip
    if profile_dir is not None:
        growing = [row[0] for row in growth if row[-1] == "GROWS"]
        for path in sorted(profile_dir.glob("*.txt")):
            text = path.read_text()
            if growing and not any(str(name).split()[0] in text for name in growing):
                continue
            console.print(f"[bold]heap growth, pid {path.stem}[/bold] (allocation sites, end vs warm-up)")
            heads = ("==", "glibc:", "python:", "live objects", "live exceptions", "live sockets")
            console.print("\n".join(line for line in text.splitlines() if line.startswith(heads)))
            last = text.rsplit("MiB allocated since tracing began", 1)
            if len(last) == 2:  # the biggest sites of the last snapshot come first
                console.print("\n".join(last[1].splitlines()[1:61]))
    hostile = [s for s in samples if s.kind == "hostile"]
    valid = [s for s in samples if s.kind == "valid"]
    errors = {
        "any 5xx or transport error": sum(s.status >= 500 or s.status == 0 for s in samples),
        "attack met a 5xx or transport error": attackers.errors(),
        "slowloris connection held open past 120 s": sum(
            s.outcome == "held open" for s in attackers.samples if s.attack == "slowloris"
        ),
        "process growing >= 2%/h after the warm-up": sum(
            row[-1] == "GROWS" and row[0] != "nats live Go heap" for row in growth
        ),
        "hostile not refused with a 4xx": sum(not 400 <= s.status < 500 for s in hostile),
        "valid refused other than 429/503 (load shedding)": sum(
            s.status not in (200, 429, 503) for s in valid
        ),
        "gateway unhealthy after": int(not healthy),
        "reports the control plane's database refused": db_refused,
    }
    by_input: dict[str, dict[int, int]] = {}
    for x in hostile:
        per = by_input.setdefault(x.name, {})
        per[x.status] = per.get(x.status, 0) + 1
    print_table("hostile inputs: answers", ["input", "statuses"],
                [[k, ", ".join(f"{st}: {n}" for st, n in sorted(v.items()))] for k, v in sorted(by_input.items())])  # fmt: skip
    print_table("errors (all should be 0)", ["what", "count"], [[k, v] for k, v in errors.items()])
    failed = collections.Counter(s.status for s in samples if s.status >= 500 or s.status == 0)
    if failed:
        print_table("5xx and transport errors by status (0: transport)", ["status", "count"],
                    [[st, n] for st, n in sorted(failed.items())])  # fmt: skip
    kinds = collections.Counter(e["kind"] for e in events)
    print_table("the fleet's events during the run (replicas replaced: why)", ["kind", "count", "last message"],
                [[k, n, next(e["message"] for e in events if e["kind"] == k)[-160:]]
                 for k, n in kinds.most_common()])  # fmt: skip
    shed = sum(s.status in (429, 503) for s in valid)
    console.print(f"valid requests shed at saturation (429/503 with Retry-After): {shed} of {len(valid)}")
    console.print(f"RSS samples of every process: {series_out}; the fleet's logs: {out_dir / 'logs'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
