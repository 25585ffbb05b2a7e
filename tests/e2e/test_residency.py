"""Data residency end to end: a `ca`-bound key is served in `ca` or refused, never moved.

Real processes: nats-server, the control plane, and per cluster an agent (runtime `sim`)
and its gateway. Three clusters in two jurisdictions: `ca-east` and `ca-west` are `ca`,
`us-central` is `us`; from `ca-east` the `us` cluster is the nearer peer, so a request
that ignored residency would leave for the US first. One deployment with no policy of its
own runs a replica in each; one key is bound to `ca`, another is not.

- A `ca`-bound key at the `us` gateway is refused with 403 `residency_violation`.
- A stream of each key runs on `ca-east` when its region is killed: the unbound stream
  migrates to the nearest peer (`us-central`), the bound one only to `ca-west`.
- With both `ca` regions killed, the bound key gets 503 `residency_unavailable` (a reason
  naming residency, Retry-After) while the unbound key fails over to `us-central`.
- No usage record of the bound key names a region outside `ca` (the control plane's
  usage API), while the unbound key's show `us-central`.

One fleet for the module; the tests run in file order (the second kills regions).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from agent.gateway.routing import peer_order
from control_plane.local.fleet import region_coordinates
from fleet_base.protocol import RoutingTable
from tests.e2e.sim_fleet import SimFleet, wait_for

pytestmark = pytest.mark.slow

CA_EAST, US, CA_WEST = "ca-east", "us-central", "ca-west"
# index-based coordinates of unknown region names: ca-east (0, 0), us-central (10, 20),
# ca-west (20, 40): from ca-east the US peer is the nearer one
REGIONS = [CA_EAST, US, CA_WEST]
JURISDICTIONS = {CA_EAST: "ca", US: "us", CA_WEST: "ca"}
NAME = "chat"
STREAM_TOKENS = 160  # ~4.8 s of simulated decode (30 ms a step): it is still running when its region dies


@dataclass
class Keys:
    bound: str
    bound_id: str
    free: str
    free_id: str


@dataclass
class ResidencyFleet:
    fleet: SimFleet
    keys: Keys

    def state(self, region: str, name: str) -> dict:
        path = self.fleet.local.dir / "clusters" / region / "state" / f"{name}.json"
        return json.loads(path.read_text())

    def chat(self, region: str, key: str) -> httpx.Response:
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return httpx.post(
            f"{self.fleet.gateways[region]}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )

    def usage(self, key_id: str, since: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """The key's requests by the region and by the jurisdiction that processed them
        (the usage API), since `since` (time.time()) or over the last 10 minutes."""
        at = "10m" if since is None else datetime.fromtimestamp(since, timezone.utc).isoformat()
        r = self.fleet.api("GET", "/v1/usage", params={"key": key_id, "since": at})
        assert r.status_code == 200, r.text
        regions: dict[str, int] = {}
        labels: dict[str, int] = {}
        for row in r.json()["items"]:
            for name, n in row["regions"].items():
                regions[name] = regions.get(name, 0) + n
            for name, n in row["jurisdictions"].items():
                labels[name] = labels.get(name, 0) + n
        return regions, labels


@pytest.fixture(scope="module")
def rf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ResidencyFleet]:
    home: Path = tmp_path_factory.mktemp("residency") / "home"
    fleet = SimFleet(home, REGIONS, slots=2)
    try:
        fleet.up()
        for cluster, label in JURISDICTIONS.items():
            r = fleet.api("PATCH", f"/v1/clusters/{cluster}", json={"jurisdiction": label})
            assert r.status_code == 200, r.text
            assert r.json()["jurisdiction"] == label
        fleet.deploy(NAME, 3, min_regions=3, engine_args={"cold_start": 0.1})
        keys = []
        for name, residency in (("ca-only", ["ca"]), ("anywhere", None)):
            r = fleet.api(
                "POST", "/v1/keys", json={"name": name, "scopes": ["inference"], "residency": residency}
            )
            assert r.status_code == 201, r.text
            assert r.json().get("residency") == residency, r.json()
            keys += [r.json()["key"], r.json()["key_id"]]
        rf = ResidencyFleet(fleet, Keys(*keys))
        wait_for(
            lambda: sorted(p["cluster"] for p in fleet.deployment(NAME)["placements"] if p["state"] == "ready")
            == sorted(REGIONS),
            60, 0.2, "a ready replica in each cluster",
        )  # fmt: skip

        def synced(region: str) -> bool:
            """The gateway knows its own jurisdiction, every peer's, and the bound key's policy."""
            route = rf.state(region, "routes")["routes"][NAME]
            seen = {c["cluster"]: c.get("jurisdiction") for c in route["clusters"]}
            key = rf.state(region, "keys")["keys"].get(rf.keys.bound_id, {})
            return (
                seen == JURISDICTIONS
                and rf.state(region, "desired").get("jurisdiction") == JURISDICTIONS[region]
                and key.get("residency") == ["ca"]
            )

        for region in REGIONS:
            wait_for(lambda region=region: synced(region), 30, 0.2, f"{region}: jurisdictions and keys")
        yield rf
    finally:
        fleet.down()


def test_a_bound_key_is_refused_outside_its_jurisdiction(rf: ResidencyFleet) -> None:
    r = rf.chat(US, rf.keys.bound)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "residency_violation", error
    assert "residency" in error["message"] and "ca" in error["message"], error

    r = rf.chat(US, rf.keys.free)
    assert r.status_code == 200, r.text
    for region in (CA_EAST, CA_WEST):  # the bound key is served inside ca
        r = rf.chat(region, rf.keys.bound)
        assert r.status_code == 200, r.text
        assert r.headers["x-fleet-cluster"] in (CA_EAST, CA_WEST), r.headers


@dataclass
class Stream:
    """One streamed chat request on a thread: its chunks, in-band errors and end."""

    url: str
    key: str
    status: int = 0
    cluster: str = ""
    chunks: int = 0
    finish: str | None = None
    done: bool = False
    errors: list[str] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": "tell me"}],
            "max_tokens": STREAM_TOKENS,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {self.key}"}
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=60
            ) as r:
                self.status, self.cluster = r.status_code, r.headers.get("x-fleet-cluster", "")
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    payload = json.loads(line.removeprefix("data: "))
                    if "error" in payload:
                        self.errors.append(json.dumps(payload["error"]))
                        continue
                    for choice in payload.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            self.chunks += 1
                        self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as err:
            self.errors.append(f"{type(err).__name__}: {err}")
        finally:
            self.ended.set()


def test_streams_and_failover_never_leave_the_jurisdiction(rf: ResidencyFleet) -> None:
    fleet, keys = rf.fleet, rf.keys
    # from ca-east, the peer a request without residency leaves for first is the US one
    route = RoutingTable.model_validate(rf.state(CA_EAST, "routes")["routes"][NAME])
    order = [c.cluster for c in peer_order(route, CA_EAST, region_coordinates(CA_EAST, 0), CA_EAST)]
    assert order == [US, CA_WEST], order

    # a stream of each key on ca-east when the region dies: each continues on a peer, which
    # records it (the usage records since the streams began are theirs alone)
    started = time.time()
    migrations = fleet.gateway_metric(CA_EAST, "fleet_gateway_stream_migrations_total", deployment=NAME)
    bound = Stream(fleet.gateways[CA_EAST], keys.bound).start()
    free = Stream(fleet.gateways[CA_EAST], keys.free).start()
    wait_for(lambda: bound.chunks >= 2 and free.chunks >= 2, 30, 0.02, "both streams flowing")
    assert bound.cluster == free.cluster == CA_EAST, (bound.cluster, free.cluster)
    fleet.kill_region(CA_EAST)
    for s in (bound, free):
        assert s.ended.wait(60), s
        assert s.status == 200 and s.done and s.finish == "length" and not s.errors, s
    assert (
        fleet.gateway_metric(CA_EAST, "fleet_gateway_stream_migrations_total", deployment=NAME)
        == migrations + 2
    )
    wait_for(lambda: rf.usage(keys.free_id, started)[0], 20, 0.2, "the unbound stream's record")
    assert rf.usage(keys.free_id, started)[0] == {US: 1}  # the nearest peer, without residency
    wait_for(lambda: rf.usage(keys.bound_id, started)[0], 20, 0.2, "the bound stream's record")
    assert rf.usage(keys.bound_id, started) == ({CA_WEST: 1}, {"ca": 1})  # past the nearer US peer

    # both ca regions gone: the bound key is refused with a reason, every time; the unbound
    # key fails over to the US
    fleet.kill_region(CA_WEST)
    answers: list[tuple[int, str, str]] = []

    def ask() -> dict | None:
        r = rf.chat(CA_EAST, keys.bound)
        error = (r.json().get("error") or {}) if r.status_code != 200 else {}
        answers.append((r.status_code, error.get("code", ""), r.headers.get("x-fleet-cluster", "")))
        if r.status_code == 503 and error.get("code") == "residency_unavailable":
            assert r.headers.get("retry-after"), r.headers
            return error
        return None

    try:
        error = wait_for(ask, 30, 0.2, "503 residency_unavailable for the bound key")
    except AssertionError as err:
        raise AssertionError(f"{err}; the last answers {answers[-3:]}") from None
    assert "residency" in error["message"] and "ca" in error["message"], error
    assert [a for a in answers if a[0] == 200] == [], answers  # none served, anywhere
    wait_for(lambda: rf.chat(CA_EAST, keys.free).headers.get("x-fleet-cluster") == US, 30, 0.2,
             "the unbound key failing over to the US")  # fmt: skip
    for _ in range(5):
        assert ask() is not None, answers[-1]

    # no usage record of the bound key shows a region outside ca (every request it made since
    # the streams began recorded); the unbound key's show the US
    made = 1 + len(answers)
    wait_for(
        lambda: sum(rf.usage(keys.bound_id, started)[0].values()) >= made, 20, 0.2, "the bound key's records"
    )
    regions, labels = rf.usage(keys.bound_id)
    assert regions and set(regions) <= {CA_EAST, CA_WEST}, regions
    assert set(labels) == {"ca"}, labels
    free_regions = wait_for(
        lambda: (r := rf.usage(keys.free_id)[0]).get(US, 0) >= 2 and r, 20, 0.2, "the unbound key's records"
    )
    print(f"\n[residency] requests by region: ca-bound key {regions}, unbound key {free_regions}")
