"""The control plane down under traffic through two gateways, then back: the usage it
stores equals, exactly, the tokens the clients were told they used (no record lost while
it was down, none counted twice after), and the agents' events of that window are there
(a replica killed during the outage: its failure and restart).

FLEET_TEST_OUTAGE_S sets how long it stays down (default 10 s; the issue's figure is 60)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import datetime

import httpx
import psutil
import pytest

from tests.control_plane.cp_server import SHORT_LEASE_ENV
from tests.e2e.sim_fleet import SimFleet, Workers, wait_for

EAST, WEST = "local-east", "local-west"
NAME = "acct"
OUTAGE_S = float(os.environ.get("FLEET_TEST_OUTAGE_S", "10"))

pytestmark = pytest.mark.slow


class Clients(Workers):
    """Steady chat load over both gateways; remembers the usage each 200 reported."""

    def __init__(self, gateways: list[str], key: str, workers: int = 4) -> None:
        self.gateways, self.key = gateways, key
        self.tokens = 0
        self.ok = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.workers = workers

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=30, headers={"authorization": f"Bearer {self.key}"}) as client:
            while not self._stop.is_set():
                gateway = self.gateways[i % len(self.gateways)]
                i += 1
                body = {"model": NAME, "messages": [{"role": "user", "content": "hello " * (i % 7 + 1)}],
                        "max_tokens": 1 + i % 5, "user": uuid.uuid4().hex}  # fmt: skip
                try:
                    r = client.post(f"{gateway}/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    with self._lock:
                        self.failed += 1
                    continue
                with self._lock:
                    if r.status_code == 200:
                        self.ok += 1
                        self.tokens += r.json()["usage"]["total_tokens"]
                    else:
                        self.failed += 1


def _stored(fleet: SimFleet) -> tuple[int, int]:
    """(successful requests, tokens) in the database, as `fleetctl usage` reads them."""
    items = fleet.api("GET", "/v1/usage", params={"since": "1h", "deployment": NAME}).json()["items"]
    return sum(i["requests"] - i["errors"] for i in items), sum(i["total_tokens"] for i in items)


def _at(event: dict) -> float:
    return datetime.fromisoformat(str(event["at"]).replace("Z", "+00:00")).timestamp()


def test_usage_while_the_control_plane_is_down_is_stored_exactly_once(tmp_path):
    fleet = SimFleet(tmp_path / "home", [EAST, WEST], slots=3, control_plane_env=SHORT_LEASE_ENV)
    try:
        fleet.up()
        fleet.deploy(NAME, 2, min_regions=2, engine_args={"cold_start": 0.2})
        wait_for(lambda: sum(p["state"] == "ready" for p in fleet.deployment(NAME)["placements"]) == 2,
                 60, 0.2, "two ready replicas")  # fmt: skip
        clients = Clients([fleet.gateways[EAST], fleet.gateways[WEST]], fleet.key).start()
        try:
            wait_for(lambda: clients.ok >= 20, 30, 0.1, "traffic")
            port = fleet.kill_control_plane()  # kill -9, under traffic
            down_at = time.monotonic()
            served_before = clients.ok
            # agent events while it is down: a replica of east dies and is restarted
            victim = next(
                r for r in fleet.local.replicas(fleet.local.load()) if r.name.startswith(f"{EAST}/")
            )
            psutil.Process(victim.pid).kill()
            killed_at = time.time()
            time.sleep(OUTAGE_S)
            served_down = clients.ok - served_before
            fleet.start_control_plane(port=port)
            down_s = time.monotonic() - down_at
            served_after = clients.ok
            wait_for(lambda: clients.ok >= served_after + 20, 30, 0.1, "traffic after the restart")
        finally:
            clients.stop()
        assert served_down > 0
        stored = wait_for(lambda: (s := _stored(fleet))[0] >= clients.ok and s, 60, 0.5, "usage stored")
        time.sleep(3.0)  # anything late would be a double count
        assert _stored(fleet) == (clients.ok, clients.tokens), (stored, clients.ok, clients.tokens)
        victim_id = victim.name.split("/", 1)[1]

        def window_kinds() -> set[str]:
            items = fleet.api("GET", "/v1/events", params={"limit": 500}).json()["items"]
            return {e["kind"] for e in items if e.get("replica_id") == victim_id and _at(e) >= killed_at - 1}

        kinds = wait_for(lambda: (k := window_kinds()) >= {"replica_failed"} and k, 30, 0.5, "outage events")
        print(
            f"\ncontrol plane down {down_s:.1f} s, {served_down} requests served meanwhile; "
            f"usage rows {clients.ok} and tokens {clients.tokens} equal what the clients received; "
            f"events of the window: {sorted(kinds)}; {clients.failed} client errors (the killed replica)"
        )
    finally:
        fleet.down()
