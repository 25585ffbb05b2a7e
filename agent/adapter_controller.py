"""The adapter controller: apply each deployment's LoRA adapter catalog to its ready
replicas, live (no restart). A new replica preloads its share (`agent.adapters.spread`),
adapters the catalog dropped are unloaded, and what each holds is reported (heartbeats,
replicas.json)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from agent.adapters import ReplicaAdapters, spread
from agent.replica import Replica, lora_slots, ready_replicas
from fleet_base.protocol import DesiredState

log = logging.getLogger("agent")


@dataclass(eq=False)
class AdapterController:
    """Every interval, `sync` the ready replicas with their deployments' catalogs."""

    api: ReplicaAdapters
    replicas: Callable[[], dict[str, Replica]]
    desired: Callable[[], DesiredState | None]
    interval_s: float
    # Told, after every sync, the URIs of the adapters replicas here hold (the node cache
    # pins them: agent.models.ModelPuller.use_adapters).
    on_in_use: Callable[[set[str]], None] = lambda uris: None

    async def run(self) -> None:
        while True:
            ready = ready_replicas(self.replicas())
            try:
                await self.sync(ready)
            except Exception:  # never let the loop die
                log.exception("syncing LoRA adapters failed")
            await asyncio.sleep(self.interval_s)

    async def sync(self, ready: list[Replica]) -> None:
        desired = self.desired()
        wanted = {s.replica_id: s for s in desired.replicas} if desired else {}
        groups: dict[str, list[Replica]] = {}
        for r in ready:
            spec = wanted.get(r.replica_id)
            if spec is not None and spec.adapters != r.spec.adapters:  # applied live, no restart
                r.spec = r.spec.model_copy(update={"adapters": spec.adapters})
            if lora_slots(r.spec) > 0 and r.handle is not None:
                groups.setdefault(r.spec.deployment, []).append(r)
        for deployment, reps in groups.items():
            catalog = {a.name: a.uri for a in reps[0].spec.adapters}
            room = lora_slots(reps[0].spec)
            # Over every replica wanted here, ready or not, so the first one up does not
            # take the shares of those still starting.
            ids = [s.replica_id for s in wanted.values() if s.deployment == deployment]
            share = spread(list(catalog), ids or [r.replica_id for r in reps], room)
            for r in reps:
                assert r.handle is not None
                loaded = await self.api.loaded(r.handle.url)
                if loaded is None:
                    continue
                for name in [n for n in loaded if n not in catalog]:
                    if await self.api.unload(r.handle.url, name, r.spec.engine):
                        loaded.remove(name)
                if not r.adapters_seeded:
                    for name in share.get(r.replica_id, []):
                        if name not in loaded and len(loaded) < room:
                            if await self.api.load(r.handle.url, name, catalog[name], r.spec.engine):
                                loaded.append(name)
                    r.adapters_seeded = True
                r.adapters = loaded
        self.on_in_use(
            {a.uri for r in self.replicas().values() for a in r.spec.adapters if a.name in r.adapters}
        )

    async def close(self) -> None:
        await self.api.http.aclose()
