"""A version's `scale_down_delay_s` left unset (null): the API stores null instead of a fixed
300 s, a user's value still wins, an explicit null in an update goes back to derived; the
live SLO policy then derives the delay from the cold start, the Knative-like policies keep
holding 300 s; `fleetctl` and the console say "derived"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from control_plane.autoscale.observe import settings_of
from control_plane.autoscale.policy import UNSET_SCALE_DOWN_DELAY_S, Observation, ScalerState, make_policy
from control_plane.console.web import templates
from control_plane.db.models import DeploymentVersion
from tests.control_plane.test_deployment_engine import Api, api, deploy, fleetctl  # noqa: F401


@pytest.fixture
def admin(api: Api) -> Iterator[TestClient]:  # noqa: F811
    with api.client() as client:
        yield client


def test_unset_is_null_a_given_delay_wins_and_null_goes_back_to_derived(admin) -> None:
    made = deploy(admin, "chat", model="smollm2-135m", min_replicas=1, max_replicas=4)
    assert made["spec"]["scale_down_delay_s"] is None
    assert admin.get("/v1/deployments/chat/versions/1").json()["scale_down_delay_s"] is None
    assert deploy(admin, "code", model="m", scale_down_delay_s=45.0)["spec"]["scale_down_delay_s"] == 45.0
    r = admin.patch("/v1/deployments/code", json={"max_replicas": 6})
    assert r.status_code == 200, r.text
    assert admin.get("/v1/deployments/code/versions/2").json()["scale_down_delay_s"] == 45.0  # kept
    r = admin.patch("/v1/deployments/code", json={"scale_down_delay_s": None})
    assert r.status_code == 200, r.text
    assert admin.get("/v1/deployments/code/versions/3").json()["scale_down_delay_s"] is None


def _version(delay: float | None) -> DeploymentVersion:
    return DeploymentVersion(version=1, model="m", min_replicas=1, max_replicas=8, autoscale_window_s=60.0,
                             scale_down_delay_s=delay, target_concurrency=8.0, scale_to_zero=False,
                             engine_args={"profile": "llama2-70b-h100-tp4", "cold_start": 40})  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "delay", "expected"),
    [("ours", None, None), ("slo", None, None), ("kpa", None, UNSET_SCALE_DOWN_DELAY_S),
     ("concurrency", None, UNSET_SCALE_DOWN_DELAY_S), ("ours", 45.0, 45.0), ("kpa", 45.0, 45.0)],
)  # fmt: skip
def test_settings_leave_the_delay_to_the_policy_that_derives_it(policy, delay, expected) -> None:
    assert settings_of(_version(delay), policy).scale_down_delay_s == expected


@pytest.mark.parametrize(("delay", "expected"), [(None, 40.0 + 60.0), (45.0, 45.0)])
def test_the_live_slo_policy_holds_for_the_derived_delay(delay, expected) -> None:
    settings = settings_of(_version(delay), "ours")
    obs = Observation(at=1000.0, in_flight=4, ready=2, current=2, requests_per_s=1.0,
                      prompt_tokens_per_s=1000.0, output_tokens_per_s=100.0, cold_start_s=40.0)  # fmt: skip
    decision = make_policy("ours").decide(settings, ScalerState(), obs)
    assert decision.predicted["scale_down_delay_s"] == expected


def test_a_policy_without_a_profile_holds_the_unset_delay() -> None:
    """The SLO policy's concurrency fallback derives nothing: it holds 300 s, as before."""
    settings = settings_of(SimpleNamespace(min_replicas=1, max_replicas=8, scale_down_delay_s=None), "ours")
    state, policy = ScalerState(), make_policy("ours")
    policy.decide(settings, state, Observation(at=0.0, in_flight=64, ready=8, current=8))
    late = policy.decide(settings, state, Observation(at=250.0, in_flight=0, ready=8, current=8))
    assert late.desired == 8 and f"{UNSET_SCALE_DOWN_DELAY_S:g}s scale-down delay" in late.reason


def test_fleetctl_shows_derived_and_json_keeps_null(fleetctl) -> None:  # noqa: F811
    assert (
        fleetctl("deploy", "chat", "--model", "m", "--min-replicas", "1", "--max-replicas", "3").exit_code
        == 0
    )
    table = fleetctl("status", "chat")
    assert table.exit_code == 0, table.output
    assert "down delay" in table.output and "derived" in table.output
    raw = json.loads(fleetctl("status", "chat", "-o", "json").output)
    assert raw["versions"][0]["scale_down_delay_s"] is None


def test_console_versions_show_derived_or_the_set_delay() -> None:
    def version(n: int, delay: float | None) -> dict:
        return {"version": n, "model": "m", "engine": "fleet", "engine_args": {}, "gpu_count": 1,
                "gpu_models": [], "replicas": 1, "created_at": None, "current": n == 2,
                "scale_down_delay_s": delay}  # fmt: skip

    status = {"model": "m", "engine": "fleet", "current_version": 2, "ready_replicas": 1, "desired_replicas": 1,
              "min_replicas": 1, "max_replicas": 3, "placements": [], "versions": [version(1, 45.0), version(2, None)]}  # fmt: skip
    plan = {
        "live": True,
        "cold_start_s": 40.0,
        "scale_down_delay_s": 100.0,
        "errors": [],
        "requests_per_s": None,
        "burst_hold_s": None,
        "burst_since_s": None,
        "burst_gap_s": None,
    }
    html = templates.env.get_template("_deployment.html").render(
        d={"status": status, "rollout": None, "decisions": [], "cold_starts": [], "autoscaler": plan},
        name="chat",
    )
    assert '<td class="delay">derived</td>' in html and '<td class="delay">45 s</td>' in html
    assert "a scale-down delay of <strong>100 s</strong> (derived" in html
