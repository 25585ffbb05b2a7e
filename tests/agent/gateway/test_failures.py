"""Replicas that misbehave at the HTTP level (a stand-in server on a real socket): a 5xx
before the first byte is retried elsewhere or passed on; a stream that breaks after its
first byte ends with an in-band error event."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from engine.server.process import ServerProcess
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, replica, sample, scrape, sse_events

BROKEN_BODY = {
    "error": {"message": "replica exploded", "type": "internal_error", "param": None, "code": None}
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.server.mode == "500":  # type: ignore[attr-defined]
            body = json.dumps(BROKEN_BODY).encode()
            self.send_response(500)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:  # one event of a stream, then the connection drops
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            chunk = {
                "object": "text_completion",
                "choices": [{"index": 0, "text": "half", "finish_reason": None}],
            }
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()


@pytest.fixture
def stub() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.mode = "500"  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def post(gw: GatewayProcess, secret: str, **body: object) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )


def test_5xx_before_the_first_byte_is_retried_elsewhere(
    east: GatewayProcess, secret: str, stub: ThreadingHTTPServer, replicas: list[ServerProcess]
) -> None:
    east.write(replicas=[replica("a-broken", url(stub)), replica("r1", replicas[0].url)])
    before = sample(
        scrape(east.url), "fleet_gateway_upstream_errors_total", deployment=DEPLOYMENT, reason="status_5xx"
    )
    r = post(east, secret)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    after = sample(
        scrape(east.url), "fleet_gateway_upstream_errors_total", deployment=DEPLOYMENT, reason="status_5xx"
    )
    assert after == before + 1


def test_5xx_with_nowhere_else_to_go_is_passed_on(
    east: GatewayProcess, secret: str, stub: ThreadingHTTPServer
) -> None:
    east.write(replicas=[replica("a-broken", url(stub))])
    r = post(east, secret)
    assert r.status_code == 500 and r.json() == BROKEN_BODY  # tried twice, then the replica's own answer


def test_stream_broken_after_first_byte_ends_with_an_error_event(
    east: GatewayProcess, secret: str, stub: ThreadingHTTPServer
) -> None:
    stub.mode = "cut"  # type: ignore[attr-defined]
    east.write(replicas=[replica("a-broken", url(stub))])
    before = sample(scrape(east.url), "fleet_gateway_requests_total", deployment=DEPLOYMENT, status="502")
    r = post(east, secret, stream=True)
    assert r.status_code == 200  # headers were sent before it broke
    events = sse_events(r.text.splitlines())
    assert events[0]["choices"][0]["text"] == "half"
    assert events[-1]["error"]["code"] == "upstream_failed"
    assert "[DONE]" not in events
    assert (
        sample(scrape(east.url), "fleet_gateway_requests_total", deployment=DEPLOYMENT, status="502")
        == before + 1
    )
