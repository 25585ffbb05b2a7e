"""The admin client over several control-plane URLs, against real local HTTP servers: a dead
port, an instance that answers 503, one that accepts and never answers, and a live one.
Reads move on after any failure; writes only when they surely reached no server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from control_plane.client import ApiError, FleetClient
from control_plane.settings import client_endpoint
from fleet_base.ports import free_port


class Instance:
    """A real HTTP server answering every request with `status` and counting what it got."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.seen: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.seen.append((self.command, self.path))
                body = json.dumps({"served_by": owner.url}).encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_DELETE = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def instances() -> Iterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for inst in made:
        inst.close()


def _live(instances: list[Instance], status: int = 200) -> Instance:
    inst = Instance(status)
    instances.append(inst)
    return inst


@pytest.fixture
def dead() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def hung() -> Iterator[str]:
    """Accepts connections (the kernel's backlog) and never answers: a paused process."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _client(*urls: str, timeout: float = 5.0) -> FleetClient:
    FleetClient._last_good.clear()
    return FleetClient(list(urls), token="t", timeout=timeout)


def test_reads_and_writes_pass_a_dead_instance(instances, dead):
    live = _live(instances)
    with _client(dead, live.url) as client:
        assert client.get("/v1/deployments")["served_by"] == live.url
        assert client.post("/v1/deployments", {"name": "x"})["served_by"] == live.url
    assert live.seen == [("GET", "/v1/deployments"), ("POST", "/v1/deployments")]


def test_a_comma_separated_string_is_a_list(instances, dead):
    live = _live(instances)
    with FleetClient(f"{dead}, {live.url},", token="t") as client:
        assert client.urls == [dead, live.url]
        assert client.get("/x")["served_by"] == live.url


def test_the_last_good_instance_is_asked_first(instances):
    failing, live = _live(instances, 503), _live(instances)
    with _client(failing.url, live.url) as client:
        assert client.get("/a")["served_by"] == live.url
        assert client.get("/b")["served_by"] == live.url
    with FleetClient([failing.url, live.url], token="t") as later:  # same process, same list
        assert later.get("/c")["served_by"] == live.url
    assert failing.seen == [("GET", "/a")]
    assert [p for _, p in live.seen] == ["/a", "/b", "/c"]


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_read_moves_on_after_a_gateway_error_a_write_does_not(instances, status):
    failing, live = _live(instances, status), _live(instances)
    with _client(failing.url, live.url) as client:
        assert client.get("/v1/keys")["served_by"] == live.url
    with _client(failing.url, live.url) as client:
        with pytest.raises(ApiError) as err:
            client.post("/v1/keys", {"name": "k"})
    assert err.value.status == status
    assert ("POST", "/v1/keys") in failing.seen and ("POST", "/v1/keys") not in live.seen


def test_a_read_moves_on_after_a_timeout_a_write_does_not(instances, hung):
    live = _live(instances)
    with _client(hung, live.url, timeout=0.3) as client:
        assert client.get("/v1/clusters")["served_by"] == live.url
    with _client(hung, live.url, timeout=0.3) as client:
        with pytest.raises(ApiError) as err:
            client.post("/v1/keys", {"name": "k"})  # it may have been applied: never twice
    assert err.value.status == 0 and "did not answer in time" in str(err.value) and hung in str(err.value)
    assert live.seen == [("GET", "/v1/clusters")]


def test_a_paused_instance_is_left_after_the_configured_timeout(instances, hung, monkeypatch):
    live = _live(instances)
    monkeypatch.setenv("FLEET_API_TIMEOUT_S", "0.3")
    FleetClient._last_good.clear()
    with FleetClient([hung, live.url], token="t") as client:
        started = time.monotonic()
        assert client.get("/v1/deployments")["served_by"] == live.url
    assert time.monotonic() - started < 5


def test_every_instance_down_names_them_all(dead):
    other = f"http://127.0.0.1:{free_port()}"
    with _client(dead, other) as client:
        with pytest.raises(ApiError) as err:
            client.get("/v1/deployments")
    assert err.value.status == 0
    assert "unreachable" in str(err.value) and dead in str(err.value) and other in str(err.value)


def test_every_instance_failing_reports_the_last_answer(instances):
    a, b = _live(instances, 503), _live(instances, 502)
    with _client(a.url, b.url) as client:
        with pytest.raises(ApiError) as err:
            client.get("/v1/deployments")
    assert err.value.status == 502 and len(a.seen) == len(b.seen) == 1


def test_a_client_error_is_an_answer_not_a_failover(instances):
    refusing, live = _live(instances, 404), _live(instances)
    with _client(refusing.url, live.url) as client:
        with pytest.raises(ApiError) as err:
            client.get("/v1/deployments/nope")
    assert err.value.status == 404 and live.seen == []


def test_endpoints_from_the_environment_and_the_api_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    monkeypatch.delenv("FLEET_TOKEN", raising=False)
    monkeypatch.setenv("FLEET_API_URL", "http://a:1/, http://b:2,,http://a:1")
    assert client_endpoint() == (["http://a:1", "http://b:2"], None)
    monkeypatch.delenv("FLEET_API_URL")
    (tmp_path / "api-url").write_text("http://c:3\nhttp://d:4\n")
    (tmp_path / "admin-token").write_text("tok\n")
    assert client_endpoint() == (["http://c:3", "http://d:4"], "tok")
    (tmp_path / "api-url").unlink()
    assert client_endpoint() == (["http://127.0.0.1:7070"], "tok")
