"""Multi-LoRA on a local fleet: a real agent (`python -m agent`) runs two engine replicas of
a tiny checkpoint over a real nats-server, with four PEFT adapters and room for two on
each replica. The agent preloads a spread and reports what each replica holds; the gateway
(in this process, on a real socket) sends every adapter request where its adapter is
resident, and loads one where there is room after it was unloaded."""

from __future__ import annotations

import asyncio

from bench.lora import write_random_adapter
from engine.loader import read_model_config
from fleet_base.ports import free_port
from fleet_base.protocol import LoRAAdapterSpec, ReplicaSpec
from tests.agent.conftest import cluster_config, live_gateway, seed_cluster
from tests.polling import eventually

ADAPTERS = [f"ad{i}" for i in range(4)]


def _outcomes(gateway) -> dict[str, float]:
    """Adapter requests by outcome; outcomes that never happened (series at zero) left out."""
    out: dict[str, float] = {}
    for family in gateway.metrics.registry.collect():
        for s in family.samples:
            if s.name == "fleet_gateway_adapter_requests_total" and s.value:
                out[s.labels["outcome"]] = s.value
    return out


async def test_adapter_requests_follow_residency(tmp_path, nats_server, model_dir, agent_factory) -> None:
    cfg_model = read_model_config(model_dir)
    catalog = [
        LoRAAdapterSpec(name=n, uri=str(write_random_adapter(tmp_path / n, cfg_model, rank=4, seed=i)))
        for i, n in enumerate(ADAPTERS)
    ]
    port = free_port()
    cfg = cluster_config(tmp_path, nats_server.url, gateway={"port": port})
    specs = [
        ReplicaSpec(
            replica_id=f"tiny-{i}",
            deployment="tiny",
            version=1,
            model=str(model_dir),
            adapters=catalog,
            max_adapters=2,
        )
        for i in range(2)
    ]
    _, secret = await seed_cluster(nats_server.url, cfg.cluster, specs)
    agent_factory(cfg).start()
    headers = {"Authorization": f"Bearer {secret}"}
    async with live_gateway(cfg) as (gateway, client):

        def held() -> dict[str, list[str]]:
            gateway.view.refresh(force=True)
            return {r.replica_id: sorted(r.adapters) for r in gateway.view.ready("tiny")}

        async def preloaded() -> bool:
            h = held()
            return len(h) == 2 and sorted(a for v in h.values() for a in v) == ADAPTERS

        try:
            await eventually(preloaded, 120, "two ready replicas holding two adapters each", 0.2)
        except AssertionError:
            print(held(), (tmp_path / "agent-1.log").read_text()[-3000:])
            raise
        models = (await client.get("/v1/models", headers=headers)).json()["data"]
        assert {m["id"]: m.get("parent") for m in models} == {
            "tiny": None,
            **dict.fromkeys(ADAPTERS, "tiny"),
        }

        async def complete(model: str) -> str:
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
            r = await client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            return r.headers.get("x-fleet-cluster", "")

        # Every adapter (and the base) at once, three rounds: all served, all where resident.
        await asyncio.gather(*(complete(m) for _ in range(3) for m in [*ADAPTERS, "tiny"]))
        outcomes = _outcomes(gateway)
        assert outcomes == {"resident": 12.0}, outcomes

        # Unload one behind the gateway's back (as an operator would); once the agent has
        # reported it, the next request for it loads it where there is room.
        holder = next(rid for rid, names in held().items() if "ad0" in names)
        url = next(r.url for r in gateway.view.ready("tiny") if r.replica_id == holder)
        r = await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad0"})
        assert r.status_code == 200, r.text

        async def reported() -> bool:
            return all("ad0" not in names for names in held().values())

        await eventually(reported, 30, "the agent to report ad0 unloaded", 0.2)
        await complete("ad0")
        outcomes = _outcomes(gateway)
        assert outcomes.get("loaded") == 1.0 and "failed" not in outcomes, outcomes
        hit_rate = outcomes["resident"] / sum(outcomes.values())
        print(f"adapter hit rate {hit_rate:.2%} over {sum(outcomes.values()):.0f} adapter requests")
