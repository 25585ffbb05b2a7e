"""A replica whose engine loop hangs (the test hook freezes it): its /health says
"stalled", the process runtime kills it (the reconciler then restarts it, as any failed
replica), and the gateway's per-attempt deadlines move its requests to the other replica
in seconds, never a long read timeout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from agent.runtime.base import Probe
from agent.runtime.process import ProcessRuntime
from fleet_base.protocol import ReplicaSpec, ReplicaState
from tests.agent.conftest import cluster_config
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, peer, replica, route
from tests.polling import eventually

pytestmark = pytest.mark.slow

STALL_S = 2.0


def _spec(model: Path, rid: str) -> ReplicaSpec:
    args = {"stall_timeout": STALL_S, "max_model_len": 256}
    return ReplicaSpec(replica_id=rid, deployment=DEPLOYMENT, version=1, model=str(model), engine_args=args)


async def _ready(rt: ProcessRuntime, handle, timeout: float = 120.0) -> None:
    async def ready() -> bool:
        probe = await rt.poll(handle)
        assert probe.state != ReplicaState.failed, probe.error
        return probe.state == ReplicaState.ready

    await eventually(ready, timeout, f"replica {handle.replica_id} to be ready", 0.1)


async def _failed(rt: ProcessRuntime, handle, timeout: float) -> Probe:
    async def failed() -> Probe | None:
        probe = await rt.poll(handle)
        return probe if probe.state == ReplicaState.failed else None

    return await eventually(failed, timeout, f"replica {handle.replica_id} to be reported failed", 0.2)


async def test_frozen_replica_is_unhealthy_killed_and_its_requests_go_elsewhere(
    gw_model: Path, tmp_path: Path, nats, keys
) -> None:
    config = cluster_config(tmp_path, "nats://127.0.0.1:1")
    config.replica.env["FLEET_ENGINE_TEST_HOOKS"] = "1"
    rt = ProcessRuntime(config)
    frozen, healthy = await asyncio.gather(rt.start(_spec(gw_model, "r1")), rt.start(_spec(gw_model, "r2")))
    gw = GatewayProcess(
        tmp_path / "gw",
        "east",
        nats_url=nats.url,
        lat=EAST[0],
        lon=EAST[1],
        first_byte_timeout_s=3.0,
        inter_chunk_timeout_s=3.0,
        token_timeout_s=0.0,
    )
    try:
        await asyncio.gather(_ready(rt, frozen), _ready(rt, healthy))
        await asyncio.to_thread(gw.start)
        await asyncio.to_thread(
            gw.write,
            replicas=[replica("r1", frozen.url), replica("r2", healthy.url)],
            keys=[record for _, record in keys.values()],
            routes=[route(DEPLOYMENT, [peer("east", gw.url, *EAST)])],
        )
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await http.post(f"{frozen.url}/debug/freeze")).status_code == 200
            headers = {"Authorization": f"Bearer {keys['main'][0]}"}

            async def one(i: int) -> tuple[int, float]:
                began = time.monotonic()
                body = {"model": DEPLOYMENT, "prompt": f"hello {i}", "max_tokens": 3, "stream": i % 2 == 1}
                r = await http.post(f"{gw.url}/v1/completions", json=body, headers=headers)
                return r.status_code, time.monotonic() - began

            results = await asyncio.gather(*(one(i) for i in range(6)))
            assert [status for status, _ in results] == [200] * 6, results
            assert max(s for _, s in results) < 30, results  # seconds, not a 600 s read timeout

            # The frozen replica says so on /health, and the runtime kills it.
            probe = await _failed(rt, frozen, 30)
            assert "stalled" in (probe.error or "")
            assert (await rt.poll(healthy)).state == ReplicaState.ready
    finally:
        gw.stop()
        for handle in (frozen, healthy):
            await rt.kill(handle)
        await rt.close()
