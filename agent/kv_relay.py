"""The agent's relay of its replicas' KV events to `fleet.v1.kvcache.<cluster>`, where
this cluster's gateway and its peers' gateways keep their prefix indexes.

One follower per ready replica long-polls the engine's `GET /kv/events` and publishes
each answer as a `KvCacheBatch`. Sequence numbers are the relay's own, consecutive per
replica within an epoch made of the engine's epoch and this relay's start, so a restarted
replica or agent reads as a new epoch and its first batch is a snapshot. A gateway that
sees a gap asks on `fleet.v1.kvresync.<cluster>`; the follower then fetches and publishes
the replica's full set. Big snapshots go out in chunks (a snapshot, then stored deltas),
each under NATS' default payload limit. Replicas without KV events (the sim runtime's)
answer 404 and are left alone.

vLLM and SGLang replicas publish over ZMQ instead (agent.engine_kv_subscriber): their
follower reads the agent's socket for the replica, translates the batches into Fleet's
block hashes and publishes them here, in the same messages, numbering and resync path. The
relay keeps each such replica's `EngineKvState` (translations, the engine's next sequence
number) across its followers: one ended by its socket closing is started again on the next
`sync` and resumes, instead of forgetting every parent block. Engines without KV events (llama.cpp) are not followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from collections import Counter
from dataclasses import dataclass

import httpx
from pydantic import ValidationError

from agent.engine_kv_subscriber import (
    ENDPOINTS,
    EngineKvEndpoints,
    EngineKvFollower,
    EngineKvState,
    KvEventsEndpoint,
)
from agent.engine_kv_translate import Op
from fleet_base.engines import CAPABILITIES, EngineKind
from fleet_base.intake import Intake
from fleet_base.kv_events import (
    ALL_REPLICAS,
    MAX_BATCH_HASHES,
    MAX_BATCH_OPS,
    KvCacheBatch,
    KvCacheOp,
    kvcache_subject,
    kvresync_subject,
)
from fleet_base.nats_io import NatsLink
from fleet_base.wire import Rejected, decode_kv_resync

log = logging.getLogger(__name__)

WAIT_S = 2.0  # long-poll wait: also how soon a resync request is served
RESYNC_MIN_S = 2.0  # at most one full set per replica this often, however many gateways ask
# Resync requests heard (from every gateway together: they share this cluster's subject):
# the largest one, and how many a second before the rest go unparsed.
RESYNC_MAX_BYTES = 1024
RESYNC_PER_S = 100.0
CHUNK = MAX_BATCH_HASHES  # block hashes per message (~70 KB of JSON; readers refuse more)
RETRY_S = 2.0


@dataclass(frozen=True)
class Followed:
    replica_id: str
    deployment: str
    url: str
    engine: EngineKind = "fleet"


class KvRelay:
    def __init__(
        self,
        link: NatsLink,
        cluster: str,
        *,
        verify: ssl.SSLContext | bool = True,
        headers: dict[str, str] | None = None,
        endpoints: EngineKvEndpoints = ENDPOINTS,
    ) -> None:
        self.link = link
        self.endpoints = endpoints  # the ZMQ sockets of vLLM and SGLang replicas
        # (engine, outcome) -> events (blocks) or messages: fleet_agent_engine_kv_events_total
        self.engine_counts: Counter[tuple[str, str]] = Counter()
        self.verify = verify  # httpx verify= for HTTPS replicas
        self.headers = headers or {}  # the replica token, when replicas require one
        self.cluster = cluster
        self.relay_id = secrets.token_hex(4)
        self._tasks: dict[str, tuple[Followed, asyncio.Task[None]]] = {}
        self._engine_states: dict[str, EngineKvState] = {}  # vLLM and SGLang replicas'
        # replicas that answered 404 (no KV events), as followed: asked again only once changed
        self._without_events: dict[str, Followed] = {}
        self._resync: set[str] = set()
        self._resync_intake = Intake(RESYNC_MAX_BYTES, RESYNC_PER_S, RESYNC_PER_S * RESYNC_MAX_BYTES)
        self.resync_dropped = 0
        self._client: httpx.AsyncClient | None = None
        self._nc: object | None = None
        link.on_connect(self._on_connect)

    def sync(self, replicas: list[Followed]) -> None:
        """Follow exactly these (ready) replicas."""
        want = {r.replica_id: r for r in replicas}
        for rid, (followed, task) in list(self._tasks.items()):
            if want.get(rid) != followed or task.done():
                task.cancel()
                del self._tasks[rid]
        for rid in set(self._engine_states) - set(want):
            del self._engine_states[rid]  # the replica is gone
        for rid, r in list(self._without_events.items()):
            if want.get(rid) != r:
                del self._without_events[rid]  # gone, or a new replica under its id
        for rid, r in want.items():
            if rid in self._tasks or rid in self._without_events:
                continue
            transport = CAPABILITIES[r.engine].kv_events
            if transport is None:
                continue
            follow = self._follow_zmq(r) if transport == "zmq" else self._follow(r)
            self._tasks[rid] = (r, asyncio.create_task(follow, name=f"kv-relay-{rid}"))

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self.endpoints.close()
        if self._client is not None:
            await self._client.aclose()

    async def _on_connect(self) -> None:
        nc = self.link.nc
        if nc is not None and self._nc is not nc:
            self._nc = nc
            await self.link.subscribe(kvresync_subject(self.cluster), self._on_resync)

    async def _on_resync(self, msg) -> None:
        if self._resync_intake.refusal(msg.subject, msg.data) is not None:
            self.resync_dropped += 1
            log.debug("resync request dropped unparsed (size or rate)")
            return
        try:
            request = decode_kv_resync(msg.subject, msg.data)
        except Rejected:
            return
        if request.cluster != self.cluster:
            return
        if request.replica_id == ALL_REPLICAS:
            self._resync.update(self._tasks)
        elif request.replica_id in self._tasks:
            self._resync.add(request.replica_id)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(WAIT_S + 10, connect=2.0),
                trust_env=False,
                verify=self.verify,
                headers=self.headers,
            )
        return self._client

    async def _follow(self, r: Followed) -> None:
        epoch: str | None = None  # the engine's, as last read
        after: int | None = None
        seq = -1  # last published
        url = r.url.rstrip("/") + "/kv/events"
        loop = asyncio.get_running_loop()
        last_full = -RESYNC_MIN_S
        while True:
            if r.replica_id in self._resync and loop.time() - last_full >= RESYNC_MIN_S:
                self._resync.discard(r.replica_id)
                after = None  # a snapshot on the next read
                last_full = loop.time()
            params: dict[str, str | float | int] = {"wait": WAIT_S}
            if epoch is not None and after is not None:
                params.update(epoch=epoch, after=after)
            try:
                resp = await self._http().get(url, params=params)
                if resp.status_code == 404:
                    log.info("replica %s publishes no KV events; not relayed", r.replica_id)
                    self._without_events[r.replica_id] = r
                    return
                resp.raise_for_status()
                data = resp.json()
                chunks = _chunks(
                    [(op["kind"], op["block_hashes"], op.get("tier", "device")) for op in data["ops"]]
                )
                new_epoch, snapshot = str(data["epoch"]), bool(data["snapshot"])
                block_size, read_seq = int(data["block_size"]), int(data["seq"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError, ValidationError) as err:
                log.debug("kv events of %s: %s", r.replica_id, err)
                await asyncio.sleep(RETRY_S)
                continue
            if new_epoch != epoch:
                seq = -1  # a restarted engine: a new relay epoch, numbered afresh
            epoch, after = new_epoch, read_seq
            if not snapshot and not any(chunks):
                continue
            seq, sent = await self._send(r, f"{epoch}.{self.relay_id}", seq, snapshot, block_size, chunks)
            if not sent:
                after = None  # readers will miss this: resend the full set when we can
                await asyncio.sleep(RETRY_S)

    async def _send(
        self,
        r: Followed,
        epoch: str,
        seq: int,
        snapshot: bool,
        block_size: int,
        chunks: list[list[KvCacheOp]],
    ) -> tuple[int, bool]:
        """Publish one batch's chunks after `seq`: (the last seq used, all published)."""
        for i, chunk in enumerate(chunks):
            seq += 1
            batch = KvCacheBatch(
                cluster=self.cluster,
                deployment=r.deployment,
                replica_id=r.replica_id,
                epoch=epoch,
                seq=seq,
                snapshot=snapshot and i == 0,
                block_size=block_size,
                ops=chunk,
            )
            if not await self.link.publish(kvcache_subject(self.cluster), batch):
                return seq, False
        return seq, True

    async def _follow_zmq(self, r: Followed) -> None:
        """A vLLM or SGLang replica: its ZMQ batches, in Fleet's hashes, as this relay's."""
        known = self.endpoints.get(r.replica_id)
        if known is None:
            log.debug("replica %s (%s) has no KV-event socket; not relayed", r.replica_id, r.engine)
            return
        endpoint, sub = known
        epoch = f"zmq-{secrets.token_hex(4)}.{self.relay_id}"  # this follower's: starts with a snapshot
        seq = -1

        async def publish(ops: list[Op], snapshot: bool, block_size: int) -> bool:
            nonlocal seq
            try:
                chunks = _chunks(list(ops))
            except ValidationError:
                return False
            seq, sent = await self._send(r, epoch, seq, snapshot, block_size, chunks)
            return sent

        def resync_wanted() -> bool:
            wanted = r.replica_id in self._resync
            self._resync.discard(r.replica_id)
            return wanted

        follower = EngineKvFollower(
            r.replica_id,
            r.engine,
            sub,
            endpoint.replay,
            publish,
            counts=self.engine_counts,
            resync_wanted=resync_wanted,
            ctx=self.endpoints.ctx,
            state=self._engine_state(r.replica_id, endpoint),
        )
        await follower.run()

    def _engine_state(self, replica_id: str, endpoint: KvEventsEndpoint) -> EngineKvState:
        """The replica's state kept from its last follower, or a new one when there was none
        or its engine publishes at another endpoint now (a pod that came back elsewhere)."""
        state = self._engine_states.get(replica_id)
        if state is None or state.endpoint != endpoint:
            state = self._engine_states[replica_id] = EngineKvState(endpoint)
        return state


def _chunks(ops: list[tuple[str, list[str]] | tuple[str, list[str], str]]) -> list[list[KvCacheOp]]:
    """The engine's ops (kind, hex hashes[, tier: "device" when absent]; a snapshot's op
    per tier may hold every cached block) as wire ops split so that no message holds more
    than CHUNK hashes or MAX_BATCH_OPS ops, order kept. Raises ValidationError for an op
    the wire would refuse."""
    out: list[list[KvCacheOp]] = [[]]
    size = 0
    for kind, hashes, *tiers in ops:
        tier = tiers[0] if tiers else "device"
        for start in range(0, max(1, len(hashes)), CHUNK):
            part = hashes[start : start + CHUNK]
            if out[-1] and (size + len(part) > CHUNK or len(out[-1]) >= MAX_BATCH_OPS):
                out.append([])
                size = 0
            out[-1].append(KvCacheOp(kind=kind, block_hashes=part, tier=tier))  # type: ignore[arg-type]
            size += len(part)
    return out
