"""Engine KV events -> the agent's relay -> real NATS -> a gateway's prefix index.

The replica side is the engine's real event log and `/kv/events` endpoint over a real
KV-cache manager (the block bookkeeping, no model: a model adds nothing to what is
published), served by uvicorn on a free port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace

import uvicorn
from fastapi import FastAPI

from agent.gateway.kv_index import block_key
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.prefix import PrefixRouting, prefix_keys
from agent.kv_relay import Followed, KvRelay
from engine.kv_cache import KVCacheManager, KvEventLog
from engine.request import Request
from engine.server.kv_events import register
from fleet_base.nats_io import NatsLink
from fleet_base.ports import free_port
from fleet_base.sampling_params import SamplingParams
from tests.polling import eventually

BS = 4


class FakeReplica:
    """A replica's real KV bookkeeping and event log, without a model behind them."""

    def __init__(self) -> None:
        self.log = KvEventLog(BS)
        self.kv = KVCacheManager(num_blocks=8, block_size=BS, events=self.log)
        self.port = free_port()
        self.n = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, tokens: list[int]) -> None:
        self.n += 1
        req = Request(
            request_id=f"q{self.n}", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1)
        )
        assert self.kv.allocate_slots(req, len(tokens))
        self.kv.free(req)


@contextlib.asynccontextmanager
async def served(replica: FakeReplica) -> AsyncIterator[SimpleNamespace]:
    """The replica's `/kv/events` on its port; yields the app state (swap `engine.kv_events`
    to restart the replica)."""
    app = FastAPI()
    state = SimpleNamespace(engine=SimpleNamespace(kv_events=replica.log))
    register(app, state)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=replica.port, log_level="warning", lifespan="off")
    )
    serve = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started)
        yield state
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve, 10)


async def test_relay_feeds_the_gateway_index_and_resyncs(nats_server) -> None:
    replica = FakeReplica()
    agent_link = NatsLink(nats_server.url, "agent")
    gw_link = NatsLink(nats_server.url, "gateway")
    relay = KvRelay(agent_link, "east")
    prefix = PrefixRouting(gw_link, "west", GatewayMetrics(load=dict))
    async with served(replica) as state:
        try:
            await _feed(replica, state, agent_link, gw_link, relay, prefix, nats_server.url)
        finally:
            await relay.close()
            await agent_link.close()
            await gw_link.close()


async def _feed(replica, state, agent_link, gw_link, relay, prefix, url) -> None:
    """Index, evictions, a gateway's forgetting, a replica restart, a late gateway."""
    agent_link.start()
    gw_link.start()
    assert await agent_link.wait_connected(10) and await gw_link.wait_connected(10)
    relay.sync([Followed("r1", "d", replica.url)])
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks + one token
    keys = prefix_keys(a, BS)
    replica.run(a)
    await eventually(lambda: prefix.index.match("east", "r1", keys) == 2)
    assert prefix.index.replicas("east", "d") == ("r1",)

    # Fill the 8-block pool with other prompts: a's blocks are evicted, and the index follows.
    for i in range(4):
        replica.run([100 * (i + 1) + t for t in range(9)])
    await eventually(lambda: prefix.index.match("east", "r1", keys) == 0)
    held = {block_key(h) for h, _ in replica.kv.block_pool.cached_items()}
    await eventually(lambda: all(prefix.index.holds("east", "r1", k) for k in held))

    # A gateway that missed batches drops the replica and asks for its full set.
    prefix.index.forget("east", "r1")
    replica.run([7, 7, 7, 7, 7])
    held = {block_key(h) for h, _ in replica.kv.block_pool.cached_items()}
    await eventually(lambda: all(prefix.index.holds("east", "r1", k) for k in held), timeout=20)

    # The replica restarts (new engine, empty cache, new epoch): a snapshot replaces all.
    state.engine.kv_events = replica.log = KvEventLog(BS)
    replica.kv = KVCacheManager(num_blocks=8, block_size=BS, events=replica.log)
    await eventually(lambda: not any(prefix.index.holds("east", "r1", k) for k in held))
    replica.run(a)
    await eventually(lambda: prefix.index.match("east", "r1", keys) == 2)
    assert prefix.events.labels("resync")._value.get() >= 1

    # A gateway that connects later asks for every replica's full set at once.
    late_link = NatsLink(url, "late-gateway")
    late = PrefixRouting(late_link, "south", GatewayMetrics(load=dict), clusters=lambda: ["east"])
    late_link.start()
    try:
        await eventually(lambda: late.index.match("east", "r1", keys) == 2)
    finally:
        await late_link.close()


async def test_a_replica_without_kv_events_is_asked_once_until_it_changes(nats_server) -> None:
    """A replica that answers 404 (the sim runtime's) is left alone across the agent's
    syncs, each a second apart in the daemon, instead of being asked (and logged) again on
    every one; a new replica under the same id is asked afresh."""
    asked: list[str] = []
    app = FastAPI()

    @app.get("/kv/events", status_code=404)
    async def no_events() -> dict[str, str]:
        asked.append("x")
        return {"detail": "no KV events"}

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    serve = asyncio.create_task(server.serve())
    link = NatsLink(nats_server.url, "agent")
    relay = KvRelay(link, "east")
    try:
        await eventually(lambda: server.started)
        first = Followed("r1", "d", f"http://127.0.0.1:{port}")
        relay.sync([first])
        await eventually(lambda: len(asked) == 1)
        for _ in range(5):
            await asyncio.sleep(0.05)
            relay.sync([first])
        await asyncio.sleep(0.2)
        assert len(asked) == 1

        relay.sync([Followed("r1", "d", f"http://localhost:{port}")])  # replaced: a new address
        await eventually(lambda: len(asked) == 2)
        relay.sync([])
        relay.sync([first])  # gone and back: asked again
        await eventually(lambda: len(asked) == 3)
    finally:
        await relay.close()
        await link.close()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve, 10)
