"""A rollout's shadow phase end to end: real nats-server, control plane, agent and gateway
processes with simulated replicas under steady greedy chat streams (temperature 0).

1. a 50% shadow to a version whose engine flag does not change its output (`seed`): every
   compared copy agrees, the shadow passes and the rollout goes on to its canary steps;
   the key's usage is its own requests only (the copies are shadow records, not charged);
2. a 50% shadow to a version whose output changes from token 1 (the sim's test device
   `text_diverge_at`): agreement 0, below the guard, the rollout stops in the shadow phase
   and no user request ever reached that version (client headers and usage records);
3. the shadow version's replicas SIGKILLed mid-run: 0 client-visible failures.

Simulated replicas, not SmolLM2: a real engine decodes far too slowly on a shared 2-core box
for two rollouts under load in a test's budget; the gateway's shadow path is the same.
The tests share one fleet and run in file order. Figures are printed (pytest -s)."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from datetime import datetime, timezone

import httpx
import pytest

from tests.e2e.sim_fleet import Load, Sampler, SimFleet, kill_trees, serving_fleet, wait_for
from tests.fleetctl import fleetctl

REGION = "local-east"
NAME = "shadowed"
REPLICAS = 2
SIM_ARGS = {"cold_start": 0.2, "max_num_seqs": 16}
GREEDY = {"temperature": 0, "stream": True}  # streams: both sides carry token ids
TOKENS = 6  # output tokens a request asks for: the changed version differs from token 1
DIVERGE_AT = 1
VERDICTS = ("passed", "stopped")
# The latency guards are judged elsewhere (tests/control_plane/rollouts/test_shadow.py); on a
# shared 2-core box a copy's TTFT p90 swings with the load, and these tests judge agreement.
LOOSE_LATENCY = {"shadow_max_ttft_p90_ratio": 20, "shadow_max_itl_p90_ratio": 20}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    home = tmp_path_factory.mktemp("shadow-home")
    with serving_fleet(home, REGION, NAME, REPLICAS, REPLICAS * 4, engine_args=SIM_ARGS) as fleet:
        yield fleet


@pytest.fixture(autouse=True)
def no_rollout_after(fleet):
    """Each test leaves the deployment on one version at full size, whatever it asserted."""
    yield
    end_rollout(fleet)


def rollout(fleet: SimFleet) -> dict:
    return fleet.api("GET", f"/v1/deployments/{NAME}/rollouts/current").json()


def shadow_of(fleet: SimFleet) -> dict:
    return rollout(fleet).get("shadow") or {}


def greedy_load(fleet: SimFleet, key: str | None = None, workers: int = 4) -> Load:
    return Load(
        [fleet.gateways[REGION]], key or fleet.key, NAME, workers=workers, max_tokens=TOKENS, extra=GREEDY
    ).start()


def new_key(fleet: SimFleet, name: str) -> tuple[str, str]:
    """A fresh inference key (its secret, its id): its usage is this test's requests alone."""
    r = fleet.api("POST", "/v1/keys", json={"name": name, "scopes": ["inference"]})
    assert r.status_code == 201, r.text
    secret = r.json()["key"]
    models = f"{fleet.gateways[REGION]}/v1/models"
    wait_for(  # the key reaches the gateway through the keys bucket: load before that is 401
        lambda: httpx.get(models, headers={"authorization": f"Bearer {secret}"}, timeout=5).status_code == 200,
        30, 0.1, "the gateway to know the new key",
    )  # fmt: skip
    return secret, r.json()["key_id"]


def usage_of(fleet: SimFleet, key_id: str) -> tuple[int, int, int]:
    """The key's charged requests and completion tokens, and the shadow copies of its requests
    shown apart (the usage API, last 10 minutes)."""
    r = fleet.api("GET", "/v1/usage", params={"key": key_id, "since": "10m"})
    assert r.status_code == 200, r.text
    rows = [row for row in r.json()["items"] if row["deployment"] == NAME]
    shadow = sum(row["requests"] for row in r.json().get("shadow", []) if row["deployment"] == NAME)
    return sum(row["requests"] for row in rows), sum(row["completion_tokens"] for row in rows), shadow


def records(fleet: SimFleet, since: float) -> list[dict]:
    """The control plane's stored usage records of the deployment since `since` (its database)."""
    db = next(fleet.home.rglob("fleet.db"))
    at = datetime.fromtimestamp(since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")  # as SQLite stores it
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        conn.row_factory = sqlite3.Row
        rows = conn.execute(
            "SELECT * FROM usage_records WHERE deployment = ? AND at >= ?", (NAME, at)
        ).fetchall()
    return [dict(row) for row in rows]


def shadow_metric(fleet: SimFleet, outcome: str) -> float:
    return fleet.gateway_metric(
        REGION, "fleet_gateway_shadow_requests_total", deployment=NAME, outcome=outcome
    )


class BaselineWatch(Sampler):
    """The fewest replicas the baseline held while the shadow phase ran: copies go to
    replicas of their own, never taken from the users' version. Held means placed and not
    draining or stopped; `fewest_ready` is reported beside it, since on a loaded box a
    health blip can turn a held replica not-ready for a moment without the shadow taking it."""

    HELD = ("pending", "starting", "ready")

    def __init__(self, fleet: SimFleet, version: int) -> None:
        self.fleet, self.version = fleet, version
        self.fewest: int | None = None
        self.fewest_ready: int | None = None
        self.samples = 0

    def running(self) -> bool:
        return (rollout(self.fleet).get("shadow") or {}).get("phase") == "running"

    def sample(self) -> None:
        """Counted only when the shadow ran both before and after the placements were read:
        the phase may end between the two reads, and the canary step that follows replaces
        baseline replicas by design."""
        if not self.running():
            return
        placements = self.fleet.deployment(NAME)["placements"]
        if not self.running():
            return
        mine = [p for p in placements if p["version"] == self.version]
        held = sum(p["state"] in self.HELD for p in mine)
        ready = sum(p["state"] == "ready" for p in mine)
        self.fewest = held if self.fewest is None else min(self.fewest, held)
        self.fewest_ready = ready if self.fewest_ready is None else min(self.fewest_ready, ready)
        self.samples += 1


def end_rollout(fleet: SimFleet) -> None:
    """Abort the rollout if it still runs, and wait for the baseline alone at full size."""
    if rollout(fleet).get("active"):
        fleet.api("POST", f"/v1/deployments/{NAME}/rollouts/current/abort")
    wait_for(lambda: not rollout(fleet)["active"], 30, 0.2, "the rollout to end")
    current = fleet.deployment(NAME)["current_version"]
    fleet.wait_versions(NAME, {current: REPLICAS}, 60, "the baseline alone")


def test_identical_shadow_agrees_and_the_rollout_goes_on_to_its_canary_steps(fleet: SimFleet):
    secret, key_id = new_key(fleet, "shadow-identical")
    load = greedy_load(fleet, secret)
    started = time.time()
    baseline = BaselineWatch(fleet, fleet.deployment(NAME)["current_version"]).start()
    try:
        load.served(8, what="the load")
        out = fleetctl(
            fleet.home, "rollout", "start", NAME, "-e", "seed=7", "-e", "cold_start=0.2", "-e", "max_num_seqs=16",
            "--shadow", "50%", "--shadow-duration", "3s", "--shadow-min-requests", "10",
            "--shadow-max-ttft-p90-ratio", "20", "--shadow-max-itl-p90-ratio", "20",
            "--steps", "50,100", "--step-duration", "1s", "--min-requests", "5", "-o", "json",
        )  # fmt: skip
        assert '"canary_version": 2' in out.stdout, out.stdout
        running = wait_for(
            lambda: (s := shadow_of(fleet)).get("phase") == "running" and s, 30, 0.1, "the shadow"
        )
        passed = wait_for(
            lambda: (r := rollout(fleet))["shadow"]["phase"] in VERDICTS and r, 40, 0.2, "its verdict"
        )
        # past the shadow: the canary steps put users on the new version
        wait_for(lambda: any(r.version == "2" for r in load.results), 30, 0.1, "a user on the canary")
    finally:
        results = load.stop()
        baseline.stop()
    shadow = passed["shadow"]
    print(
        f"\n[identical] shadow {shadow['phase']} ({shadow['reason']}): {shadow['copies']} copies of "
        f"{shadow['requests']} requests, greedy {shadow['greedy']}, errors {shadow['errors']}; then "
        f"{passed['phase']} step {passed['step']}; {len(results)} requests, {len(load.failed())} failed; "
        f"baseline held during the shadow: >= {baseline.fewest} of {REPLICAS}, ready >= {baseline.fewest_ready} "
        f"({baseline.samples} samples)"
    )
    assert running["share"] == pytest.approx(0.5)
    assert shadow["phase"] == "passed", shadow
    assert shadow["copies"] > 0 and shadow["errors"]["copy"] == 0
    assert shadow["greedy"]["compared"] > 0 and shadow["greedy"]["agreement"] == 1.0
    assert shadow["greedy"]["identical"] == shadow["greedy"]["compared"]
    assert load.failed() == [], load.failed()[:3]
    assert baseline.samples and baseline.fewest == REPLICAS  # the users' capacity is untouched
    assert "shadow" in fleetctl(fleet.home, "rollout", "status", NAME).stdout.lower()

    # the key is charged for its own requests only; its copies are visible as shadow records
    wait_for(lambda: usage_of(fleet, key_id)[0] >= len(results), 20, 0.2, "the key's usage records")
    time.sleep(1.0)  # a copy's record, were it charged, would arrive with its original's
    requests, tokens, shadow_requests = usage_of(fleet, key_id)
    assert (requests, tokens) == (len(results), TOKENS * len(results))
    stored = [r for r in records(fleet, started) if r["key_id"] == key_id]
    copies = [r for r in stored if r["shadow"]]
    assert copies and all(r["version"] == 2 and r["shadow_of"] for r in copies)
    assert len(stored) - len(copies) == len(results)
    assert shadow_requests == len(copies)  # visible, apart from the charged rows


def test_changed_shadow_stops_the_rollout_before_any_user_reaches_it(fleet: SimFleet):
    before = shadow_metric(fleet, "completed")
    load = greedy_load(fleet)
    started = time.time()
    try:
        load.served(8, what="the load")
        r = fleet.api(
            "POST",
            f"/v1/deployments/{NAME}/rollouts",
            json={
                "spec": {"engine_args": {**SIM_ARGS, "text_diverge_at": DIVERGE_AT}},
                "steps": [50, 100],
                "step_duration_s": 1,
                "min_requests": 5,
                "shadow_share": 0.5,
                "shadow_duration_s": 3,
                "shadow_min_requests": 10,
                **LOOSE_LATENCY,
            },
        )
        assert r.status_code == 201, r.text
        changed = r.json()["canary_version"]
        done = wait_for(
            lambda: (x := rollout(fleet))["shadow"]["phase"] in VERDICTS and not x["active"] and x,
            40,
            0.2,
            "the shadow's verdict",
        )
        time.sleep(0.5)  # requests after the verdict: still none on the changed version
    finally:
        results = load.stop()
    shadow = done["shadow"]
    stored = records(fleet, started)
    on_changed = [r for r in stored if r["version"] == changed and not r["shadow"]]
    print(
        f"\n[changed] shadow {shadow['phase']}: {shadow['reason']}; greedy {shadow['greedy']}; rollout "
        f"{done['phase']} ({done['reason']}); {len(results)} user requests, "
        f"{sum(r.version == str(changed) for r in results)} on v{changed}; "
        f"{shadow_metric(fleet, 'completed') - before:.0f} copies completed"
    )
    assert shadow["phase"] == "stopped", shadow
    assert "agreement" in shadow["reason"], (shadow, done)
    assert shadow["greedy"]["compared"] > 0 and shadow["greedy"]["agreement"] == 0.0
    assert shadow["greedy"]["first_diff_token_p50"] == DIVERGE_AT
    assert done["canary_weight"] == 0 and fleet.deployment(NAME)["current_version"] != changed
    # no user request reached the changed version: not one answer, not one charged record
    assert [r for r in results if r.version == str(changed)] == []
    assert on_changed == [], on_changed[:3]
    copies = [r for r in stored if r["shadow"]]
    assert copies and all(r["version"] == changed for r in copies)
    assert load.failed() == [], load.failed()[:3]


def test_shadow_replicas_killed_mid_run_fail_no_client_request(fleet: SimFleet):
    load = greedy_load(fleet)
    completed = shadow_metric(fleet, "completed")
    try:
        load.served(8, what="the load")
        r = fleet.api(
            "POST",
            f"/v1/deployments/{NAME}/rollouts",
            json={
                "spec": {"engine_args": {**SIM_ARGS, "seed": 9}},
                "steps": [50, 100],
                "step_duration_s": 60,
                "shadow_share": 0.5,
                "shadow_duration_s": 60,
                **LOOSE_LATENCY,
            },
        )
        assert r.status_code == 201, r.text
        version = r.json()["canary_version"]
        wait_for(lambda: shadow_metric(fleet, "completed") >= completed + 5, 30, 0.1, "copies flowing")
        names = {
            f"{REGION}/{p['replica_id']}"
            for p in fleet.deployment(NAME)["placements"]
            if p["version"] == version
        }
        pids = [x.pid for x in fleet.local.replicas(fleet.local.load()) if x.name in names]
        assert pids, (names, fleet.local.replicas(fleet.local.load()))
        lost_before = shadow_metric(fleet, "error") + shadow_metric(fleet, "dropped_busy")
        killed_at = time.time()
        kill_trees(pids)
        load.served(40, since=killed_at, what="requests after the kill")
    finally:
        results = load.stop()
    lost = shadow_metric(fleet, "error") + shadow_metric(fleet, "dropped_busy") - lost_before
    after = [r for r in results if r.started >= killed_at]
    print(
        f"\n[killed shadow] {len(pids)} replicas of v{version} killed; {len(results)} requests "
        f"({len(after)} after the kill), {len(load.failed())} failed; copies failed or dropped {lost:.0f}"
    )
    assert lost > 0  # the kill hit copies: in flight, or sent to the dead replicas
    assert load.failed() == [], load.failed()[:3]
    assert all(r.version != str(version) for r in results)  # users never on the shadow version
    assert httpx.get(f"{fleet.gateways[REGION]}/health", timeout=5).status_code == 200
