"""Prefix-aware routing end to end: a real agent (`python -m agent`) runs two engine
replicas of a tiny checkpoint and relays their KV events over a real nats-server; the
gateway (in this process, on a real socket) indexes them and sends each conversation's
later turns to the replica that holds its prefix."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from agent.gateway.prefix import prefix_keys
from agent.gateway.tenancy import cache_salt
from fleet_base.ports import free_port
from fleet_base.protocol import ReplicaSpec
from tests.agent.conftest import cluster_config, live_gateway, seed_cluster
from tests.polling import eventually


async def test_later_turns_follow_their_prefix(tmp_path, nats_server, model_dir, agent_factory) -> None:
    port = free_port()
    cfg = cluster_config(tmp_path, nats_server.url, gateway={"port": port, "routing": "prefix"})
    specs = [
        ReplicaSpec(replica_id=f"tiny-{i}", deployment="tiny", version=1, model=str(model_dir))
        for i in range(2)
    ]
    key_id, secret = await seed_cluster(nats_server.url, cfg.cluster, specs)
    agent_factory(cfg).start()
    headers = {"Authorization": f"Bearer {secret}"}
    async with live_gateway(cfg) as (gateway, client):

        async def ready() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await client.get("/health")).json()["ready_replicas"].get("tiny", 0) == 2
            return False

        await eventually(ready, 90, "two ready replicas")
        index = gateway.prefix.index
        tok = gateway.tokens.tokenizer("tiny")
        assert tok is not None

        def prompt(conv: int, turn: int) -> str:
            return f"conversation {conv} is about topic {conv * 7}. " * 3 + " and then more" * (3 * turn)

        def keys(text: str) -> tuple[int, ...]:
            # the key's salt, as the gateway gives the replica: unsalted blocks never match
            return prefix_keys(
                tok.encode(text, True), gateway.prefix.block_tokens("tiny"), cache_salt(key_id)
            )

        async def complete(text: str) -> None:
            body = {"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0}
            r = await client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text

        def holder(text: str) -> str | None:
            k = keys(text)
            held = [rid for rid in ("tiny-0", "tiny-1") if index.match(cfg.cluster, rid, k) == len(k)]
            return held[0] if len(held) == 1 else None

        # First turns at once: least outstanding work spreads them over both replicas.
        await asyncio.gather(*(complete(prompt(c, 0)) for c in range(4)))

        async def all_indexed() -> bool:
            return all(holder(prompt(c, 0)) for c in range(4))

        await eventually(all_indexed, 30, "first turns in the gateway's index")
        home = {c: holder(prompt(c, 0)) for c in range(4)}
        assert set(home.values()) == {"tiny-0", "tiny-1"}
        # Later turns one at a time (idle replicas: least-load would pick tiny-0 every time).
        for turn in (1, 2):
            for c in range(4):
                before = _choices(gateway)
                await complete(prompt(c, turn))
                after = _choices(gateway)
                assert [rid for rid, n in after.items() if n > before.get(rid, 0)] == [home[c]]

                async def indexed(text: str = prompt(c, turn), rid: str = home[c]) -> bool:
                    k = keys(text)
                    return index.match(cfg.cluster, rid, k) == len(k)

                await eventually(indexed, 20, "the new turn's blocks in the index")
        reasons = {
            s.labels["reason"]: s.value for s in _samples(gateway, "fleet_gateway_routing_decisions_total")
        }
        assert reasons.get("prefix", 0) >= 8


def _samples(gateway, name: str):
    for family in gateway.metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                yield s


def _choices(gateway) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in _samples(gateway, "fleet_gateway_replica_choice_total")}
