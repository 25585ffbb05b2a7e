"""Bursts after a lull, with real processes: nats-server, the control plane (default `ours`
policy, autoscale loop every 0.5 s), one agent with the `sim` runtime (replicas timed by
the Llama2-70B H100 profile, a 3 s cold start) and its gateway. An open-loop client sends
bursts of long prompts (~3 req/s of ~10k tokens: work for several replicas) separated by
lulls with no request at all. Each asks for one token, so an answer's time is its TTFT, what
the SLO policy sizes for: a simulated replica prefills first and pauses decoding meanwhile
(as vLLM v0 did), so under a burst a longer answer ends only when the arrivals stop.

The deployment's own scale-down delay is short (2 s), so nothing but the burst memory can
keep replicas through a lull: once the memory has seen two bursts and the gap between
them, it holds the fleet the bursts needed through a lull longer than a cold start plus the
delay plus the window, and the next burst is met by replicas that were kept warm: none is
started between the lull and that burst's first answers. The previous default (the
`concurrency` policy, fed the requests in flight this run saw, with the same settings)
is back at one replica when the burst comes: it would have cold-started the rest.

Phases are driven by what the autoscaler reports on `/metrics` (`fleet_autoscale_bursts`,
`fleet_autoscale_burst_since_seconds`), not by fixed sleeps: its 10 s burst windows start
at its first decision, so a fixed schedule would race them. About 90 s of wall time."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from control_plane.autoscale import AutoscaleSettings, Observation, ScalerState, make_policy
from tests.e2e.sim_fleet import Sampler, SimFleet, wait_for

pytestmark = pytest.mark.slow

DEP = "bursty"
COLD_START_S = 3.0
WINDOW_S = 4.0  # the deployment's autoscale window (stable; panic 1 s)
DELAY_S = 2.0  # the deployment's own scale-down delay: short, for both policies
RATE = 3.0  # requests/s while a burst is on
WORDS = 6000  # ~10k prompt tokens: ~1 s of prefill each on this profile
MAX_REPLICAS = 4
STARTING = ("pending", "starting")  # placement states of a replica not serving yet
GAUGE = re.compile(r"^(fleet_autoscale_[a-z_]+)\{([^}]*)\} (\S+)$")


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    monkeypatch.setenv("FLEET_AUTOSCALE_INTERVAL_S", "0.5")
    monkeypatch.setenv("FLEET_AUTOSCALE_POLICY", "ours")
    f = SimFleet(tmp_path, ["east"], slots=MAX_REPLICAS)
    try:
        yield f.up()
    finally:
        f.down()


@dataclass
class Answer:
    burst: int
    started: float
    ended: float
    status: int


class Bursts:
    """Open-loop arrivals: while a burst is on, a request every 1/RATE s whatever the
    answers (a burst does not slow down for a cold start); none in a lull."""

    def __init__(self, gw: str, key: str) -> None:
        self.gw, self.key = gw, key
        self.burst = 0  # 0: a lull
        self.in_flight = 0
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=48)
        self.futures: list[Future] = []
        self.pacer = threading.Thread(target=self._pace, daemon=True)

    def _pace(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            if self.burst:
                self.futures.append(self.pool.submit(self._one, self.burst))
                next_at += 1 / RATE
            else:
                next_at = time.monotonic() + 0.05
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def _one(self, burst: int) -> None:
        with self.lock:
            self.in_flight += 1
        started, status = time.time(), 0
        try:
            r = httpx.post(
                f"{self.gw}/v1/chat/completions",
                headers={"authorization": f"Bearer {self.key}"},
                json={"model": DEP, "messages": [{"role": "user", "content": "tokens " * WORDS}],
                      "max_tokens": 1},
                timeout=180,
            )  # fmt: skip
            status = r.status_code
        except httpx.HTTPError:
            pass
        finally:
            with self.lock:
                self.in_flight -= 1
                self.answers.append(Answer(burst, started, time.time(), status))

    def on(self, burst: int) -> float:
        self.burst = burst
        return time.time()

    def off(self) -> float:
        self.burst = 0
        return time.time()

    def answered(self, burst: int) -> list[Answer]:
        with self.lock:
            return [a for a in self.answers if a.burst == burst]

    def __enter__(self) -> Bursts:
        self.pacer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.pacer.join(timeout=5)
        self.pool.shutdown(wait=True, cancel_futures=True)


def gauges(fleet: SimFleet) -> dict[str, float]:
    """The control plane's `fleet_autoscale_*` samples for DEP: name (plus `/signal`) -> value."""
    out = {}
    for line in httpx.get(f"{fleet.api_url}/metrics", timeout=5).text.splitlines():
        m = GAUGE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("deployment") == DEP:
            out[m.group(1) + ("/" + labels["signal"] if "signal" in labels else "")] = float(m.group(3))
    return out


@dataclass
class Sample:
    at: float
    desired: int
    ready: frozenset[str]
    starting: frozenset[str]
    held: float | None
    in_flight: int


class Watch(Sampler):
    """The deployment's replicas, the burst fleet held and the client's requests in flight,
    every 0.5 s."""

    interval = 0.5

    def __init__(self, fleet: SimFleet, bursts: Bursts) -> None:
        self.fleet, self.bursts = fleet, bursts
        self.samples: list[Sample] = []

    def sample(self) -> None:
        d = self.fleet.deployment(DEP)
        g = gauges(self.fleet)
        ready = frozenset(p["replica_id"] for p in d["placements"] if p["state"] == "ready")
        others = frozenset(p["replica_id"] for p in d["placements"] if p["state"] in STARTING)
        self.samples.append(Sample(time.time(), d["desired_replicas"], ready, others,
                                   g.get("fleet_autoscale_burst_held_replicas"), self.bursts.in_flight))  # fmt: skip

    def between(self, a: float, b: float) -> list[Sample]:
        return [s for s in list(self.samples) if a <= s.at <= b]

    def fresh(self) -> Sample:
        """A sample taken from now on (the sampler skips a failed one)."""
        now = time.time()
        return wait_for(lambda: next((s for s in reversed(self.samples) if s.at >= now), None), 15, 0.1,
                        "a fresh sample")  # fmt: skip


def ready_events(fleet: SimFleet) -> list[float]:
    items = fleet.api("GET", "/v1/events", params={"deployment": DEP, "kind": "replica_ready", "limit": 200})
    out = []
    for e in items.json()["items"]:
        at = datetime.fromisoformat(e["at"].replace("Z", "+00:00"))
        out.append((at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp())
    return out


def test_a_burst_after_a_lull_is_met_by_replicas_kept_warm(fleet: SimFleet) -> None:
    body = {
        "name": DEP,
        "model": "llama2-70b",
        "engine_args": {"profile": "llama2-70b-h100-tp4", "cold_start": COLD_START_S},
        "gpu_count": 1,
        "min_replicas": 1,
        "max_replicas": MAX_REPLICAS,
        "target_concurrency": 4,
        "autoscale_window_s": WINDOW_S,
        "scale_down_delay_s": DELAY_S,
        "slo_ttft_s": 2.0,
        "slo_itl_s": 0.1,
    }
    r = fleet.api("POST", "/v1/deployments", json=body)
    assert r.status_code == 201, r.text
    wait_for(lambda: fleet.ready_by_version(DEP).get(1) == 1, 60, 0.2, "the first replica")

    phases: dict[str, tuple[float, float]] = {}
    with Bursts(fleet.gateways["east"], fleet.key) as bursts, Watch(fleet, bursts) as watch:
        # Two bursts with a lull between: the memory learns their size and the gap.
        for n in (1, 2):
            start = bursts.on(n)
            wait_for(lambda n=n: gauges(fleet).get("fleet_autoscale_bursts", 0) >= n, 60, 0.5,
                     f"burst {n} in the autoscaler's memory")  # fmt: skip
            end = bursts.off()
            phases[f"burst {n}"] = (start, end)
            wait_for(lambda: 0 < gauges(fleet).get("fleet_autoscale_burst_since_seconds", 0), 60, 0.5,
                     f"burst {n} over (a quiet 10 s window)")  # fmt: skip
            phases[f"lull {n}"] = (end, time.time())

        # The lull goes on past a cold start, the delay and the window: a fleet sized by
        # the load (or by the delay) would be back at one replica by now.
        g = gauges(fleet)
        cold, delay = g["fleet_autoscale_cold_start_seconds"], g["fleet_autoscale_scale_down_delay_seconds"]
        assert delay == DELAY_S and cold >= COLD_START_S
        lull_from = phases["lull 2"][0]
        quiet_s = cold + delay + WINDOW_S + 2
        wait_for(lambda: time.time() - lull_from >= quiet_s
                 and gauges(fleet).get("fleet_autoscale_burst_since_seconds", 0) >= cold + delay, 60, 0.5,
                 "a lull longer than a cold start, the delay and the window")  # fmt: skip
        g = gauges(fleet)
        assert g["fleet_autoscale_burst_hold_seconds"] > g["fleet_autoscale_burst_since_seconds"], g
        warm = watch.fresh()
        phases["lull 2"] = (lull_from, warm.at)

        # The third burst, after the lull.
        start = bursts.on(3)
        wait_for(lambda: len(bursts.answered(3)) >= 9, 60, 0.2, "the burst after the lull answered")
        end = bursts.off()
        phases["burst 3"] = (start, end)
        wait_for(lambda: bursts.in_flight == 0, 120, 0.2, "every request answered")
        # predictions come due one cold start after they are made: their error is exported
        checked = gauges(fleet)
        for signal in ("prompt_tokens_per_s", "requests_per_s"):
            assert f"fleet_autoscale_prediction_mape/{signal}" in checked, checked
            assert f"fleet_autoscale_prediction_observed/{signal}" in checked, checked

    answers = bursts.answers
    assert answers and {a.status for a in answers} == {200}, sorted({a.status for a in answers})
    # The quiet part of the lull: from the first sample with nothing in flight (the second
    # burst's last requests answered; a scale-up they asked for was placed before).
    lull = watch.between(*phases["lull 2"])
    quiet = lull[next((i for i, x in enumerate(lull) if x.in_flight == 0), len(lull)) :]
    assert len(quiet) >= 4, f"{len(lull)} samples in the lull, {len(quiet)} with nothing in flight"
    # Kept warm: the burst fleet held through the whole lull, nothing placed meanwhile.
    assert warm.held is not None and warm.held >= 2, warm
    assert all(x.held is not None and x.held >= 2 and x.desired >= 2 for x in quiet), [
        (x.desired, x.held) for x in quiet
    ]
    assert len(warm.ready) >= warm.held and not warm.starting, warm
    placed = quiet[0].ready | quiet[0].starting
    assert all(x.ready | x.starting <= placed for x in quiet), [sorted(x.ready | x.starting) for x in quiet]
    assert warm.ready <= placed, (sorted(warm.ready), sorted(placed))
    # The burst's first requests were answered within a cold start of its start: before
    # any replica started for it could serve, so by the warm ones.
    early = [a for a in bursts.answered(3) if a.ended <= phases["burst 3"][0] + COLD_START_S]
    assert len(early) >= 2, [(a.started - start, a.ended - start) for a in bursts.answered(3)]
    # The first burst, by contrast, was met with one replica and cold starts.
    started_in_first = [t for t in ready_events(fleet) if phases["burst 1"][0] <= t <= phases["lull 1"][1]]
    assert started_in_first, "the first burst found the fleet at one replica and scaled it up"

    # The previous default, fed the requests in flight this run saw, with the same settings.
    s = AutoscaleSettings(min_replicas=1, max_replicas=MAX_REPLICAS, target_concurrency=4,
                          stable_window_s=WINDOW_S, panic_window_s=1.0, scale_down_delay_s=DELAY_S)  # fmt: skip
    old, state, current = make_policy("concurrency"), ScalerState(), 1
    wanted: dict[float, int] = {}
    for x in list(watch.samples):
        d = old.decide(s, state, Observation(at=x.at, in_flight=x.in_flight, ready=current, current=current))
        current = wanted[x.at] = d.desired
    during_bursts = [n for t, n in wanted.items() if phases["burst 2"][0] <= t <= phases["burst 2"][1]]
    at_third = [n for t, n in wanted.items() if t <= phases["burst 3"][0]][-1]
    assert max(during_bursts) >= 2, "the concurrency policy scales up on the bursts too"
    assert at_third == 1 < warm.held, "it is back at one replica when the burst after the lull comes"

    rows = []
    for name, (a, b) in phases.items():
        seen = watch.between(a, b)
        rows.append(f"{name:8} {b - a:6.1f}s  desired {min((x.desired for x in seen), default=0)}.."
                    f"{max((x.desired for x in seen), default=0)}  ready "
                    f"{min((len(x.ready) for x in seen), default=0)}..{max((len(x.ready) for x in seen), default=0)}"
                    f"  concurrency policy {min((n for t, n in wanted.items() if a <= t <= b), default=0)}.."
                    f"{max((n for t, n in wanted.items() if a <= t <= b), default=0)}")  # fmt: skip
    print("\n" + "\n".join(rows) + f"\nheld {warm.held:g} through a {phases['lull 2'][1] - phases['lull 2'][0]:.1f} s"
          f" lull (cold start {cold:g} s, delay {delay:g} s); {len(early)} answers within a cold start of burst 3")  # fmt: skip
