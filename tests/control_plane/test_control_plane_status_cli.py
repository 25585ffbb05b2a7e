"""`fleetctl status` without a deployment: members, leader and epoch from a recorded
`GET /v1/control-plane` answer (the documented JSON contract), served by a real HTTP server
behind a dead first URL, and the leader's scheduled jobs from either place they may come."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from control_plane.cli import app
from control_plane.client import FleetClient
from fleet_base.ports import free_port

VIEW = {
    "leader": "cp-b",
    "epoch": 7,
    "is_leader": False,
    "members": [
        {
            "id": "cp-a",
            "url": "http://10.0.0.1:7070",
            "is_leader": False,
            "last_seen": "2026-12-04T20:00:01.5+00:00",
            "started_at": "2026-12-04T19:00:00+00:00",
        },
        {
            "id": "cp-b",
            "url": "http://10.0.0.2:7070",
            "is_leader": True,
            "last_seen": "2026-12-04T20:00:02+00:00",
            "started_at": "2026-12-04T19:30:00+00:00",
        },
    ],
}
JOBS = [
    {
        "id": "retention",
        "trigger": "cron[hour='3', minute='0']",
        "next_run_at": "2026-12-05T03:00:00+00:00",
        "last_run_at": "2026-12-04T03:00:00+00:00",
        "last_outcome": "ok",
    }
]


def _serve(routes: dict[str, tuple[int, object]]) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = routes.get(self.path.split("?")[0], (404, {"error": {"message": "not found"}}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def with_jobs_inline() -> Iterator[str]:
    yield from _serve({"/v1/control-plane": (200, {**VIEW, "jobs": JOBS})})


@pytest.fixture
def with_jobs_route() -> Iterator[str]:
    yield from _serve(
        {"/v1/control-plane": (200, VIEW), "/v1/control-plane/jobs": (200, {"running": False, "jobs": JOBS})}
    )


@pytest.fixture
def without_jobs() -> Iterator[str]:
    yield from _serve({"/v1/control-plane": (200, {**VIEW, "leader": None, "members": []})})


def _run(url: str, *args: str):
    FleetClient._last_good.clear()
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"FLEET_API_URL": f"{dead},{url}", "FLEET_TOKEN": "t", "COLUMNS": "200"}
    return CliRunner().invoke(app, ["status", *args], env=env)


@pytest.mark.parametrize("source", ["with_jobs_inline", "with_jobs_route"])
def test_members_leader_epoch_and_jobs(source, request):
    url = request.getfixturevalue(source)
    res = _run(url)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "leader cp-b, epoch 7" in out
    leader_row = next(line for line in out.splitlines() if "cp-b" in line and "10.0.0.2" in line)
    follower_row = next(line for line in out.splitlines() if "cp-a" in line)
    assert "leader" in leader_row and "follower" in follower_row
    assert out.index("cp-b") < out.index("cp-a")  # the leader first
    assert f"answered by {url} (a follower)" in out
    assert "retention" in out and "2026-12-05 03:00:00" in out and "ok" in out
    assert "cron[hour='3', minute='0']" in out  # a trigger is text, not rich markup

    data = json.loads(_run(url, "-o", "json").stdout)
    assert data["leader"] == "cp-b" and data["epoch"] == 7 and data["jobs"][0]["id"] == "retention"
    assert data["answered_by"] == url and len(data["members"]) == 2


def test_no_leader_is_said_plainly(without_jobs):
    res = _run(without_jobs)
    assert res.exit_code == 0, res.output
    assert "leader none, epoch 7" in res.stdout and "no leader" in res.stdout
    assert "scheduled jobs" not in res.stdout


def test_a_control_plane_without_the_route_fails_in_one_line():
    for url in _serve({}):
        res = _run(url)
        assert res.exit_code == 1 and "/v1/control-plane" in res.stderr
