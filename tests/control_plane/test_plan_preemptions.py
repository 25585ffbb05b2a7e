"""`fleetctl plan` with running replicas: which of them the plan would preempt or
replace, and why (a rich table, and `-o json`)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from control_plane.cli import app

CATALOG = (
    "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region,AvailabilityZone\n"
    "g-1,L4,1,1.0,,us-east1,us-east1-b\n"
)


def _plan(tmp_path, demands: dict, *extra: str):
    (tmp_path / "cat.csv").write_text(CATALOG)
    (tmp_path / "demands.json").write_text(json.dumps(demands))
    args = ["plan", "--catalog", str(tmp_path / "cat.csv"), "--demands", str(tmp_path / "demands.json")]
    return CliRunner().invoke(app, [*args, "--capacity", "4", "--tier", "on-demand", *extra])


def test_plan_shows_preemptions_and_replacements(tmp_path):
    demands = {
        "deployments": [
            {"name": "train", "replicas": 4, "running": 4, "priority": "batch"},
            {"name": "web", "replicas": 0, "running": 0},
            {"name": "chat", "replicas": 2, "priority": "critical"},
        ]
    }
    res = _plan(tmp_path, demands, "-o", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["running"] == 4
    assert [(r["deployment"], r["action"], r["by"]) for r in report["removed"]] == [
        ("train", "preempt", "chat (critical)")
    ] * 2
    assert all(r["priority"] == "batch" and "no free node" in r["reason"] for r in report["removed"])
    assert report["replicas_by_region"]["chat"] == {"us-east1": 2}
    table = _plan(tmp_path, demands)
    assert table.exit_code == 0, table.output
    assert "preempted or replaced (2 of 4)" in table.output and "preempt" in table.output

    # Equal classes never preempt; a scale-down is a replacement with its reason; quotas apply.
    demands["deployments"][0] = {"name": "train", "replicas": 3, "running": 4}
    demands["deployments"][2] = {"name": "chat", "replicas": 4, "priority": "critical"}
    demands["quotas"] = {"critical": {"max_gpus": 1}}
    report = json.loads(_plan(tmp_path, demands, "-o", "json").output)
    assert [(r["action"], r["reason"]) for r in report["removed"]] == [("replace", "scaled down")]
    chat = next(u for u in report["unplaced"] if u["deployment"] == "chat")
    assert chat["missing"] == 3 and chat["reason"].startswith("quota: class critical")


def test_plan_refuses_a_bad_class_or_quota(tmp_path):
    res = _plan(tmp_path, {"deployments": [{"name": "a", "replicas": 1, "priority": "gold"}]})
    assert res.exit_code == 1 and "priority" in res.output
    bad = {"deployments": [{"name": "a", "replicas": 1}], "quotas": {"batch": {"min_gpus": 3, "max_gpus": 1}}}
    res = _plan(tmp_path, bad)
    assert res.exit_code == 1 and "min_gpus" in res.output
