"""Async requests with webhooks end to end, on a local fleet of real processes (nats-server,
control plane, an agent and its gateway, a simulated replica), with a key made by
`fleetctl keys create` (its webhook signing secret is shown once, there):

- an async chat request whose webhook receiver (a local HTTP server, allowed by the
  cluster's `batch.webhook_allow`) is down when the result is ready and stays down for
  DOWN_S is delivered once it is back, and the delivery verifies with the Standard Webhooks library and the key's
  secret; the delivered result is the one `GET /v1/async/requests/{id}` shows;
- a webhook address the SSRF guard refuses (cloud metadata, private, loopback not allowed)
  is a 400 that says why.

The retries' backoff is capped at 5 s here (`webhook_backoff_max_s`), so the delivery comes
within seconds of the receiver's return rather than at the next minute's attempt. DOWN_S is
20 s by default: four capped backoffs, so the retries have reached their cap and go on at it,
which is all the issue's minute adds with that cap; FLEET_TEST_WEBHOOK_DOWN_S=60 runs the
minute itself."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from fleet_base.batch.config import BatchConfig
from fleet_base.ports import free_port
from tests.e2e.batch_tools import Key, metric_names, new_key
from tests.e2e.sim_fleet import SimFleet, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REGION = "local-east"
MODEL = "chat"
BACKOFF_MAX_S = 5.0
DOWN_S = float(os.environ.get("FLEET_TEST_WEBHOOK_DOWN_S", str(4 * BACKOFF_MAX_S)))
BATCH = BatchConfig(webhook_allow=["127.0.0.1"], webhook_backoff_s=1.0, webhook_backoff_max_s=BACKOFF_MAX_S)


class Receiver:
    """A webhook receiver on a fixed 127.0.0.1 port that can be down (nothing listening:
    connection refused) and come up later; keeps every POST it got."""

    def __init__(self) -> None:
        self.port = free_port("127.0.0.1")
        self.received: list[tuple[dict[str, str], bytes, float]] = []
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        received = self.received

        class Hook(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append(({k.lower(): v for k, v in self.headers.items()}, body, time.time()))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Hook)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    fleet = SimFleet(tmp_path_factory.mktemp("async-webhook"), [REGION], slots=1, cluster={"batch": BATCH})
    try:
        fleet.up()
        fleet.deploy(MODEL, 1, engine_args={"cold_start": 0.2})
        fleet.wait_ready(MODEL, 1)
        yield fleet
    finally:
        fleet.down()


@pytest.fixture(scope="module")
def key(fleet: SimFleet) -> Key:
    key = new_key(fleet, "hooked")
    assert key.webhook_secret and key.webhook_secret.startswith("whsec_"), key
    return key


def post_async(fleet: SimFleet, key: Key, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, **fields}
    return httpx.post(
        f"{fleet.gateways[REGION]}/v1/async/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key.secret}"},
        timeout=30,
    )


def get_async(fleet: SimFleet, key: Key, request_id: str) -> dict:
    r = httpx.get(
        f"{fleet.gateways[REGION]}/v1/async/requests/{request_id}",
        headers={"authorization": f"Bearer {key.secret}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "url",
    ["http://169.254.169.254/latest/meta-data/", "http://10.1.2.3/hook", "http://[::1]:8080/hook"],
)
def test_a_refused_webhook_address_is_a_400(fleet: SimFleet, key: Key, url: str) -> None:
    r = post_async(fleet, key, webhook_url=url)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_webhook_url", "webhook_url") and error["message"], (
        error
    )


def test_a_webhook_down_for_a_minute_is_delivered_when_it_returns(fleet: SimFleet, key: Key) -> None:
    receiver = Receiver()  # down: its port has no listener yet
    r = post_async(fleet, key, webhook_url=receiver.url, priority=0)
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]
    down_at = time.monotonic()
    ready = wait_for(
        lambda: (a := get_async(fleet, key, request_id))["status"] == "succeeded" and a, 60, 0.3, "the result"
    )
    assert ready["delivery"] == "pending", ready
    time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at)))
    during = get_async(fleet, key, request_id)
    assert during["delivery"] == "pending" and during["delivery_attempts"] >= 2, during
    receiver.start()
    back_at = time.monotonic()
    try:
        wait_for(lambda: receiver.received, 3 * BACKOFF_MAX_S + 10, 0.2, "the webhook delivery")
        delivered_s = time.monotonic() - back_at
        done = wait_for(
            lambda: (a := get_async(fleet, key, request_id))["delivery"] == "delivered" and a,
            30,
            0.3,
            "delivered",
        )
    finally:
        receiver.stop()
    headers, body, _ = receiver.received[0]
    payload = Webhook(key.webhook_secret).verify(body, headers)  # raises unless signed with the key's secret
    assert headers["webhook-id"] == request_id, headers
    assert payload["id"] == request_id and payload["status"] == "succeeded", payload
    assert payload["result"] == done["result"] and done["result"]["response"]["status_code"] == 200, payload
    assert payload["result"]["response"]["body"]["choices"][0]["message"]["content"], payload
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + "A" * 43 + "=").verify(body, headers)
    assert "fleet_batch_webhook_deliveries_total" in metric_names(fleet.gateways[REGION])
    retried = fleet.gateway_metric(REGION, "fleet_batch_webhook_deliveries_total", outcome="retried")
    delivered = fleet.gateway_metric(REGION, "fleet_batch_webhook_deliveries_total", outcome="delivered")
    assert retried >= 2 and delivered == 1, (retried, delivered)
    print(
        f"\n[async] receiver down {DOWN_S:.0f} s ({during['delivery_attempts']} attempts refused); delivered "
        f"{delivered_s:.1f} s after it came back, {len(receiver.received)} POST(s), verified with the "
        f"key's Standard Webhooks secret: {json.dumps(payload['result']['response']['body']['choices'][0])[:80]}"
    )
