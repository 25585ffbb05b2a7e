"""KV-cache events of vLLM and SGLang replicas, read over ZMQ and handed to the relay.

Both engines' publishers (`--kv-events-config`) send multipart messages `(topic, seq as 8
bytes big-endian, msgpack batch)` from a PUB socket, and keep the last batches for a ROUTER
"replay" socket that answers a request `(start seq, 8 bytes)` with every kept `(seq,
payload)` from there and `(-1, b"")` at the end. Their PUB *binds* only on a wildcard
address ("tcp://*:p", all interfaces) and *connects* otherwise; batches carry prompts'
token ids, so no replica may publish them on the network. The convention here: the agent
binds one SUB per replica on loopback (`kv_events_endpoint_for`, called by the launcher
before it starts the engine) and the engine's PUB connects to it; the engine binds its
replay ROUTER on another loopback port the agent picked. Both go in the engine's
`--kv-events-config` (`fleet_base.engines.kv_events_config`).

One `EngineKvFollower` per ready replica: a gap in the engine's sequence numbers is asked of
the replay socket; what replay cannot give back (gone from the engine's buffer, no replay
socket, an undecodable or oversized or over-budget message) makes the replica's set stale:
nothing is claimed held until stored again and readers get that (empty) snapshot. An engine
restart (its numbers start again) clears the translations. Batches are translated into
Fleet's block hashes (agent.engine_kv_translate) and published through the relay, in
the same messages, sequence numbers and resync path as Fleet's own engine's events.
Every message is bounded in bytes and events, and every replica in messages and bytes per
second (`fleet_base.intake`); the loop yields after each message, and a long batch is decoded
and re-hashed in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from agent.engine_kv_translate import FleetHashTranslator, Op, Translated
from fleet_base.engine_kv_events import KvEventDecodeError, decode_engine_events, zmq_seq
from fleet_base.engines import CAPABILITIES, EngineKind
from fleet_base.intake import Intake
from fleet_base.ports import free_port

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_MESSAGE_BYTES = 1 << 20  # one batch: ~200k token ids of a long prefill
MAX_EVENTS = 4096  # events in one batch
INLINE_BYTES = 16 * 1024  # a batch this short is translated on the loop (a thread costs more)
MESSAGES_PER_S = 500.0  # per replica (a scheduler step publishes at most one batch)
BYTES_PER_S = 8.0 * (1 << 20)
RCVHWM = 256  # messages queued unread per replica: at most RCVHWM * MAX_MESSAGE_BYTES
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY = 10_000  # the engines' default replay buffer (buffer_steps)
SNAPSHOT_MIN_S = 2.0  # at most one full set per replica this often
POLL_S = 1.0
DEFAULT_BLOCK_SIZE = 16  # announced before the engine's first stored block says otherwise


@dataclass(frozen=True)
class KvEventsEndpoint:
    """Where one replica's engine sends its KV events (`publish`: the agent's SUB, which
    the engine's PUB connects to; with `connect`, the engine's bound PUB the agent's SUB
    connects to) and where it serves replays (`replay`, bound by the engine; None: no
    replays, a gap makes the set stale)."""

    publish: str
    replay: str | None
    connect: bool = False

    @property
    def publish_port(self) -> int:
        return int(self.publish.rsplit(":", 1)[1])


class EngineKvEndpoints:
    """The agent's SUB socket and endpoints per foreign replica, from the launcher's call
    before the engine starts until the replica is gone."""

    def __init__(self, host: str = HOST, ctx: zmq.asyncio.Context | None = None) -> None:
        self.host = host
        self._ctx = ctx
        self._sockets: dict[str, tuple[KvEventsEndpoint, zmq.asyncio.Socket]] = {}

    @property
    def ctx(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def endpoint_for(
        self,
        replica_id: str,
        kind: EngineKind,
        *,
        publish_port: int | None = None,
        replay_port: int | None = None,
    ) -> KvEventsEndpoint | None:
        """The replica's endpoints (None for an engine that publishes no ZMQ events), its
        SUB bound now so that no early batch is lost. Idempotent per replica. A launcher
        that adopts a running engine passes the ports it was started with."""
        if CAPABILITIES[kind].kv_events != "zmq":
            return None
        known = self._sockets.get(replica_id)
        if known is not None:
            return known[0]
        sub = self._sub()
        try:
            if publish_port is None:
                publish_port = sub.bind_to_random_port(f"tcp://{self.host}")
            else:
                sub.bind(f"tcp://{self.host}:{publish_port}")
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        replay_port = replay_port or free_port(self.host)
        endpoint = KvEventsEndpoint(f"tcp://{self.host}:{publish_port}", f"tcp://{self.host}:{replay_port}")
        self._sockets[replica_id] = (endpoint, sub)
        return endpoint

    def subscribe(
        self, replica_id: str, kind: EngineKind, address: str | None, replay: str | None = None
    ) -> KvEventsEndpoint | None:
        """A SUB that connects to an engine's own bound PUB at `address` (a Kubernetes pod's
        "tcp://*:port", reached at the pod's address: agent.runtime.kube_engine); a new
        address (the pod came back elsewhere) replaces the old socket."""
        if address is None or CAPABILITIES[kind].kv_events != "zmq":
            return None
        endpoint = KvEventsEndpoint(address, replay, connect=True)
        known = self._sockets.get(replica_id)
        if known is not None and known[0] == endpoint:
            return endpoint
        self.release(replica_id)
        sub = self._sub()
        try:
            sub.connect(address)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._sockets[replica_id] = (endpoint, sub)
        return endpoint

    def _sub(self) -> zmq.asyncio.Socket:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        return sub

    def get(self, replica_id: str) -> tuple[KvEventsEndpoint, zmq.asyncio.Socket] | None:
        return self._sockets.get(replica_id)

    def release(self, replica_id: str) -> None:
        known = self._sockets.pop(replica_id, None)
        if known is not None:
            known[1].close(linger=0)

    def close(self) -> None:
        for rid in list(self._sockets):
            self.release(rid)


ENDPOINTS = EngineKvEndpoints()  # this agent process's


def kv_events_endpoint_for(
    replica_id: str, kind: EngineKind, *, publish_port: int | None = None, replay_port: int | None = None
) -> KvEventsEndpoint | None:
    """For the launcher: the endpoints to put in the engine's `--kv-events-config`
    (`kv_events_config(kind, e.publish, replay_endpoint=e.replay)`), None for an engine
    without ZMQ KV events."""
    return ENDPOINTS.endpoint_for(replica_id, kind, publish_port=publish_port, replay_port=replay_port)


def adopt_kv_events_endpoint(
    replica_id: str, kind: EngineKind, argv: Sequence[str]
) -> KvEventsEndpoint | None:
    """For the runtime adopting a running replica after an agent restart: bind the SUB again
    on the loopback port its command line (`--kv-events-config`) names, so its engine's PUB
    reconnects to this agent. None when the command line names none or the port is taken."""
    args = list(argv)
    if "--kv-events-config" not in args[:-1]:
        return None
    try:
        config = json.loads(args[args.index("--kv-events-config") + 1])
        publish_port = int(str(config["endpoint"]).rsplit(":", 1)[1])
        replay = config.get("replay_endpoint")
        replay_port = int(str(replay).rsplit(":", 1)[1]) if replay else None
        return ENDPOINTS.endpoint_for(replica_id, kind, publish_port=publish_port, replay_port=replay_port)
    except (ValueError, KeyError, TypeError, IndexError, zmq.ZMQError) as err:
        log.warning("replica %s: its KV-event endpoint cannot be bound again (%s)", replica_id, err)
        return None


def subscribe_kv_events(
    replica_id: str, kind: EngineKind, address: str | None, replay: str | None = None
) -> KvEventsEndpoint | None:
    """For a runtime whose engines bind their own PUB (Kubernetes pods): subscribe at
    `address` once the replica's address is known, asking `replay` (the engine's bound
    ROUTER) for gaps; None for no address or no ZMQ events."""
    try:
        return ENDPOINTS.subscribe(replica_id, kind, address, replay)
    except zmq.ZMQError as err:
        log.warning("replica %s: cannot subscribe to KV events at %s (%s)", replica_id, address, err)
        return None


def release_kv_events_endpoint(replica_id: str) -> None:
    """For the runtime: the replica is gone (stopped, killed, failed)."""
    ENDPOINTS.release(replica_id)


# (ops, snapshot, block_size) -> published
Publish = Callable[[list[Op], bool, int], Awaitable[bool]]


class EngineKvFollower:
    """One replica's ZMQ stream, translated and published until cancelled. `counts` is
    shared by the relay (keyed (engine, outcome)); `resync_wanted()` is True once per
    reader's request for the replica's full set."""

    def __init__(
        self,
        replica_id: str,
        engine: EngineKind,
        sub: zmq.asyncio.Socket,
        replay: str | None,
        publish: Publish,
        *,
        counts: Counter[tuple[str, str]],
        resync_wanted: Callable[[], bool] = lambda: False,
        ctx: zmq.asyncio.Context | None = None,
        translator: FleetHashTranslator | None = None,
        intake: Intake | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.sub = sub
        self.replay_endpoint = replay
        self.publish = publish
        self.counts = counts
        self.resync_wanted = resync_wanted
        self.ctx = ctx
        self.translator = translator or FleetHashTranslator()
        self.intake = intake or Intake(MAX_MESSAGE_BYTES, MESSAGES_PER_S, BYTES_PER_S, clock=clock)
        self.clock = clock
        self.expected: int | None = None  # the next engine sequence number
        self.dup_until = -1  # replayed up to here: live copies of those are skipped
        self.snapshot_due = True  # readers start from a full set
        self.last_snapshot = -SNAPSHOT_MIN_S

    def count(self, outcome: str, n: int = 1) -> None:
        if n:
            self.counts[(self.engine, outcome)] += n

    async def run(self) -> None:
        while True:
            if self.resync_wanted():
                self.snapshot_due = True
            await self._maybe_snapshot()
            if not await self.sub.poll(int(POLL_S * 1000), zmq.POLLIN):
                continue
            frames = await self.sub.recv_multipart()
            try:
                await self.on_message(frames)
            except (ValueError, TypeError, ArithmeticError, LookupError) as err:  # a payload no rule foresaw
                self.count("invalid")
                self._stale(f"a batch failed: {err!r}")
            await asyncio.sleep(0)  # a flood never holds the loop

    async def _maybe_snapshot(self) -> None:
        now = self.clock()
        if self.snapshot_due and now - self.last_snapshot >= SNAPSHOT_MIN_S:
            self.last_snapshot = now
            if await self.publish(self.translator.held(), True, self._block_size()):
                self.snapshot_due = False

    def _block_size(self) -> int:
        return self.translator.block_size or DEFAULT_BLOCK_SIZE

    def _stale(self, why: str) -> None:
        """Events were lost for good: claim nothing until stored again."""
        log.info("kv events of %s: %s; its prefix set is marked stale", self.replica_id, why)
        self.count("stale")
        self.translator.forget_held()
        self.snapshot_due = True

    async def on_message(self, frames: Sequence[bytes]) -> None:
        """One live message: its sequence number checked (gap: replay; restart: clear),
        then its batch applied."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.count("invalid")
            self._stale("a message that is not (topic, seq, payload)")
            return
        seq = zmq_seq(frames[1])
        if self.expected is not None and seq < self.expected:
            if seq <= self.dup_until:  # the live copy of a replayed batch
                self.count("duplicate")
                return
            self.count("restart")  # an engine numbers from 0 again when it restarts
            log.info(
                "kv events of %s: the engine restarted (seq %d after %d)",
                self.replica_id,
                seq,
                self.expected - 1,
            )
            self.translator.clear()
            self.snapshot_due = True
            self.expected, self.dup_until = None, -1
        if seq < 0:
            self.count("invalid")
            return
        self.dup_until = -1  # past the replayed ones: no more live copies to come
        start = 0 if self.expected is None else self.expected
        if seq > start:
            self.count("gap")
            if not await self._replay(start, seq):
                self._stale(f"events {start}..{seq - 1} lost")
        if self.expected is not None and seq < self.expected:  # replay delivered this one too
            self.count("duplicate")
            return
        await self._apply(seq, frames[2])

    async def _apply(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        refusal = self.intake.refusal(self.replica_id, payload)
        if refusal is not None:
            self.count("oversize" if refusal == "size" else "rate")
            self._stale(f"batch {seq} dropped ({refusal})")
            return
        try:
            if len(payload) < INLINE_BYTES:
                skipped, out = self._translate(payload)
            else:  # a long batch (a long prefill) is decoded and hashed off the event loop
                skipped, out = await asyncio.to_thread(self._translate, payload)
        except KvEventDecodeError as err:
            self.count("invalid")
            self._stale(f"batch {seq} undecodable: {err}")
            return
        self.count("batches")
        self.count("skipped", skipped)
        for outcome, n in out.outcomes.items():
            self.count(outcome, n)
        if out.ops and not await self.publish(out.ops, False, self._block_size()):
            self.snapshot_due = True  # readers will miss these: the full set when we can

    def _translate(self, payload: bytes) -> tuple[int, Translated]:
        """Decode and re-key one batch. Runs in a worker thread for long batches: only this
        follower's coroutine touches the translator, and it awaits the result."""
        batch = decode_engine_events(payload, max_events=MAX_EVENTS)
        return batch.skipped, self.translator.apply(batch.events)

    async def _replay(self, start: int, live_seq: int) -> bool:
        """Ask the engine's replay socket for `start..live_seq - 1` and apply them. True
        when all of them came back in order."""
        if not self.replay_endpoint:
            return False
        ctx = self.ctx or zmq.asyncio.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.RCVHWM, MAX_REPLAY + 1)
        complete = True
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = self.clock() + REPLAY_TIMEOUT_S
            got = 0
            while got <= MAX_REPLAY:
                left = deadline - self.clock()
                if left <= 0 or not await dealer.poll(int(left * 1000) + 1, zmq.POLLIN):
                    self.count("replay_timeout")
                    return False
                frames = await dealer.recv_multipart()
                got += 1
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.count("invalid")
                    return False
                seq = zmq_seq(frames[1])
                if seq < 0:  # the end
                    break
                if seq < start or (self.expected is not None and seq < self.expected):
                    continue
                nxt = start if self.expected is None else self.expected
                if seq != nxt:  # the engine's buffer no longer holds what we missed
                    complete = False
                self.count("replayed")
                await self._apply(seq, frames[2])
                await asyncio.sleep(0)
            self.dup_until = (self.expected or 0) - 1
            return complete and self.expected is not None and self.expected >= live_seq
        except zmq.ZMQError as err:
            log.debug("replay from %s: %s", self.replay_endpoint, err)
            return False
        finally:
            dealer.close(linger=0)
