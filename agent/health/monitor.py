"""The node-health monitor: each tick it reads the signals (NVML, replica failures, the
correctness probe, operators' actions), steps each node's state machine
(agent.health.state), and acts on what changed.

- each fault in heartbeats for `fault_report_s` and each node's state in every heartbeat:
  the control plane stores each fault once and makes the `node_fault` and `node_state`
  events from them (one record, however many heartbeats repeat it); here they are logged.
- a node that is cordoned, drained or retired has its capacity withheld: the heartbeat's
  pools shrink by it (`pools`), so the control plane's placer moves its replicas away; the
  ones there drain through the reconciler's usual path (a replica no longer desired here is
  kept while its deployment lacks ready replicas, then drained: in-flight requests finish,
  the gateway migrates streams).
- the runtime is told (`cordon_node`, `uncordon_node`, `recycle_node`): on Kubernetes the
  node is cordoned and tainted and its pods recycled; the local runtimes do nothing more.
- nodes.json for the gateway's metrics (agent.health.snapshot).

Where replicas run: `Runtime.replica_node` (the host on the process and sim runtimes,
the pod's node on Kubernetes); NVML faults belong to this host's node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from agent.health import probe as probing
from agent.health.classify import (
    Classified,
    CrashWindow,
    classified,
    classify_gpu,
    classify_replica_failure,
    evidence_line,
)
from agent.health.nvml import NvmlSource
from agent.health.readings import GpuReading
from agent.health.snapshot import FaultCount, NodeSnapshot, save
from agent.health.state import NodePolicy, Transition
from agent.replica import Replica
from agent.runtime import Runtime
from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import CAPABILITIES
from fleet_base.local_state import LocalState
from fleet_base.node_health import MAX_FAULTS, FaultKind, NodeFault, NodeHealth, local_node_name
from fleet_base.protocol import DesiredState, PoolInventory, ReplicaState

log = logging.getLogger("agent.health")

# a failed replica is restarted where it was, unless the control plane re-places it
ON_NODE = (
    ReplicaState.pending,
    ReplicaState.starting,
    ReplicaState.ready,
    ReplicaState.draining,
    ReplicaState.failed,
)
LOCAL_RUNTIMES = ("process", "sim")


@dataclass(eq=False)
class NodeHealthMonitor:
    config: ClusterConfig
    runtime: Runtime
    replicas: Callable[[], dict[str, Replica]]
    desired: Callable[[], DesiredState | None]
    files: LocalState
    clock: Callable[[], float]
    headers: dict[str, str] = field(default_factory=dict)  # the replica credentials
    http: httpx.AsyncClient | None = None
    nvml: NvmlSource | None = None  # None: NVML itself (or its stand-in, FLEET_NVML_STANDIN)
    gpus: int = 0  # this host's accelerators (or CPU slots) where NVML does not say
    policies: dict[str, NodePolicy] = field(default_factory=dict)
    recent: dict[str, tuple[NodeFault, float]] = field(default_factory=dict)
    errors: Counter[tuple[str, int | None, FaultKind]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        s = self.config.health
        self.host = local_node_name(self.config.node_name)
        self.source = self.nvml or NvmlSource(cluster=self.config.cluster)
        self.probes = probing.ProbeTracker(s)
        self.crashes = CrashWindow(s.crash_loop_crashes, s.crash_loop_window_s, {})
        self._readings: dict[int, GpuReading] = {}
        self._nvml_at: float | None = None
        self._failed_seen: dict[str, float] = {}
        self._node_of: dict[str, str] = {}
        self._pools_of: dict[str, set[str]] = {}
        self.policy(self.host)

    def policy(self, node: str) -> NodePolicy:
        if node not in self.policies:
            self.policies[node] = NodePolicy(node=node, settings=self.config.health, since=self.clock())
        return self.policies[node]

    # ------------------------------------------------------------ what the heartbeat says

    def nodes(self) -> list[NodeHealth]:
        return [
            p.health(self.source.status if node == self.host else "")
            for node, p in sorted(self.policies.items())
        ]

    def faults(self, now: float) -> list[NodeFault]:
        for fid, (_, at) in list(self.recent.items()):
            if now - at > self.config.health.fault_report_s:
                del self.recent[fid]
        return [f for f, _ in self.recent.values()][-MAX_FAULTS:]

    def withheld(self) -> list[str]:
        return sorted(node for node, p in self.policies.items() if p.withheld)

    def pools(self, pools: list[PoolInventory]) -> list[PoolInventory]:
        """The pools less the withheld nodes: the host's on a local runtime (its pools are
        this host's), else each withheld node's pools (those its replicas used)."""
        short: Counter[str] = Counter()
        for node in self.withheld():
            if self.runtime.name in LOCAL_RUNTIMES and node == self.host:
                short.update({p.name: 1 for p in pools})
            else:
                short.update(dict.fromkeys(self._pools_of.get(node, ()), 1))
        if not short:
            return pools
        return [
            p.model_copy(update={"nodes": max(0, p.nodes - short[p.name])}) if short[p.name] else p
            for p in pools
        ]

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("node health tick failed")
            await asyncio.sleep(min(1.0, self.config.heartbeat_interval_s))

    async def tick(self) -> list[Transition]:
        now = self.clock()
        replicas = self.replicas()
        await self._locate(replicas)
        found: list[Classified] = []
        found += await self._read_nvml(now)
        found += self._replica_failures(replicas, now)
        probe_faults, clean = await self._probe(replicas, now)
        found += probe_faults
        desired = self.desired()
        actions = desired.node_actions if desired is not None else []
        on_node = Counter(
            self._node_of.get(r.replica_id, self.host) for r in replicas.values() if r.state in ON_NODE
        )
        for c in found:
            self.policy(c.fault.node)
        for a in actions:  # an operator may cordon a node no replica of ours has used yet
            if a.node == self.host or a.node in self.policies:
                self.policy(a.node)
        self.policy(self.host).gpus = self._host_gpus()
        transitions: list[Transition] = []
        for node, policy in self.policies.items():
            mine = [c for c in found if c.fault.node == node]
            _, moved = policy.step(now, mine, on_node[node], actions, clean_probe=node in clean)
            transitions += moved
        for c in found:
            self._record(c, now)
        for t in transitions:
            await self._transition(t)
        self._save()
        return transitions

    # ------------------------------------------------------------ signals

    async def _locate(self, replicas: dict[str, Replica]) -> None:
        for rid in [rid for rid in self._node_of if rid not in replicas]:
            del self._node_of[rid]
        for rid, r in replicas.items():
            if rid not in self._node_of or r.state != ReplicaState.ready:  # a restart may move it
                try:
                    node = await self.runtime.replica_node(rid)
                except Exception:
                    node = None
                if node:
                    self._node_of[rid] = node
            node = self._node_of.get(rid, self.host)
            if r.spec.pool:
                self._pools_of.setdefault(node, set()).add(r.spec.pool)

    def _host_gpus(self) -> int:
        return len(self._readings) or self.gpus

    async def _read_nvml(self, now: float) -> list[Classified]:
        if self._nvml_at is not None and now - self._nvml_at < self.config.health.nvml_interval_s:
            return []
        self._nvml_at = now
        readings = await asyncio.to_thread(self.source.read)
        out = []
        for g in readings:
            out += classify_gpu(
                self.host,
                self._readings.get(g.index),
                g,
                now,
                ecc_rise=self.config.health.ecc_uncorrectable_rise,
            )
            self._readings[g.index] = g
        return out

    def _replica_failures(self, replicas: dict[str, Replica], now: float) -> list[Classified]:
        out: list[Classified] = []
        for rid in [rid for rid in self._failed_seen if rid not in replicas]:
            del self._failed_seen[rid]
        for rid, r in replicas.items():
            if (
                r.state != ReplicaState.failed
                or r.failed_at is None
                or self._failed_seen.get(rid) == r.failed_at
            ):
                continue
            self._failed_seen[rid] = r.failed_at
            node = self._node_of.get(rid, self.host)
            kind = classify_replica_failure(r.last_error)
            evidence = evidence_line(r.last_error)
            if kind is not None:
                out.append(self._fault(node, kind, evidence, r, now))
            if kind in (None, FaultKind.cuda_error, FaultKind.stall) and r.last_error.startswith(
                ("exited", "the engine loop", "stopped answering")
            ):
                source = f"{r.spec.deployment}@{r.spec.version}"
                if self.crashes.crash((node, r.spec.pool), now, source):
                    s = self.config.health
                    why = f"{s.crash_loop_crashes} replica crashes within {s.crash_loop_window_s:.0f} s; the last: {evidence}"
                    out.append(self._fault(node, FaultKind.crash_loop, why, r, now))
        return out

    def _fault(self, node: str, kind: FaultKind, evidence: str, r: Replica, now: float) -> Classified:
        return classified(
            NodeFault(
                node=node,
                kind=kind,
                at=now,
                evidence=evidence[:512],
                replica_id=r.replica_id,
                deployment=r.spec.deployment,
            )
        )

    async def _probe(self, replicas: dict[str, Replica], now: float) -> tuple[list[Classified], set[str]]:
        """Probe the ready replicas that are due; (faults, nodes with a clean answer)."""
        keys = {rid: f"{rid}@{r.started_at}" for rid, r in replicas.items()}
        self.probes.forget(set(keys.values()))
        if self.http is None:
            return [], set()
        due = [
            r
            for rid, r in replicas.items()
            if r.state == ReplicaState.ready
            and r.handle is not None
            and CAPABILITIES[r.spec.engine].batch_invariant  # else a batch may change the answer
            and self.probes.due(keys[rid], _group(r), now, busy=r.load.running + r.load.waiting > 0)
        ]
        results = await asyncio.gather(*(self._probe_one(r, keys[r.replica_id], now) for r in due))
        faults = [c for c in results if isinstance(c, Classified)]
        clean = {self._node_of.get(r.replica_id, self.host) for r, c in zip(due, results) if c is True}
        return faults, clean

    async def _probe_one(self, r: Replica, key: str, now: float) -> Classified | bool | None:
        """A confirmed wrong answer (a fault), True for a right one, None for no answer."""
        assert self.http is not None and r.handle is not None
        group = _group(r)
        for _ in range(2):  # a mismatch is probed again at once
            answer = await probing.ask(
                self.http, r.handle.url, r.spec.deployment, self.headers, self.config.health.probe_max_tokens
            )
            if answer is None:
                return None
            verdict = self.probes.observe(key, group, answer, now)
            if verdict in (probing.Verdict.ok, probing.Verdict.baseline):
                return True
            if verdict == probing.Verdict.wrong:
                expected = self.probes.expected(key)
                why = f"probe answer {_short(answer)} differs from {_short(expected)}"
                node = self._node_of.get(r.replica_id, self.host)
                return self._fault(node, FaultKind.wrong_answer, why, r, now)
            log.info("replica %s: probe answer differs; probing again", r.replica_id)
        return None

    # ------------------------------------------------------------ acting

    def _record(self, c: Classified, now: float) -> None:
        f = c.fault
        self.recent[f.fault_id] = (f, now)
        self.errors[(f.node, f.gpu, f.kind)] += 1
        gpu = f" GPU {f.gpu}" if f.gpu is not None else ""
        message = f"{f.kind.value} on node {f.node}{gpu} ({c.severity.value}): {f.evidence}"
        log.warning("node fault: %s", message)

    async def _transition(self, t: Transition) -> None:
        log.warning("node %s: %s -> %s (%s)", t.node, t.old.value, t.new.value, t.reason)
        out = ("cordoned", "drained", "retired")
        try:
            if t.new.value in ("cordoned", "retired") and t.old.value not in out:
                await self.runtime.cordon_node(t.node, t.reason)
                recycled = await self.runtime.recycle_node(t.node)
                if recycled:
                    log.info("node %s: recycled replicas %s", t.node, ", ".join(recycled))
            elif t.new.value == "remediated":
                await self.runtime.uncordon_node(t.node)
        except Exception as err:
            log.warning("node %s: the runtime could not act on %s: %s", t.node, t.new.value, err)

    def _save(self) -> None:
        errors = [
            FaultCount(node=n, gpu=g, kind=k, count=c)
            for (n, g, k), c in sorted(
                self.errors.items(), key=lambda x: (x[0][0], x[0][1] or -1, x[0][2].value)
            )
        ]
        with contextlib.suppress(OSError):
            save(self.files, NodeSnapshot(nodes=self.nodes(), errors=errors))


def _group(r: Replica) -> str:
    return f"{r.spec.deployment}@{r.spec.version}:{r.spec.model}"


def _short(answer: probing.Answer | None) -> str:
    return repr(answer)[:80]
