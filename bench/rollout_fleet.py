"""A real Fleet whose rollouts replace real engine replicas, for streams to ride through.

nats-server, the control plane, one agent running the `process` runtime and its gateway,
as processes (`tests.e2e.sim_fleet.SimFleet` with `runtime="process"`), serving one
deployment on `replicas` engine replicas (SmolLM2 unless told otherwise). The cluster has
room for twice that and the deployment a surge budget of as many (`max_unavailable` 0),
so a one-step rollout (`fleetctl rollout start ... --steps 100`) starts every canary
replica at once and the control plane gives up each old replica as a new one becomes
ready: the agent stops it (SIGTERM), the engine stops admitting and hands its streams
over after `--drain-handover`, and the gateway continues them on the new version. At
its peak the fleet runs 2 x `replicas` engine processes (the default, 1, keeps a shared
2-core box at two).

Shared by `bench.stream_migration` (the rollout scenario) and
tests/e2e/test_stream_migration_rollout.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.stream_migration import DEPLOYMENT, StreamResult, run_streams
from tests.polling import eventually

REGION = "local-east"
ROOT = Path(__file__).resolve().parents[1]


def replica_args(max_model_len: int) -> list[str]:
    """One thread per replica (the box is shared); a short hand-over, so a drain moves
    its streams at once rather than after the default 5 s."""
    return ["--threads", "1", "--max-model-len", str(max_model_len), "--drain-handover", "0.3"]


@dataclass
class Through:
    """Streams that ran through one rollout: `runs[i]` every stream of worker i in order;
    clocks are `time.monotonic()`."""

    runs: list[list[StreamResult]]
    started_at: float = 0.0  # fleetctl rollout start ran
    replaced_at: float = 0.0  # the old replicas were gone
    removed_at: list[float] = field(default_factory=list)  # the control plane gave each up
    answer: dict = field(default_factory=dict)  # fleetctl's JSON
    view: dict = field(default_factory=dict)  # the promoted rollout

    def across_removal(self) -> list[StreamResult]:
        """The streams in flight when an old replica was given up (those were migrated)."""
        return [
            r
            for run in self.runs
            for r in run
            if r.chunk_times and any(r.chunk_times[0] < t < r.chunk_times[-1] for t in self.removed_at)
        ]


class RolloutFleet:
    def __init__(
        self,
        home: Path,
        *,
        model: str = "smollm2-135m",
        name: str = DEPLOYMENT,
        replicas: int = 1,
        max_model_len: int = 512,
    ) -> None:
        from tests.e2e.sim_fleet import SimFleet

        self.home = home
        self.model = model
        self.name = name
        self.replicas = replicas
        self.fleet = SimFleet(
            home,
            [REGION],
            slots=2 * replicas,
            runtime="process",
            replica_args=[*replica_args(max_model_len), "--log-level", "warning"],
        )
        self.version = 1

    @property
    def gateway(self) -> str:
        return self.fleet.gateways[REGION]

    @property
    def key(self) -> str:
        return self.fleet.key

    def up(self, timeout: float = 300.0) -> RolloutFleet:
        from tests.e2e.sim_fleet import wait_for

        try:
            self.fleet.up()
            body = {
                "name": self.name,
                "model": self.model,
                "replicas": self.replicas,
                "max_surge": self.replicas,
                "max_unavailable": 0,
            }
            r = self.fleet.api("POST", "/v1/deployments", json=body)
            if r.status_code != 201:
                raise RuntimeError(f"deploy failed: {r.status_code} {r.text}")
            wait_for(
                lambda: self.fleet.ready_by_version(self.name) == {1: self.replicas},
                timeout,
                0.2,
                f"{self.replicas} ready replicas of {self.model}",
            )
        except BaseException:
            self.down()
            raise
        return self

    def pids(self, version: int) -> dict[str, int]:
        """replica id -> pid of this version's replica processes, as the agent reports them."""
        ids = {
            p["replica_id"] for p in self.fleet.deployment(self.name)["placements"] if p["version"] == version
        }
        state = self.fleet.local.load()
        assert state is not None
        return {
            rec.name.split("/", 1)[1]: rec.pid
            for rec in self.fleet.local.replicas(state)
            if rec.name.split("/", 1)[1] in ids
        }

    def _fleetctl_rollout(self) -> subprocess.CompletedProcess[str]:
        """`fleetctl rollout start` to the next version, one step to 100%, promoted one
        second after its replicas are ready. The new version changes an engine flag that
        leaves the output alone (a new model build takes the same path)."""
        self.version += 1
        env = {**os.environ, "FLEET_HOME": str(self.home), "PYTHONPATH": str(ROOT)}
        env.pop("FLEET_API_URL", None)
        env.pop("FLEET_TOKEN", None)
        argv = [sys.executable, "-m", "control_plane.cli", "rollout", "start", self.name]
        argv += ["-e", f"stall_timeout={60 + self.version}", "--steps", "100", "--step-duration", "1s"]
        argv += ["--min-requests", "0", "-o", "json"]
        proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"fleetctl rollout start failed ({proc.returncode}): {proc.stderr}")
        return proc

    def streams(
        self, texts: list[str], max_tokens: int, **kw: Any
    ) -> tuple[list[StreamResult], float | None]:
        """`bench.stream_migration.run_streams` through this fleet's gateway."""
        extra = {"model": self.name, **kw.pop("extra", {})}
        return asyncio.run(run_streams(self.gateway, self.key, texts, max_tokens, extra=extra, **kw))

    def streams_through_rollout(
        self,
        texts: list[str],
        max_tokens: int,
        extra: dict | None = None,
        timeout: float = 300.0,
        stagger_s: float = 0.3,
        overlap: float = 1 / 3,
    ) -> Through:
        """One worker per text streams it again and again while `fleetctl rollout start`
        replaces every replica; the workers stop once the old replicas are gone
        (`replaced`). A worker starts its next stream as soon as the current one has
        `overlap` x `max_tokens` content chunks, not when it ends: one after the other,
        a worker's streams leave gaps (the next one's time to first token) and the
        engine's batching pulls all workers into step, so a removal could find every
        stream between two requests, and a wave that ends between the removal and the
        hand-over leaves none to hand over. Overlapped, a worker's newest stream that
        has begun has at least (1 - overlap) of it to run, less the next one's wait for
        its first chunk (arrivals are admitted in bursts under load: a third, not a
        half, holds there), so every worker has a stream on the old replica when it
        is given up. Worker i starts `i * stagger_s` late."""
        extra = {"model": self.name, **(extra or {})}
        lead = max(1, round(max_tokens * overlap))
        return asyncio.run(self._through(texts, max_tokens, extra, timeout, stagger_s, lead))

    async def _through(
        self, texts: list[str], max_tokens: int, extra: dict, timeout: float, stagger_s: float, lead: int
    ) -> Through:
        old = self.pids(self.version)
        out = Through(runs=[[] for _ in texts])
        stop = asyncio.Event()

        async def worker(i: int) -> None:
            await asyncio.sleep(i * stagger_s)
            streams: list[asyncio.Task] = []
            try:
                while not stop.is_set():
                    under_way = asyncio.Event()  # run_streams' mid-stream hook: `lead` chunks arrived
                    one = run_streams(
                        self.gateway,
                        self.key,
                        [texts[i]],
                        max_tokens,
                        extra=extra,
                        kill=under_way.set,
                        kill_after_chunks=lead,
                    )
                    streams.append(asyncio.create_task(one))
                    waiting = asyncio.create_task(under_way.wait())
                    await asyncio.wait({streams[-1], waiting}, return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
            finally:
                for done in await asyncio.gather(*streams, return_exceptions=True):
                    if isinstance(done, BaseException):  # the client saw it fail: an error, not lost
                        out.runs[i].append(StreamResult(error={"exception": repr(done)}))
                    else:
                        out.runs[i] += done[0]

        tasks = [asyncio.create_task(worker(i)) for i in range(len(texts))]
        try:
            await asyncio.sleep(len(texts) * stagger_s)  # every worker has started
            out.started_at = time.monotonic()
            proc = await asyncio.to_thread(self._fleetctl_rollout)
            out.answer = json.loads(proc.stdout)
            out.view = await eventually(
                lambda: asyncio.to_thread(self.replaced, old), timeout, "the old replicas replaced", 0.2
            )
            out.replaced_at = time.monotonic()
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        out.removed_at = self._removed_at(set(old))
        return out

    def _removed_at(self, ids: set[str]) -> list[float]:
        """When the control plane gave up each old replica, on this process's monotonic clock."""
        r = self.fleet.api("GET", "/v1/events", params={"deployment": self.name, "kind": "removed"})
        r.raise_for_status()
        offset = time.time() - time.monotonic()
        return sorted(
            datetime.fromisoformat(e["at"].replace("Z", "+00:00")).timestamp() - offset
            for e in r.json()["items"]
            if e.get("replica_id") in ids
        )

    def rollout(self) -> dict:
        return self.fleet.api("GET", f"/v1/deployments/{self.name}/rollouts/current").json()

    def replaced(self, old: dict[str, int]) -> dict | None:
        """The rollout view once it is promoted, only the new version's replicas are
        ready and every `old` process has exited; else None."""
        from control_plane.local.fleet import pid_alive

        view = self.rollout()
        if view.get("phase") != "promoted":
            return None
        if self.fleet.ready_by_version(self.name) != {self.version: self.replicas}:
            return None
        if any(pid_alive(pid) for pid in old.values()):
            return None
        return view

    def stop_events(self, replica_ids: set[str]) -> dict[str, str] | None:
        """replica id -> the message of its `replica_stopped` event (the agent's stop),
        once every one of `replica_ids` has one; else None."""
        r = self.fleet.api("GET", "/v1/events", params={"deployment": self.name, "kind": "replica_stopped"})
        r.raise_for_status()
        out = {e["replica_id"]: e["message"] for e in r.json()["items"] if e.get("replica_id") in replica_ids}
        return out if set(out) == replica_ids else None

    def down(self) -> None:
        self.fleet.down()
