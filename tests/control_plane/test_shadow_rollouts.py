"""A rollout with a shadow phase over the real API and fleetctl (one SQLite server, no
loops): the fields validated with a clear 4xx, the `shadow` object of the rollout's JSON,
`fleetctl rollout start --shadow 10% --shadow-duration 10m` and `status` showing it."""

from __future__ import annotations

import json
import uuid

import pytest

from control_plane.console.web import templates
from control_plane.db.session import make_sessions
from control_plane.loops.usage import store_records
from fleet_base.protocol import UsageRecord
from tests.control_plane.cp_server import ControlPlaneServer
from tests.fleetctl import fleetctl


@pytest.fixture(scope="module")
def server(sqlite_server: ControlPlaneServer) -> ControlPlaneServer:
    return sqlite_server


@pytest.fixture(scope="module")
def admin(server):
    with server.client() as client:
        yield client


def _deploy(admin) -> str:
    name = f"sh-{uuid.uuid4().hex[:8]}"
    r = admin.post("/v1/deployments", json={"name": name, "model": "tiny-a", "replicas": 10})
    assert r.status_code == 201, r.text
    return name


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"shadow_share": 0}, "shadow_share"),
        ({"shadow_share": 1.5}, "shadow_share"),
        ({"shadow_share": "lots"}, "shadow_share"),
        ({"shadow_share": 0.1, "shadow_duration_s": -5}, "shadow_duration_s"),
        ({"shadow_duration_s": 60}, "shadow_duration_s"),  # a duration without a share
        ({"shadow_share": 0.1, "shadow_min_greedy_agreement": 2}, "shadow_min_greedy_agreement"),
    ],
)
def test_bad_shadow_fields_are_a_4xx_naming_the_field(admin, body, field):
    name = _deploy(admin)
    r = admin.post(f"/v1/deployments/{name}/rollouts", json={"spec": {"model": "tiny-b"}, **body})
    assert r.status_code in (400, 422), r.text
    assert field in r.text


def test_a_shadow_rollout_starts_shadowing_with_no_user_weight(admin):
    name = _deploy(admin)
    r = admin.post(
        f"/v1/deployments/{name}/rollouts",
        json={"spec": {"model": "tiny-b"}, "steps": [10, 100], "shadow_share": 0.25, "shadow_duration_s": 90},
    )
    assert r.status_code == 201, r.text
    ro = r.json()
    assert (ro["phase"], ro["canary_weight"], ro["canary_replicas"]) == ("shadowing", 0, 1)
    shadow = ro["shadow"]
    assert (shadow["share"], shadow["duration_s"], shadow["phase"], shadow["reason"]) == (
        0.25,
        90,
        "running",
        "",
    )
    assert shadow["errors"] == {"original": None, "copy": None}
    assert set(shadow["greedy"]) == {"compared", "identical", "agreement", "first_diff_token_p50"}
    aborted = admin.post(f"/v1/deployments/{name}/rollouts/current/abort").json()
    assert aborted["shadow"]["phase"] == "stopped" and "aborted by" in aborted["shadow"]["reason"]
    plain = admin.post(f"/v1/deployments/{name}/rollouts", json={"version": 2}).json()
    assert plain["shadow"] is None and plain["phase"] == "deploying"


def test_fleetctl_starts_a_shadow_phase_and_status_shows_it(server, admin):
    name = _deploy(admin)
    home = server.home
    env = {"COLUMNS": "200"}
    out = fleetctl(
        home, "rollout", "start", name, "-e", "seed=2", "--shadow", "10%", "--shadow-duration", "10m", env=env
    )
    assert "shadow phase: running, 10% of requests for 600s" in out.stdout
    got = json.loads(fleetctl(home, "rollout", "status", name, "-o", "json").stdout)
    assert (got["phase"], got["shadow"]["share"], got["shadow"]["duration_s"]) == ("shadowing", 0.1, 600)
    table = fleetctl(home, "rollout", "status", name, env=env).stdout
    for word in ("TTFT p90 (s)", "ITL p50 (s)", "greedy identical", "original", "copy"):
        assert word in table


def test_the_console_rollout_page_shows_the_comparison():
    """The template the console's rollout page renders, given a rollout in its shadow phase."""
    shadow = {
        "share": 0.1, "duration_s": 600, "phase": "stopped", "reason": "shadow greedy agreement 1/4 = 0.250 below 0.9",
        "requests": 40, "copies": 4, "dropped": 0, "compared": 4, "errors": {"original": 0, "copy": 1},
        "ttft_p50_s": {"original": 0.1, "copy": 0.2}, "ttft_p90_s": {"original": 0.3, "copy": 0.4},
        "itl_p50_s": {"original": None, "copy": None}, "itl_p90_s": {"original": None, "copy": None},
        "greedy": {"compared": 4, "identical": 1, "agreement": 0.25, "first_diff_token_p50": 7},
    }  # fmt: skip
    current = {
        "baseline_version": 1, "canary_version": 2, "phase": "rolled_back", "step": 1, "steps": [10, 100],
        "canary_weight": 0, "canary_replicas": 0, "reason": "stopped in the shadow phase", "last": {}, "active": False,
        "params": {"shadow_min_requests": 20}, "shadow": shadow,
    }  # fmt: skip
    html = templates.env.get_template("_rollout.html").render(
        r={"current": current, "timeline": [], "history": []}, name="web", session={}, csrf=""
    )
    assert "Shadow phase" in html and "agreement 25.0%" in html and "first differing token p50 7" in html
    assert "below 0.9" in html and "<td>0.4</td>" in html


def test_fleetctl_usage_lists_shadow_copies_apart(server):
    dep = f"sh-{uuid.uuid4().hex[:8]}"
    original = UsageRecord(cluster="east", key_id="k-sh", deployment=dep, version=1, prompt_tokens=7)
    copy = UsageRecord(
        cluster="east", key_id="k-sh", deployment=dep, version=2, prompt_tokens=7, completion_tokens=99,
        shadow=True, shadow_of=original.record_id,
    )  # fmt: skip
    store_records(make_sessions(server.database_url), [original, copy])
    report = json.loads(fleetctl(server.home, "usage", "--deployment", dep, "-o", "json").stdout)
    assert [(i["key_id"], i["total_tokens"]) for i in report["items"]] == [("k-sh", 7)]
    assert [(r["version"], r["completion_tokens"]) for r in report["shadow"]] == [(2, 99)]
    table = fleetctl(server.home, "usage", "--deployment", dep, env={"COLUMNS": "200"}).stdout
    assert "shadow usage (copies, charged to no key)" in table
