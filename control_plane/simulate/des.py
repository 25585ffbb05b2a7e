"""Discrete-event simulation of one deployment in virtual time: a trace's requests go
through the gateway's own routing plan (`agent.gateway.plan`, over the same prefix index
the gateway keeps, fed by the simulated replicas' prefix caches as the engines' KV events
feed it live) to simulated replicas (`agent.sim.model`, timing from a profile), while a
real autoscaling policy (`control_plane.autoscale`) decides the replica count every tick.

- a request with no ready replica waits in the gateway queue (and, with nothing starting,
  triggers a scale-from-zero decision at once, as a live gateway's demand signal does);
  when a replica becomes ready the queue drains to it;
- a new replica is ready `cold_start_s` after the decision; removing replicas cancels
  starting ones first, then drains the ready ones with the least work (no new requests;
  released when idle);
- GPU time counts every replica from decision to release (starting, serving, draining).

Replicas have a host KV tier when the profile gives one (`host_kv_bytes`): evicted prefix
blocks move there, the index learns it from their events as the gateway's does (ops naming
the tier), and the plan scores a host hit by its load (`fleet_base.kv_tier_cost`), with the
profile's value of a host token.
`shared_cache_blocks` instead gives every replica one shared cache of that many blocks (the
shared-cache bound, `simulate.bounds`).

Events are few per request (arrival, first token, finish) plus one per tick, so an hour
of trace runs in seconds."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.gateway.kv_index import KvUpdate, Op, PrefixIndex
from agent.gateway.plan import ClusterFacts, CostModel, ReplicaFacts, RequestFacts, plan_route
from agent.sim.model import ReplicaModel, SimRequest
from agent.sim.prefix_cache import Ops, PrefixCacheModel, capacity_blocks
from control_plane.autoscale.policy import AutoscaleSettings, Decision, Observation, ScalerState, make_policy
from control_plane.simulate.trace import TraceRequest
from fleet_base.kv_tier_cost import PendingPrefills, profile_host_token_value, profile_timing
from fleet_base.profile import PerfProfile

SAMPLE_PER_TICK = 32  # prompt lengths a decision sees of the requests that arrived since the last


@dataclass
class SimReplica:
    rid: str
    model: ReplicaModel
    created: float
    ready_at: float
    draining: bool = False
    released: float | None = None
    outstanding_tokens: int = 0
    in_flight: int = 0
    kv_seq: int = 0  # sequence number of its last KV-event batch
    prefill_tokens: int = 0  # new prefill of its requests with no first token yet
    pending: PendingPrefills = field(default_factory=PendingPrefills)  # those, by request


@dataclass
class Sample:
    at: float
    replicas: int  # allocated: starting + ready + draining
    ready: int
    desired: int
    demand: float
    arrivals: int  # in the tick


@dataclass
class RunResult:
    policy: str
    requests: list[SimRequest]
    samples: list[Sample]
    replica_seconds: float
    cold_starts: int
    decisions: list[tuple[float, int, str]] = field(default_factory=list)
    end: float = 0.0
    warmup_s: float = 0.0  # requests before it, and GPU time before it, are not counted
    routing: str = "prefix"

    @property
    def measured(self) -> list[SimRequest]:
        return [r for r in self.requests if r.arrival >= self.warmup_s]


class Simulation:
    def __init__(
        self,
        trace: list[TraceRequest],
        profile: PerfProfile,
        settings: AutoscaleSettings,
        policy: str,
        *,
        tick_s: float = 2.0,
        initial_replicas: int = 1,
        routing: str = "prefix",
        warmup_s: float = 0.0,
        shared_cache_blocks: int = 0,
    ) -> None:
        self.warmup_s = warmup_s
        self.trace = trace
        self.profile = profile
        self.settings = (
            settings if settings.profile is not None else settings.model_copy(update={"profile": profile})
        )
        self.policy = make_policy(policy)
        self.policy_name = policy
        self.routing = routing
        self.cost = CostModel(routing=routing)
        self.index = PrefixIndex(max_blocks_per_replica=max(1, self._cache_blocks() + self._host_blocks()))
        self.host_token_value = profile_host_token_value(profile)
        self.timing = profile_timing(profile)
        self.shared_cache = PrefixCacheModel(shared_cache_blocks) if shared_cache_blocks > 0 else None
        self.tick_s = tick_s
        self.initial = initial_replicas
        self.replicas: list[SimReplica] = []
        self._by_id: dict[str, SimReplica] = {}
        self.live: list[SimReplica] = []  # not yet released
        self.pending: deque[SimRequest] = deque()  # gateway queue: no ready replica
        self.where: dict[int, tuple[SimReplica, int]] = {}  # request -> (replica, work sent)
        self.prefilling: dict[int, int] = {}  # request -> its new prefill, until its first token
        self.state = ScalerState()
        self.desired = initial_replicas
        self.cold_starts = 0
        self._n = 0
        self._ready_heap: list[tuple[float, int, str]] = []
        # What the gateways and replicas would report, since the last decision.
        self._last_obs = 0.0
        self._arrived = 0
        self._arrived_prompt = 0
        self._sample: list[int] = []
        self._generated: dict[str, int] = {}
        self._ttft: list[float] = []
        self._itl: list[float] = []
        # Called as each request finishes (a pipeline's next step starts from it).
        self.on_finished: Callable[[SimRequest, float], None] | None = None

    # ------------------------------------------------------------ replicas

    def _cache_blocks(self) -> int:
        block = next((t.block_tokens for t in self.trace if t.hash_ids), 0)
        return capacity_blocks(self.profile.kv_capacity_tokens, block)

    def _host_blocks(self) -> int:
        block = next((t.block_tokens for t in self.trace if t.hash_ids), 0)
        return self.profile.host_kv_tokens // block if block else 0

    def _add_replica(self, now: float, cold: bool) -> None:
        self._n += 1
        ready_at = now + (self.profile.cold_start_s if cold else 0.0)
        rid = f"r{self._n}"
        blocks = self._cache_blocks()
        cache = self.shared_cache
        if cache is None and blocks:
            cache = PrefixCacheModel(
                blocks,
                lambda ops, rid=rid: self._kv_events(rid, ops),
                self._host_blocks(),
                lambda ops, rid=rid: self._kv_events(rid, ops, host=True),
            )
        r = SimReplica(rid, ReplicaModel(self.profile, now, cache), now, ready_at)
        self.index.apply(KvUpdate("sim", rid, "sim", rid, 0, (), snapshot=True))
        self.replicas.append(r)
        self._by_id[rid] = r
        self.live.append(r)
        if cold:
            self.cold_starts += 1
            heapq.heappush(self._ready_heap, (ready_at, self._n, r.rid))

    def _ready(self, now: float) -> list[SimReplica]:
        return [r for r in self.live if not r.draining and r.ready_at <= now]

    def _release_idle_drained(self, now: float) -> None:
        for r in list(self.live):
            if r.draining and r.in_flight == 0:
                r.released = now
                self.live.remove(r)

    def _scale_to(self, want: int, now: float) -> None:
        active = [r for r in self.live if not r.draining]
        if want > len(active):
            for _ in range(want - len(active)):
                self._add_replica(now, cold=True)
            return
        extra = len(active) - want
        starting = sorted((r for r in active if r.ready_at > now), key=lambda r: -r.created)
        for r in starting[:extra]:
            r.draining = True
        extra -= min(extra, len(starting))
        ready = sorted(
            (r for r in active if r.ready_at <= now), key=lambda r: (r.in_flight, r.outstanding_tokens)
        )
        for r in ready[:extra]:
            r.draining = True
        self._release_idle_drained(now)

    # ------------------------------------------------------------ requests

    def _kv_events(self, rid: str, ops: Ops, host: bool = False) -> None:
        """A replica's cache changed: the batch reaches the index at once (one KV event,
        its ops naming the tier as the engine's do)."""
        r = self._by_id[rid]
        r.kv_seq += 1
        tiered: tuple[Op, ...] = tuple((kind, keys, "host") for kind, keys in ops) if host else tuple(ops)
        self.index.apply(KvUpdate("sim", rid, "sim", rid, r.kv_seq, tiered))

    def _route(self, req: SimRequest, now: float) -> bool:
        ready = self._ready(now)
        if not ready:
            return False
        here = ClusterFacts(
            "sim",
            tuple(
                ReplicaFacts(
                    r.rid,
                    "",
                    1,
                    r.outstanding_tokens,
                    r.in_flight,
                    host_token_value=self.host_token_value,
                    prefill_tokens=r.prefill_tokens,
                    wait_s=r.pending.wait_s(now, self.timing),
                    short_wait_s=(
                        r.pending.wait_s(now, self.timing, short=True) if self.timing.long_threshold else None
                    ),
                    timing=self.timing,
                )
                for r in ready
            ),
        )
        facts = RequestFacts(
            "sim", req.prompt_tokens, req.kv_tokens, True, 0.0, req.block_hashes, req.block_tokens
        )
        first = plan_route(facts, here, (), self.index, self.cost).stage("local")[0]
        r = next(x for x in ready if x.rid == first.name)
        work = req.kv_tokens - first.cached_tokens
        r.outstanding_tokens += work
        r.in_flight += 1
        prefill = max(0, req.prompt_tokens - first.cached_tokens)
        r.prefill_tokens += prefill
        self.where[req.rid] = (r, work)
        self.prefilling[req.rid] = prefill
        r.pending.add(now, prefill, key=req.rid)
        r.model.submit(req, now)
        return True

    def _on_events(self, r: SimReplica, events: list[SimRequest], now: float) -> None:
        for req in events:
            if req.first_token_at is not None and req.tag is None:
                req.tag = "first"
                self._ttft.append(req.first_token_at - req.arrival)
            if req.first_token_at is not None and req.rid in self.prefilling:
                r.prefill_tokens -= self.prefilling.pop(req.rid)  # as the gateway sees a stream's first token
                r.pending.pop(req.rid)
            if req.rid not in self.where:
                continue
            if req.finished_at is not None:
                if req.output_tokens > 1 and req.first_token_at is not None:
                    self._itl.append((req.finished_at - req.first_token_at) / (req.output_tokens - 1))
                _, work = self.where.pop(req.rid)
                r.outstanding_tokens -= work
                r.in_flight -= 1
                if self.on_finished is not None:
                    self.on_finished(req, now)
        if r.draining and r.in_flight == 0 and r.released is None:
            r.released = now
            self.live.remove(r)

    def _drain_queue(self, now: float) -> None:
        while self.pending and self._route(self.pending[0], now):
            self.pending.popleft()

    # ------------------------------------------------------------ the loop

    def _tick(self, now: float, samples: list[Sample], decisions: list, arrivals: int) -> None:
        obs, ready = self.observe_now(now)
        self.decide_now(now, obs, ready, samples, decisions, arrivals)

    def observe_now(self, now: float) -> tuple[Observation, int]:
        """The replicas advanced to `now` and what a decision sees (and the ready count)."""
        for r in list(self.live):
            self._on_events(r, r.model.advance(now), now)
        ready = self._ready(now)
        starting = [r for r in self.live if not r.draining and r.ready_at > now]
        running = sum(r.model.num_running for r in ready)
        queued = sum(r.model.num_waiting for r in ready) + len(self.pending)
        return self._observe(now, running, queued, ready, len(starting)), len(ready)

    def decide_now(
        self,
        now: float,
        obs: Observation,
        ready: int,
        samples: list[Sample],
        decisions: list,
        arrivals: int,
        settings: AutoscaleSettings | None = None,
    ) -> Decision:
        """The policy's decision on `obs` (under `settings`, else the run's own), applied."""
        d = self.policy.decide(settings or self.settings, self.state, obs)
        if d.desired != self.desired:
            decisions.append((now, d.desired, d.reason))
        self.desired = d.desired
        self._scale_to(d.desired, now)
        samples.append(Sample(now, len(self.live), ready, d.desired, obs.demand, arrivals))
        return d

    def arrive(self, req: SimRequest, now: float, samples: list[Sample], decisions: list) -> None:
        """A request reaches the gateway: routed, else queued (and, with no replica left,
        a scale-from-zero decision at once)."""
        self._arrived += 1
        self._arrived_prompt += req.prompt_tokens
        if len(self._sample) < SAMPLE_PER_TICK:
            self._sample.append(req.prompt_tokens)
        if not self._route(req, now):
            self.pending.append(req)
            if not any(not r.draining for r in self.live):  # scale from zero now
                self._tick(now, samples, decisions, 0)

    def _observe(
        self, now: float, running: int, queued: int, ready: list[SimReplica], starting: int
    ) -> Observation:
        """This decision's view, as gateways (arrivals, prompt tokens) and replicas
        (generated tokens, KV usage, TTFT and ITL of their requests) report it."""
        dt = max(now - self._last_obs, self.tick_s)
        generated = 0
        for r in self.live:
            count = r.model.tokens_generated()
            generated += max(0, count - self._generated.get(r.rid, 0))
            self._generated[r.rid] = count
        obs = Observation(
            now,
            running,
            queued,
            len(ready),
            starting,
            self.desired,
            requests_per_s=self._arrived / dt,
            prompt_tokens_per_s=self._arrived_prompt / dt,
            output_tokens_per_s=generated / dt,
            kv_usage=sum(r.model.kv_usage for r in ready) / len(ready) if ready else 0.0,
            ttft_s=sum(self._ttft) / len(self._ttft) if self._ttft else None,
            itl_s=sum(self._itl) / len(self._itl) if self._itl else None,
            prompt_sample=tuple(self._sample),
        )
        self._last_obs, self._arrived, self._arrived_prompt, self._sample = now, 0, 0, []
        self._ttft, self._itl = [], []
        return obs

    def run(self) -> RunResult:
        for _ in range(self.initial):
            self._add_replica(0.0, cold=False)
        reqs = [
            SimRequest(
                i,
                t.prompt_tokens,
                t.output_tokens,
                t.at,
                block_hashes=t.hash_ids,
                block_tokens=t.block_tokens,
            )
            for i, t in enumerate(self.trace)
        ]
        samples: list[Sample] = []
        decisions: list[tuple[float, int, str]] = []
        i, next_tick, arrivals = 0, 0.0, 0
        end_of_trace = reqs[-1].arrival if reqs else 0.0
        now = 0.0
        while True:
            t_arrival = reqs[i].arrival if i < len(reqs) else math.inf
            t_ready = self._ready_heap[0][0] if self._ready_heap else math.inf
            best_r, t_replica = None, math.inf
            for r in self.live:
                te = r.model.next_event_time()
                if te < t_replica:
                    best_r, t_replica = r, te
            busy = bool(self.live and any(not r.model.idle() for r in self.live)) or self.pending
            if i >= len(reqs) and not busy:
                break
            now = min(t_arrival, t_ready, t_replica, next_tick)
            if now == next_tick:
                self._tick(now, samples, decisions, arrivals)
                arrivals = 0
                next_tick += self.tick_s
                if now > end_of_trace + 3600:  # a stuck queue: give up rather than loop
                    break
            elif now == t_ready:
                heapq.heappop(self._ready_heap)
                self._drain_queue(now)
            elif now == t_replica and best_r is not None:
                self._on_events(best_r, best_r.model.advance(now), now)
            else:
                req = reqs[i]
                i += 1
                arrivals += 1
                self.arrive(req, now, samples, decisions)
        end = max(now, end_of_trace)
        w = self.warmup_s
        replica_s = sum(
            max(0.0, (r.released if r.released is not None else end) - max(r.created, w))
            for r in self.replicas
        )
        cold = sum(1 for r in self.replicas if r.ready_at > r.created and r.created >= w)
        return RunResult(
            self.policy_name,
            reqs,
            [x for x in samples if x.at >= w],
            replica_s,
            cold,
            decisions,
            end,
            w,
            self.routing,
        )
