"""Per-request telemetry: usage records on NATS (a real nats-server), a replica's bogus
time-to-first-token header kept out of them, and the documented Prometheus names."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import nats as nats_py
import pytest

from control_plane.local.nats_server import NatsServer
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.openai_contract.timing import TTFT_HEADER
from fleet_base.protocol import UsageRecord, usage_subject
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, peer, replica, route, scrape
from tests.polling import eventually

ROOT = Path(__file__).resolve().parents[3]


async def test_usage_records_arrive_on_nats(
    east: GatewayProcess, nats: NatsServer, keys: dict[str, tuple[str, ApiKeyRecord]]
) -> None:
    async with httpx.AsyncClient(base_url=east.url, timeout=60) as h:

        async def nats_connected() -> bool:
            return (await h.get("/health")).json()["nats_connected"]

        await eventually(nats_connected, 10, "the gateway to connect to NATS")
        nc = await nats_py.connect(nats.url)
        try:
            sub = await nc.subscribe(usage_subject("east"))
            headers = {"Authorization": f"Bearer {keys['usage'][0]}"}
            chat = await h.post(
                "/v1/chat/completions",
                headers=headers,
                json={"model": DEPLOYMENT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            )
            assert chat.status_code == 200
            stream = await h.post(
                "/v1/completions",
                headers=headers,
                json={
                    "model": DEPLOYMENT,
                    "prompt": "abc",
                    "max_tokens": 9,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            assert stream.status_code == 200 and '"usage"' not in stream.text
            records: list[UsageRecord] = []
            while len(records) < 2:
                msg = await sub.next_msg(timeout=5)
                record = UsageRecord.from_bytes(msg.data)
                if record.key_id == "usage":
                    records.append(record)
        finally:
            await nc.close()
    first, second = records
    usage = chat.json()["usage"]
    assert (first.prompt_tokens, first.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    # not streamed: the replica's own time to first token (its header) plus the gateway's before the call
    assert first.ttft_s is not None and 0 < first.ttft_s < first.latency_s
    assert float(chat.headers[TTFT_HEADER]) == pytest.approx(first.ttft_s, abs=1e-5)
    assert second.completion_tokens == 9 and second.prompt_tokens >= 1
    assert second.ttft_s is not None and 0 < second.ttft_s <= second.latency_s
    for record in records:
        assert (record.cluster, record.deployment, record.version, record.status) == (
            "east",
            DEPLOYMENT,
            1,
            200,
        )


class _BogusTtft(BaseHTTPRequestHandler):
    """A replica whose answers are right but whose `x-fleet-ttft-s` is the test's value."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.dumps({
            "id": "cmpl-1", "object": "text_completion", "created": 0, "model": DEPLOYMENT,
            "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header(TTFT_HEADER, self.server.ttft)  # type: ignore[attr-defined]
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def bogus() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BogusTtft)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def test_a_replicas_bogus_ttft_is_not_recorded(
    east: GatewayProcess,
    nats: NatsServer,
    keys: dict[str, tuple[str, ApiKeyRecord]],
    bogus: ThreadingHTTPServer,
) -> None:
    east.write(replicas=[replica("bogus", f"http://127.0.0.1:{bogus.server_address[1]}")])
    values = ["nan", "-0.5", "3600", "soon", "0.0"]  # the last one is fine: the control
    async with httpx.AsyncClient(base_url=east.url, timeout=30) as h:
        nc = await nats_py.connect(nats.url)
        try:
            sub = await nc.subscribe(usage_subject("east"))
            answers = []
            for value in values:
                bogus.ttft = value  # type: ignore[attr-defined]
                answers.append(
                    await h.post(
                        "/v1/completions",
                        headers={"Authorization": f"Bearer {keys['usage'][0]}"},
                        json={"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2},
                    )
                )
            records: list[UsageRecord] = []
            while len(records) < len(values):
                record = UsageRecord.from_bytes((await sub.next_msg(timeout=5)).data)
                if record.key_id == "usage":
                    records.append(record)
        finally:
            await nc.close()
    assert [a.status_code for a in answers] == [200] * len(values)
    assert [TTFT_HEADER in a.headers for a in answers] == [False] * 4 + [True]
    assert [r.ttft_s for r in records[:4]] == [None] * 4
    assert records[4].ttft_s is not None and 0 <= records[4].ttft_s <= records[4].latency_s


DOCUMENTED = re.compile(r"^\| `(fleet_gateway_[a-z_]+)", re.M)


def test_metric_names_are_present_and_documented(east: GatewayProcess, secret: str) -> None:
    # A route with a peer: its forwarding series exist (at zero) before anything is forwarded.
    east.write(
        routes=[
            route(DEPLOYMENT, [peer("east", east.url, *EAST), peer("west", "http://127.0.0.1:9", 34, -118)])
        ]
    )
    httpx.post(
        f"{east.url}/v1/completions",
        json={"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2, "stream": True},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )
    names = {name for name, _ in scrape(east.url)}
    documented = set(DOCUMENTED.findall((ROOT / "docs" / "metrics.md").read_text()))
    expected = {
        "fleet_gateway_requests_total",
        "fleet_gateway_request_duration_seconds_bucket",
        "fleet_gateway_time_to_first_token_seconds_bucket",
        "fleet_gateway_tokens_total",
        "fleet_gateway_in_flight",
        "fleet_gateway_queue_depth",
        "fleet_gateway_queue_wait_seconds_bucket",
        "fleet_gateway_queue_rejected_total",
        "fleet_gateway_retries_total",
        "fleet_gateway_upstream_errors_total",
        "fleet_gateway_forwarded_total",
        "fleet_gateway_replica_choice_total",
        "fleet_gateway_usage_records_total",
        "fleet_gateway_state_reloads_total",
    }
    assert expected <= names, expected - names

    def stem(name: str) -> str:
        return re.sub(r"_(bucket|sum|count|created|total)$", "", name)

    exposed = {stem(n) for n in names if n.startswith("fleet_gateway_")}
    assert exposed <= {stem(d) for d in documented}, exposed - {stem(d) for d in documented}
