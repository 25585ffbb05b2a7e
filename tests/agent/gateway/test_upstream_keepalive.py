"""The gateway's pool, not the replica, ends an idle upstream connection: a real simulated
replica whose client-facing keep-alive is set short (1 s) still keeps the gateway's idle
connection, so the next request reuses it instead of racing the replica's close."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from agent.gateway.proxy import make_client
from tests.agent.gateway.harness import start_sim
from tests.polling import eventually


def _client_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


async def test_an_idle_upstream_connection_outlives_the_listeners_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_KEEPALIVE_TIMEOUT_S", "1")
    proc, url = start_sim()
    try:
        async with make_client(verify=False) as client:

            async def healthy() -> bool:
                try:
                    return (await client.get(f"{url}/health")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(healthy, 30)
            first = await client.get(f"{url}/health")
            await asyncio.sleep(2.5)  # idle past the 1 s the environment asks of client-facing listeners
            second = await client.get(f"{url}/health")
            assert first.status_code == second.status_code == 200
            assert _client_port(second) == _client_port(first), (
                "the replica closed the pool's idle connection"
            )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
