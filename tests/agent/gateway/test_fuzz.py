"""Property-based fuzzing (schemathesis, driven by each server's own OpenAPI document) of a
real engine replica and of the gateway in front of two: no input gets a 5xx, and every
server is healthy afterwards. Examples per operation are bounded so CI stays fast."""

from __future__ import annotations

import httpx
import pytest

from engine.server.process import ServerProcess
from fleet_base.api_keys import ApiKeyRecord
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess
from tests.fuzzing import fuzz

pytestmark = pytest.mark.slow


def test_engine_server_never_answers_5xx(replicas: list[ServerProcess]) -> None:
    url = replicas[0].url
    report = fuzz(f"{url}/openapi.json", url, examples=8, pin={"model": DEPLOYMENT})
    print(f"\nengine fuzz: {report.calls} calls, {report.call_s:.1f} s in the server ({report.table()})")
    assert report.calls > 40
    assert report.failures == []
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_gateway_never_answers_5xx(
    east: GatewayProcess, replicas: list[ServerProcess], keys: dict[str, tuple[str, ApiKeyRecord]]
) -> None:
    headers = {"Authorization": f"Bearer {keys['usage'][0]}"}
    report = fuzz(
        f"{east.url}/openapi.json", east.url, headers=headers, examples=8, pin={"model": DEPLOYMENT}
    )
    print(f"\ngateway fuzz: {report.calls} calls, {report.call_s:.1f} s in the server ({report.table()})")
    assert report.calls > 20
    assert report.failures == []
    assert httpx.get(f"{east.url}/health", timeout=10).status_code == 200
    for r in replicas:
        assert httpx.get(f"{r.url}/health", timeout=10).status_code == 200
