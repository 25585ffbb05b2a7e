"""Rollout routes over real HTTP against a real server process (no loops: the API alone):
start (new spec or existing version), one active rollout per deployment, bad input as
4xx naming the field, promote/abort by hand, and the deployment guarded meanwhile."""

from __future__ import annotations

import uuid

import pytest


def _deploy(admin, replicas: int = 2) -> str:
    name = f"ro-{uuid.uuid4().hex[:8]}"
    r = admin.post("/v1/deployments", json={"name": name, "model": "tiny-a", "replicas": replicas})
    assert r.status_code == 201, r.text
    return name


def test_start_with_a_new_spec_keeps_the_baseline_current_until_promoted(admin):
    name = _deploy(admin)
    r = admin.post(
        f"/v1/deployments/{name}/rollouts",
        json={"spec": {"model": "tiny-b"}, "steps": [10, 50, 100], "step_duration_s": 5, "min_requests": 3},
    )
    assert r.status_code == 201, r.text
    ro = r.json()
    assert (ro["baseline_version"], ro["canary_version"], ro["phase"], ro["active"]) == (
        1,
        2,
        "deploying",
        True,
    )
    assert ro["step"] == 1 and ro["steps"] == [10, 50, 100]
    assert ro["canary_weight"] == 0 and ro["canary_replicas"] == 1  # 10% of 2 replicas -> 1
    dep = admin.get(f"/v1/deployments/{name}").json()
    assert dep["current_version"] == 1
    assert [v["version"] for v in dep["versions"]] == [1, 2]

    again = admin.post(f"/v1/deployments/{name}/rollouts", json={"version": 2})
    assert again.status_code == 409 and again.json()["error"]["field"] == "deployment"
    patch = admin.patch(f"/v1/deployments/{name}", json={"model": "tiny-c"})
    assert patch.status_code == 409 and "rolling out" in patch.json()["error"]["message"]
    assert admin.patch(f"/v1/deployments/{name}", json={"replicas": 2}).status_code == 200  # scaling is fine
    assert admin.delete(f"/v1/deployments/{name}/versions/2").status_code == 409

    promoted = admin.post(f"/v1/deployments/{name}/rollouts/current/promote")
    assert promoted.status_code == 200, promoted.text
    assert promoted.json()["phase"] == "promoted" and promoted.json()["active"] is False
    assert admin.get(f"/v1/deployments/{name}").json()["current_version"] == 2
    assert admin.post(f"/v1/deployments/{name}/rollouts/current/abort").status_code == 409
    current = admin.get(f"/v1/deployments/{name}/rollouts/current").json()
    assert current["phase"] == "promoted" and current["finished_at"] is not None
    kinds = [e["kind"] for e in admin.get("/v1/events", params={"deployment": name}).json()["items"]]
    assert "rollout_started" in kinds and "rollout_promoted" in kinds


def test_abort_goes_back_to_the_baseline_and_an_old_version_can_be_rolled_out(admin):
    name = _deploy(admin)
    assert (
        admin.post(f"/v1/deployments/{name}/rollouts", json={"spec": {"model": "tiny-b"}}).status_code == 201
    )
    aborted = admin.post(f"/v1/deployments/{name}/rollouts/current/abort").json()
    assert aborted["phase"] == "aborted" and "aborted by" in aborted["reason"]
    assert admin.get(f"/v1/deployments/{name}").json()["current_version"] == 1
    r = admin.post(f"/v1/deployments/{name}/rollouts", json={"version": 2, "steps": [100]})
    assert r.status_code == 201, r.text
    listed = admin.get(f"/v1/deployments/{name}/rollouts").json()
    assert [x["phase"] for x in listed["items"]] == ["deploying", "aborted"]


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({}, 422, "version"),
        ({"version": 1, "spec": {"model": "x"}}, 422, "version"),
        ({"version": 1}, 422, "version"),  # already current
        ({"version": 99}, 404, None),
        ({"spec": {"model": "tiny-a"}}, 422, "spec"),  # same as current
        ({"spec": {"replicas": 3, "model": "z"}}, 422, "spec.replicas"),
        ({"spec": {"model": "z"}, "steps": [50, 25, 100]}, 422, "steps"),
        ({"spec": {"model": "z"}, "steps": [5, 50]}, 422, "steps"),
        ({"spec": {"model": "z"}, "steps": [0, 100]}, 422, "steps"),
        ({"spec": {"model": "z"}, "max_error_rate": 2}, 422, "max_error_rate"),
        ({"spec": {"model": "z"}, "step_duration_s": 0}, 422, "step_duration_s"),
        ({"spec": {"model": "z"}, "min_requests": "5"}, 422, "min_requests"),
        ({"spec": {"model": "z"}, "surprise": 1}, 422, "surprise"),
    ],
)
def test_bad_rollout_requests_name_the_field(admin, body, status, field):
    name = _deploy(admin)
    r = admin.post(f"/v1/deployments/{name}/rollouts", json=body)
    assert r.status_code == status, r.text
    if field is not None:
        assert r.json()["error"]["field"] == field, r.json()


def test_unknown_deployment_and_no_rollout_are_404(admin):
    assert admin.post("/v1/deployments/nope-x/rollouts", json={"version": 2}).status_code == 404
    name = _deploy(admin)
    assert admin.get(f"/v1/deployments/{name}/rollouts/current").status_code == 404
    assert admin.post(f"/v1/deployments/{name}/rollouts/current/promote").status_code == 409
