"""A hard team budget end to end on a real local fleet (nats-server, control plane with its
loops, agent, gateway; one simulated replica on a pool priced at $1 per GPU-second): the
budget loop sees the team's dollars cross its thresholds, writes one event each, marks the
team's key, the gateway refuses it with 429 insufficient_quota, and raising the budget
serves it again; `fleetctl budgets` against the same control plane. Figures are printed
(pytest -s)."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fleet_base.api_keys import key_id_of
from tests.e2e.sim_fleet import SimFleet, wait_for
from tests.fleetctl import fleetctl

REGION = "local-east"
NAME = "budgeted"
TEAM = "ml"
PER_SECOND = 3600.0  # dollars per node-hour of a 1-GPU node: $1 a second

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = SimFleet(tmp_path_factory.mktemp("budget-home"), [REGION], slots=1,
                     pool={"hourly_price": PER_SECOND, "tier": "on-demand"})  # fmt: skip
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("FLEET_BUDGET_INTERVAL_S", "0.5")  # the loop, not only the PUT, decides
            fleet.up()
        fleet.deploy(NAME, 1, engine_args={"cold_start": 0.1})
        fleet.wait_ready(NAME, 1)
        yield fleet
    finally:
        fleet.down()


def chat(fleet: SimFleet) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {fleet.key}"}
    return httpx.post(f"{fleet.gateways[REGION]}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_a_spent_hard_budget_refuses_the_teams_key_until_it_is_raised(fleet):
    key_id = key_id_of(fleet.key)
    assert fleet.api("PATCH", f"/v1/keys/{key_id}", json={"team": TEAM}).status_code == 200
    assert chat(fleet).status_code == 200  # the team's usage: its share of the replica's dollars

    def spent() -> float | None:  # the usage record reaches the control plane through NATS
        r = fleet.api("PUT", f"/v1/budgets/{TEAM}", json={"monthly_dollars": 1e9})
        return r.json()["spent_dollars"] or None

    now_spent = wait_for(spent, 20, 0.2, "the team's spend")
    budget = now_spent + 4.0  # spent about 4 s from now, by the budget loop
    began = time.monotonic()
    r = fleet.api("PUT", f"/v1/budgets/{TEAM}", json={"monthly_dollars": budget, "hard": True})
    assert r.status_code == 200 and not r.json()["exhausted"], r.text

    refused = wait_for(lambda: (resp := chat(fleet)).status_code == 429 and resp, 30, 0.2, "the 429")
    waited = time.monotonic() - began
    err = refused.json()["error"]
    assert err["type"] == err["code"] == "insufficient_quota" and f"team '{TEAM}'" in err["message"]
    events = fleet.api("GET", "/v1/events", params={"kind": "budget_threshold"}).json()["items"]
    messages = sorted(e["message"] for e in events)
    assert [m.split(":")[0] for m in messages] == [
        f"team {TEAM} reached {p}% of its monthly budget" for p in (100, 50, 80)
    ], messages
    listed = fleet.api("GET", "/v1/budgets").json()["items"][0]
    assert listed["exhausted"] and listed["used_ratio"] >= 1.0 and listed["alerted"] == [0.5, 0.8, 1.0]
    scraped = httpx.get(f"{fleet.api_url}/metrics", timeout=10).text
    assert f'fleet_cost_budget_exhausted{{team="{TEAM}"}} 1.0' in scraped
    assert fleet.gateway_metric(REGION, "fleet_gateway_rate_limited_total", limit="budget") >= 1

    raised = fleet.api("PUT", f"/v1/budgets/{TEAM}", json={"monthly_dollars": 1e9, "hard": True})
    assert raised.status_code == 200 and not raised.json()["exhausted"]
    lifted = time.monotonic()
    wait_for(lambda: chat(fleet).status_code == 200, 30, 0.1, "the key served again")
    print(
        f"\nhard budget ${budget:,.2f} (spent ${now_spent:,.2f} when set, $1/s): refused {waited:.1f} s "
        f"after it was set; served again {time.monotonic() - lifted:.2f} s after it was raised\n"
        + "\n".join(messages)
    )


def test_fleetctl_budgets_set_list_delete(fleet):
    def run(*args: str) -> subprocess.CompletedProcess:
        return fleetctl(fleet.home, *args, env={"COLUMNS": "160"}, check=False)

    set_ = run(
        "budgets", "set", "web", "--monthly", "500", "--hard", "--thresholds", "50,80,100", "-o", "json"
    )
    out = json.loads(set_.stdout)
    assert out["thresholds"] == [0.5, 0.8, 1.0] and out["hard"] is True and out["monthly_dollars"] == 500.0
    with ThreadPoolExecutor(3) as pool:  # independent commands at once: each is mostly start-up
        table, listed, bad = pool.map(
            lambda args: run(*args),
            [
                ("budgets", "list"),
                ("budgets", "list", "-o", "json"),
                ("budgets", "set", "web", "--monthly", "5", "--thresholds", "50,150"),
            ],
        )
    print(f"\n$ fleetctl budgets list\n{table.stdout}")
    assert "web" in table.stdout and "500.00" in table.stdout and "50%, 80%, 100%" in table.stdout
    assert "web" in [b["team"] for b in json.loads(listed.stdout)]
    assert bad.returncode == 1 and "at most 100" in bad.stderr
    assert "deleted the budget of team web" in run("budgets", "delete", "web").stdout
