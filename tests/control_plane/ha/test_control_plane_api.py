"""`GET /v1/control-plane` and the election metrics, two instances in process on one
database (the first runs the real control loops on its fenced sessions)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from control_plane.api.app import build_app
from control_plane.api.routers.keys import make_key
from control_plane.context import ControlPlaneContext
from control_plane.settings import Settings


def _token(sessions) -> dict[str, str]:
    row, secret = make_key("tester", ["admin"], None, {})
    with sessions() as s:
        s.add(row)
        s.commit()
    return {"Authorization": f"Bearer {secret}"}


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_members_leader_epoch_and_metrics(sessions, tmp_path):
    headers = _token(sessions)
    apps = [
        build_app(ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions), public_url=url)
        for url in ("http://a:7070", "http://b:7070")
    ]
    with TestClient(apps[0], headers=headers) as a, TestClient(apps[1], headers=headers) as b:
        assert apps[0].state.loops is not None and apps[1].state.loops is None  # only the leader runs loops
        leader_id = apps[0].state.elector.member_id
        seen_a, seen_b = a.get("/v1/control-plane").json(), b.get("/v1/control-plane").json()
        assert set(seen_a) == {"leader", "epoch", "members", "is_leader"}
        assert seen_a["is_leader"] is True and seen_b["is_leader"] is False
        assert seen_a["leader"] == seen_b["leader"] == leader_id and seen_a["epoch"] == 1
        members = {m["url"]: m for m in seen_b["members"]}
        assert set(members) == {"http://a:7070", "http://b:7070"}
        assert members["http://a:7070"]["is_leader"] and not members["http://b:7070"]["is_leader"]
        assert set(members["http://a:7070"]) == {"id", "url", "is_leader", "last_seen", "started_at"}
        assert TestClient(apps[1]).get("/v1/control-plane").status_code == 401

        ma, mb = a.get("/metrics").text, b.get("/metrics").text
        assert (
            _metric(ma, "fleet_control_plane_is_leader") == 1
            and _metric(mb, "fleet_control_plane_is_leader") == 0
        )
        assert _metric(ma, "fleet_control_plane_leader_changes_total") == 1
        assert _metric(mb, "fleet_control_plane_leader_changes_total") == 0
        assert _metric(ma, "fleet_control_plane_epoch") == 1 and _metric(mb, "fleet_control_plane_epoch") == 1
        assert _metric(ma, "fleet_control_plane_lease_renew_seconds_count") >= 1
        assert _metric(ma, "fleet_control_plane_epoch_floor_raises_total") == 0
    # the leader's clean shutdown released the lease
    with TestClient(apps[1], headers=headers) as b:
        seen = b.get("/v1/control-plane").json()
        assert seen["is_leader"] is True and seen["epoch"] == 2
        assert [m["url"] for m in seen["members"]] == ["http://b:7070"]


def test_the_epoch_floor_raises_are_counted():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from control_plane.api.metrics import ElectionCollector

    elector = SimpleNamespace(is_leader=True, leader_changes=1, floor_raises=2, last_record=None)
    registry = CollectorRegistry()
    registry.register(ElectionCollector(lambda: elector))
    text = generate_latest(registry).decode()
    assert _metric(text, "fleet_control_plane_epoch_floor_raises_total") == 2
