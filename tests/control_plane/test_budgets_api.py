"""Team budgets through the admin API, in process: set (evaluated at once), list with the
month's figures, delete; admin only, audited, and bad input is a 422 naming the field.
(fleetctl budgets and the loop: tests/e2e/test_budget.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from control_plane.api.app import build_app
from control_plane.api.routers.keys import make_key
from control_plane.context import ControlPlaneContext
from control_plane.settings import Settings


class Api:
    def __init__(self, app, sessions) -> None:
        self.app, self.sessions = app, sessions

    def client(self, scopes: list[str] | None = None) -> TestClient:
        """A client holding a new key of `scopes` (admin by default)."""
        row, secret = make_key("tester", scopes or ["admin"], None, {})
        with self.sessions() as s:
            s.add(row)
            s.commit()
        return TestClient(self.app, headers={"Authorization": f"Bearer {secret}"})


@pytest.fixture
def server(sessions, tmp_path) -> Iterator[Api]:
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions)
    yield Api(build_app(ctx, run_loops=False), sessions)


def test_put_get_list_delete_and_audit(server: Api) -> None:
    with server.client() as api:
        r = api.put("/v1/budgets/ml", json={"monthly_dollars": 500})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["team"] == "ml" and out["monthly_dollars"] == 500.0
        assert out["thresholds"] == [0.5, 0.8, 1.0] and out["hard"] is False
        assert out["spent_dollars"] == 0.0 and out["used_ratio"] == 0.0 and out["exhausted"] is False
        assert len(out["month"]) == 7 and out["alerted"] == []

        r = api.put(
            "/v1/budgets/ml", json={"monthly_dollars": 750.5, "thresholds": [1.0, 0.9, 0.9], "hard": True}
        )
        assert r.status_code == 200, r.text
        assert r.json()["thresholds"] == [0.9, 1.0] and r.json()["hard"] is True

        listed = api.get("/v1/budgets").json()
        assert [b["team"] for b in listed["items"]] == ["ml"] and listed["total"] == 1
        assert api.get("/v1/budgets/ml").json()["monthly_dollars"] == 750.5

        audit = api.get("/v1/audit", params={"resource_type": "budget", "resource_id": "ml"}).json()["items"]
        assert [a["action"] for a in audit] == ["budget.set", "budget.set"]
        assert audit[0]["before"]["monthly_dollars"] == 500.0 and audit[0]["after"]["hard"] is True

        assert api.delete("/v1/budgets/ml").json()["team"] == "ml"
        assert api.delete("/v1/budgets/ml").status_code == 404
        assert api.get("/v1/budgets/ml").status_code == 404
        assert api.get("/v1/budgets").json()["items"] == []


BAD = [
    ("team", "bad team!", {"monthly_dollars": 1}),
    ("monthly_dollars", "t", {"monthly_dollars": 0}),
    ("monthly_dollars", "t", {"monthly_dollars": -5}),
    ("monthly_dollars", "t", {"monthly_dollars": 1e-300}),
    ("monthly_dollars", "t", {"monthly_dollars": "500"}),
    ("monthly_dollars", "t", {}),
    ("thresholds.0", "t", {"monthly_dollars": 1, "thresholds": [80]}),
    ("thresholds.0", "t", {"monthly_dollars": 1, "thresholds": [0]}),
    ("thresholds", "t", {"monthly_dollars": 1, "thresholds": []}),
    ("hard", "t", {"monthly_dollars": 1, "hard": "yes"}),
    ("soft", "t", {"monthly_dollars": 1, "soft": True}),
]


def test_bad_input_is_a_422_naming_the_field_and_writes_need_admin(server: Api) -> None:
    with server.client() as api:
        for field, team, body in BAD:
            r = api.put(f"/v1/budgets/{team}", json=body)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["field"] == field, (body, r.text)
        assert api.get("/v1/budgets").json()["items"] == []
    with server.client(["read"]) as api:
        assert api.put("/v1/budgets/t", json={"monthly_dollars": 1}).status_code == 403
        assert api.get("/v1/budgets").status_code == 200
