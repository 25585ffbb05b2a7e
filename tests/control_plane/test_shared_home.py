"""Several control-plane instances on one FLEET_HOME: instances starting together agree on one
admin token, and none shrinks the launcher's list of instances in the api file to itself."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import select

from control_plane.db.models import ApiKey
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.local.fleet import LocalFleet, ProcessRecord
from control_plane.server import ensure_admin_token, record_api_url
from control_plane.settings import Settings, client_endpoint
from tests.control_plane.cp_server import ControlPlaneServer
from tests.polling import wait_for


def test_instances_starting_together_share_one_admin_token(tmp_path):
    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'fleet.db'}")
    upgrade_to_head(settings.db_url)
    sessions = make_sessions(settings.db_url)
    try:
        with ThreadPoolExecutor(6) as pool:
            tokens = list(pool.map(lambda _: ensure_admin_token(settings, sessions), range(6)))
        with sessions() as session:
            keys = session.scalars(select(ApiKey)).all()
    finally:
        sessions.kw["bind"].dispose()
    assert len(set(tokens)) == 1 and settings.token_file.read_text().strip() == tokens[0]
    assert len(keys) == 1


def test_a_launched_list_stays_whole_and_a_lone_instance_replaces_a_stale_file(tmp_path, monkeypatch):
    home = tmp_path / "home"
    settings = Settings(home=home)
    urls = ["http://127.0.0.1:7070", "http://127.0.0.1:7071", "http://127.0.0.1:7072"]
    LocalFleet(home).write_api_urls(urls)
    for url in reversed(urls):  # each instance, once ready
        record_api_url(settings, url)
    monkeypatch.setenv("FLEET_HOME", str(home))
    monkeypatch.delenv("FLEET_API_URL", raising=False)
    assert client_endpoint()[0] == urls

    record_api_url(settings, "http://127.0.0.1:9999")  # a lone instance on a new port
    assert client_endpoint()[0] == ["http://127.0.0.1:9999"]


def test_ports_for_several_instances_are_distinct(tmp_path):
    ports = LocalFleet(tmp_path).control_plane_ports(4)
    assert len(set(ports)) == 4


def test_an_instance_is_listed_at_its_advertised_url(tmp_path, monkeypatch):
    """Behind 0.0.0.0 (a pod) the listen address says nothing to other hosts: FLEET_ADVERTISE_URL."""
    monkeypatch.setenv("FLEET_ADVERTISE_URL", "http://10.1.2.3:7070/")
    server = ControlPlaneServer(tmp_path / "home", f"sqlite:///{tmp_path / 'fleet.db'}", loops=True).start()
    try:
        with server.client() as admin:
            view = wait_for(
                lambda: (v := admin.get("/v1/control-plane").json())["members"] and v,
                30,
                "the instance's first heartbeat",
            )
        assert [m["url"] for m in view["members"]] == ["http://10.1.2.3:7070"]
        assert (tmp_path / "home" / "api-url").read_text().strip() == server.url  # the local CLI's
    finally:
        server.stop()


def test_instances_start_first_alone_then_together_listed_before_any_starts(tmp_path, monkeypatch):
    fleet = LocalFleet(tmp_path / "home", secure=False)
    state = fleet.new_state(["local-east"])
    steps: list[tuple] = []

    def spawn(state, kind, name, argv, url="", config="", extra_env=None):
        steps.append(("start", name, fleet.home.joinpath("api-url").read_text().split(), extra_env))
        return ProcessRecord(kind=kind, name=name, pid=1, url=url)

    monkeypatch.setattr(fleet, "spawn", spawn)
    records = fleet.start_control_planes(
        state,
        [7070, 7071, 7072],
        lambda records: steps.append(("wait", [r.name for r in records])),
        {"A": "1"},
    )
    urls = [f"http://127.0.0.1:{p}" for p in (7070, 7071, 7072)]
    assert [r.url for r in records] == urls
    assert steps == [
        ("start", "control-plane-1", urls, {"A": "1"}),
        ("wait", ["control-plane-1"]),  # it migrates and writes the admin token alone
        ("start", "control-plane-2", urls, {"A": "1"}),
        ("start", "control-plane-3", urls, {"A": "1"}),
        ("wait", ["control-plane-2", "control-plane-3"]),
    ]
