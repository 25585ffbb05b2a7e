"""Three control planes on one PostgreSQL database, real processes (nats-server, two
agents + gateways in two regions with simulated replicas) under steady client load:

2. the leader SIGKILLed in the middle of a canary rollout: a new leader within the lease
   + 5 s, the rollout promoted, `fleetctl deploy` through a FLEET_API_URL list (the dead
   instance first) succeeds during the takeover, no replica in two places nor more of the
   deployment than its replicas plus the surge, every successful request stored as one
   usage record, no client failure;
3. the leader SIGSTOPped, a change made through its successor, the old leader resumed:
   none of its writes take effect (the agents keep the successor's desired state), it
   reports that it no longer leads, and says so in its log.

The tests share one fleet and run in file order. Figures are printed (pytest -s)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest

from fleet_base.local_state import LocalState
from fleet_base.protocol import ReplicaState
from tests.control_plane.cp_server import PostgresDatabase, postgres_admin_url
from tests.e2e.sim_fleet import Load, Sampler, SimFleet, wait_for
from tests.fleetctl import fleetctl

EAST, WEST = "local-east", "local-west"
NAME, OTHER = "web", "api"
REPLICAS = 4
SURGE = 1  # the default max_surge, 25% of 4
LEASE_S, RENEW_DEADLINE_S, RETRY_S = 4.0, 3.0, 0.5
SIM_ARGS = {"cold_start": 0.2, "max_num_seqs": 16}

pytestmark = pytest.mark.slow

FIGURES: list[tuple[str, str]] = []


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    db = PostgresDatabase(postgres_admin_url())
    env = {
        "FLEET_DATABASE_URL": db.url,
        "FLEET_LEADER_LEASE_S": str(LEASE_S),
        "FLEET_LEADER_RENEW_DEADLINE_S": str(RENEW_DEADLINE_S),
        "FLEET_LEADER_RETRY_S": str(RETRY_S),
    }
    fleet = SimFleet(
        tmp_path_factory.mktemp("ha-home"), [EAST, WEST], slots=4, control_planes=3, control_plane_env=env
    )
    try:
        fleet.up()
        fleet.deploy(NAME, REPLICAS, min_regions=2, engine_args=SIM_ARGS)
        fleet.wait_ready(NAME, REPLICAS)
        yield fleet
    finally:
        fleet.down()
        db.drop()
        print("\n[control-plane HA] figures")
        for label, value in FIGURES:
            print(f"  {label:<58} {value}")


# ---------------------------------------------------------------------- helpers


def view(url: str, token: str) -> dict:
    r = httpx.get(f"{url}/v1/control-plane", headers={"authorization": f"Bearer {token}"}, timeout=3)
    r.raise_for_status()
    return r.json()


def leader(fleet: SimFleet, exclude: str = "") -> tuple[str, int]:
    """(url, epoch) of the leader as the instance leading says itself (not `exclude`)."""

    def check():
        for url in fleet.control_plane_urls():
            me = view(url, fleet.token)
            if me["is_leader"] and url != exclude:
                return url, me["epoch"]
        return None

    return wait_for(check, 60, 0.05, "a leader")


def record_of(fleet: SimFleet, url: str):
    return next(p for p in fleet.local.load().processes if p.kind == "control-plane" and p.url == url)


def rollout(fleet: SimFleet) -> dict:
    return fleet.api("GET", f"/v1/deployments/{NAME}/rollouts/current").json()


def stored_requests(fleet: SimFleet) -> tuple[int, int]:
    """(requests, errors) of NAME in the stored usage records."""
    items = fleet.api("GET", "/v1/usage", params={"since": "1h", "deployment": NAME}).json()["items"]
    return sum(i["requests"] for i in items), sum(i["errors"] for i in items)


def settled_usage(fleet: SimFleet, want: int) -> tuple[int, int]:
    """The stored usage once it reached `want` requests, read again 3 s later (a late
    duplicate would show then)."""
    wait_for(lambda: stored_requests(fleet)[0] >= want, 60, 0.5, f"{want} usage records")
    time.sleep(3.0)
    return stored_requests(fleet)


class AgentWatch(Sampler):
    """What the agents want and run, sampled from their state files: every cluster a
    replica id was seen in; the peaks of each deployment's replicas wanted, running (and
    wanted), and running or given up but still reported (a replica no longer wanted drains
    its requests, and the agent's snapshot trails its desired state); and each deployment's
    desired replicas by version per sample."""

    interval = 0.1

    def __init__(self, fleet: SimFleet) -> None:
        self.states = {r: LocalState(fleet.local.dir / "clusters" / r / "state") for r in fleet.regions}
        self.clusters: dict[str, set[str]] = defaultdict(set)
        self.peak_version: Counter[tuple[str, int]] = Counter()  # running, by version
        self.peak_wanted: Counter[str] = Counter()
        self.peak_running: Counter[str] = Counter()
        self.peak_leaving: Counter[str] = Counter()  # running or given up, still reported
        self.desired: list[tuple[float, dict[str, Counter[int]], int]] = []  # (time, by deployment, epoch)

    def sample(self) -> None:
        running: Counter[tuple[str, int]] = Counter()
        leaving: Counter[str] = Counter()  # given up (no longer desired, or draining)
        desired: dict[str, Counter[int]] = defaultdict(Counter)
        epoch = 0
        for region, state in self.states.items():
            want = state.load_desired()
            wanted = {spec.replica_id for spec in want.replicas} if want else set()
            for spec in want.replicas if want else []:
                self.clusters[spec.replica_id].add(region)
                desired[spec.deployment][spec.version] += 1
            epoch = max(epoch, want.epoch if want else 0)
            snapshot = state.load_replicas()
            for r in snapshot.replicas if snapshot else []:
                self.clusters[r.replica_id].add(region)
                if r.state == ReplicaState.stopped:
                    continue
                if r.state == ReplicaState.draining or r.replica_id not in wanted:
                    leaving[r.deployment] += 1
                else:
                    running[r.deployment, r.version] += 1
        for key, n in running.items():
            self.peak_version[key] = max(self.peak_version[key], n)
        totals: Counter[str] = Counter()
        for (deployment, _), n in running.items():
            totals[deployment] += n
        for deployment, n in totals.items():
            self.peak_running[deployment] = max(self.peak_running[deployment], n)
            self.peak_leaving[deployment] = max(self.peak_leaving[deployment], n + leaving[deployment])
        for deployment, versions in desired.items():
            self.peak_wanted[deployment] = max(self.peak_wanted[deployment], sum(versions.values()))
        self.desired.append((time.time(), dict(desired), epoch))

    def twice_placed(self) -> dict[str, set[str]]:
        return {rid: where for rid, where in self.clusters.items() if len(where) > 1}


def clients(fleet: SimFleet) -> Load:
    return Load([fleet.gateways[EAST], fleet.gateways[WEST]], fleet.key, NAME, workers=4, pause_s=0.05)


# ---------------------------------------------------------------------- tests


def test_leader_killed_mid_canary(fleet: SimFleet):
    old_url, old_epoch = leader(fleet)
    urls = fleet.control_plane_urls()
    assert len(urls) == 3 and all(view(u, fleet.token)["leader"] for u in urls)
    before, _ = stored_requests(fleet)
    load = clients(fleet).start()
    try:
        with AgentWatch(fleet) as watch:
            load.served(20, what="traffic before the rollout")
            fleetctl(
                fleet.home, "rollout", "start", NAME, "-e", "seed=2", "-e", "cold_start=0.2",
                "-e", "max_num_seqs=16", "--steps", "50,100", "--step-duration", "6s", "--min-requests", "10",
            )  # fmt: skip
            wait_for(lambda: rollout(fleet)["phase"] == "observing", 60, 0.1, "the canary's first step")
            during = rollout(fleet)

            fleet.kill_control_plane(record_of(fleet, old_url).name)
            killed_at = time.monotonic()
            deployed: dict = {}

            def deploy() -> None:  # through the list, the dead instance first
                deployed["result"] = fleetctl(
                    fleet.home, "deploy", OTHER, "--model", "sim", "--replicas", "1", "-e", "cold_start=0.2",
                    env={"FLEET_API_URL": ",".join([old_url, *fleet.control_plane_urls()])}, check=False,
                )  # fmt: skip
                deployed["at"] = time.monotonic() - killed_at

            deployer = threading.Thread(target=deploy, daemon=True)
            deployer.start()
            _, new_epoch = leader(fleet, exclude=old_url)
            takeover_s = time.monotonic() - killed_at
            deployer.join(60)
            end = wait_for(
                lambda: (r := rollout(fleet))["phase"] in ("promoted", "rolled_back") and r,
                120,
                0.2,
                "the end",
            )
            fleet.wait_versions(NAME, {2: REPLICAS}, 60, "the baseline to go")
            fleet.wait_ready(OTHER, 1)
            load.served(20, since=time.time(), what="traffic after the rollout")
    finally:
        results = load.stop()
    ok = sum(r.status == 200 and not r.error for r in results)
    stored, errors = settled_usage(fleet, before + ok)
    result = deployed["result"]
    FIGURES.extend(
        [
            ("SIGKILL: takeover (s), lease + 5 s bound", f"{takeover_s:.1f} (<= {LEASE_S + 5:.0f})"),
            ("SIGKILL: epoch before -> after", f"{old_epoch} -> {new_epoch}"),
            (
                "SIGKILL: fleetctl deploy through the list done at (s)",
                f"{deployed['at']:.1f} (new leader at {takeover_s:.1f})",
            ),
            (
                "SIGKILL: rollout at the kill -> end",
                f"step {during['step']} {during['phase']} -> {end['phase']}",
            ),
            ("SIGKILL: requests / failures", f"{len(results)} / {len(load.failed())}"),
            ("SIGKILL: usage records vs successful requests", f"{stored - before} vs {ok} ({errors} errors)"),
            (
                "SIGKILL: peak web replicas wanted / running / +given up",
                f"{watch.peak_wanted[NAME]} / {watch.peak_running[NAME]} / {watch.peak_leaving[NAME]} "
                f"(bound {REPLICAS + SURGE})",
            ),
            ("SIGKILL: replica ids seen in two clusters", str(len(watch.twice_placed()))),
        ]
    )
    assert takeover_s <= LEASE_S + 5, takeover_s
    assert new_epoch > old_epoch
    assert result.returncode == 0, result.stdout + result.stderr
    assert end["phase"] == "promoted" and end["id"] == during["id"], (
        during,
        end,
    )  # the same rollout, resumed
    assert load.failed() == [], load.failed()[:3]
    assert (stored - before, errors) == (ok, 0)
    assert watch.twice_placed() == {}
    for (deployment, version), n in watch.peak_version.items():
        assert n <= REPLICAS + SURGE, (deployment, version, n)
    assert watch.peak_wanted[NAME] <= REPLICAS + SURGE, watch.peak_wanted
    assert watch.peak_running[NAME] <= REPLICAS + SURGE, watch.peak_running


def test_paused_leader_resumed_after_takeover_writes_nothing(fleet: SimFleet):
    old_url, old_epoch = leader(fleet)
    old = record_of(fleet, old_url)
    log = Path(old.log)
    log_from = log.stat().st_size
    before, _ = stored_requests(fleet)
    load = clients(fleet).start()
    try:
        with AgentWatch(fleet) as watch:
            load.served(20, what="traffic")
            os.kill(old.pid, signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                new_url, new_epoch = leader(fleet, exclude=old_url)
                takeover_s = time.monotonic() - stopped_at
                r = httpx.patch(
                    f"{new_url}/v1/deployments/{OTHER}",
                    json={"replicas": 2, "min_replicas": 2, "max_replicas": 2},
                    headers={"authorization": f"Bearer {fleet.token}"},
                    timeout=10,
                )
                assert r.status_code == 200, r.text
                version = r.json()["current_version"]
                wait_for(
                    lambda: fleet.ready_by_version(OTHER) == {version: 2}, 60, 0.2, "the scaled deployment"
                )
                time.sleep(1.0)
            finally:
                os.kill(old.pid, signal.SIGCONT)
            resumed_at = time.time()
            demoted = wait_for(
                lambda: not view(old_url, fleet.token)["is_leader"] and time.time() - resumed_at, LEASE_S + 5, 0.05,
                "the old leader to say it no longer leads",
            )  # fmt: skip
            time.sleep(6.0)  # the old leader's loops would have written by now
            load.served(20, since=time.time(), what="traffic after the resume")
    finally:
        results = load.stop()
    ok = sum(r.status == 200 and not r.error for r in results)
    stored, errors = settled_usage(fleet, before + ok)
    after_resume = [(at, d.get(OTHER, Counter()), e) for at, d, e in watch.desired if at >= resumed_at]
    wrong = [(d, e) for _, d, e in after_resume if d != Counter({version: 2}) or e < new_epoch]
    told = log.read_bytes()[log_from:].decode(errors="replace")
    demotion = [line for line in told.splitlines() if "no longer leading" in line or "enced" in line]
    refused = sum(fleet.gateway_metric(region, "fleet_agent_fenced_writes_total") for region in fleet.regions)
    FIGURES.extend(
        [
            ("SIGSTOP: takeover (s), lease + 5 s bound", f"{takeover_s:.1f} (<= {LEASE_S + 5:.0f})"),
            ("SIGSTOP: epoch before -> after", f"{old_epoch} -> {new_epoch}"),
            ("SIGSTOP: old leader says is_leader false after SIGCONT (s)", f"{demoted:.2f}"),
            (
                "SIGSTOP: agents' desired-state samples after SIGCONT / wrong",
                f"{len(after_resume)} / {len(wrong)}",
            ),
            ("SIGSTOP: writes refused by the agents (fenced_writes_total)", f"{refused:.0f}"),
            ("SIGSTOP: old leader's log", demotion[0].strip()[-100:] if demotion else "(nothing)"),
            ("SIGSTOP: requests / failures", f"{len(results)} / {len(load.failed())}"),
            ("SIGSTOP: usage records vs successful requests", f"{stored - before} vs {ok} ({errors} errors)"),
        ]
    )
    assert takeover_s <= LEASE_S + 5, takeover_s
    assert len(after_resume) >= 20 and wrong == [], wrong[:3]
    assert demotion or refused > 0, told[-2000:]
    assert load.failed() == [], load.failed()[:3]
    assert (stored - before, errors) == (ok, 0)
    assert watch.twice_placed() == {}
