"""KV-cache events of vLLM and SGLang replicas, read over ZMQ and handed to the relay.

Both engines' publishers (`--kv-events-config`) send multipart messages `(topic, seq as 8
bytes big-endian, msgpack batch)` from a PUB socket, and keep the last batches for a ROUTER
"replay" socket that answers a request `(start seq, 8 bytes)` with every kept `(seq,
payload)` from there and `(-1, b"")` at the end. Their PUB *binds* an `ipc://` (or wildcard
TCP) endpoint and *connects* otherwise; their ROUTER always binds. Batches carry prompts'
token ids and steer routing, so on a host both sockets are `ipc://` paths in a directory
only the agent's user may enter (`kv_events_endpoint_for`, called by the launcher before it
starts the engine; `private_dir`): no other local user can read a batch, ask for a replay
or inject one, which a loopback TCP port would let anyone on the host do. The agent's SUB
connects to the engine's PUB path (ZMQ retries until the engine has bound it; what the
engine sent before is asked of replay). Both go in the engine's `--kv-events-config`
(`fleet_base.engines.kv_events_config`).

One `EngineKvFollower` per ready replica: a gap in the engine's sequence numbers is asked of
the replay socket; what replay cannot give back (gone from the engine's buffer, no replay
socket, an undecodable or oversized or over-budget message) makes the replica's set stale:
nothing is claimed held until stored again and readers get that (empty) snapshot. An engine
restart (its numbers start again) clears the translations. Batches are translated into
Fleet's block hashes (agent.engine_kv_translate) and published through the relay, in
the same messages, sequence numbers and resync path as Fleet's own engine's events.
Every message is bounded in bytes and events, and every replica in messages and bytes per
second (`fleet_base.intake`); the loop yields after each message, and a long batch is decoded
and re-hashed in a worker thread. Replayed batches have their own budget (one engine buffer's
worth at once), so a follower that resumes after a long pause is not refused by the live one.
What a follower knows (its translations, the next sequence number) lives in an
`EngineKvState` its relay keeps per replica: a follower whose socket was closed under it
(the runtime released or replaced it) ends quietly, and its successor resumes from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from agent.engine_kv_translate import FleetHashTranslator, Op, Translated
from fleet_base.engine_kv_events import KvEventDecodeError, decode_engine_events, zmq_seq
from fleet_base.engines import CAPABILITIES, EngineKind
from fleet_base.intake import BURST_S, Intake

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20  # one batch: ~200k token ids of a long prefill
MAX_EVENTS = 4096  # events in one batch
INLINE_BYTES = 16 * 1024  # a batch this short is translated on the loop (a thread costs more)
MESSAGES_PER_S = 500.0  # per replica (a scheduler step publishes at most one batch)
BYTES_PER_S = 8.0 * (1 << 20)
RCVHWM = 256  # messages queued unread per replica: at most RCVHWM * MAX_MESSAGE_BYTES
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY = 10_000  # the engines' default replay buffer (buffer_steps)
REPLAY_MESSAGES_PER_S = MAX_REPLAY / BURST_S  # one full buffer at once, then this
MAX_IPC_PATH = 107  # a Unix socket path's bytes (sun_path less its NUL)
SNAPSHOT_MIN_S = 2.0  # at most one full set per replica this often
POLL_S = 1.0
DEFAULT_BLOCK_SIZE = 16  # announced before the engine's first stored block says otherwise


@dataclass(frozen=True)
class KvEventsEndpoint:
    """Where one replica's engine publishes its KV events (`publish`: the engine's bound PUB,
    which the agent's SUB connects to) and serves replays (`replay`, bound by the engine;
    None: no replays, a gap makes the set stale)."""

    publish: str
    replay: str | None


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user's that no one else may enter (0700), created if
    missing. Raises PermissionError for one that is not a directory (a link) or not ours."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of this user's")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def ipc_endpoints(replica_id: str, ipc_dir: Path) -> KvEventsEndpoint:
    """The replica's `ipc://` paths in `ipc_dir` (named by a digest of its id: any id fits a
    socket path's length). Raises ValueError when `ipc_dir` is too long for one."""
    name = hashlib.sha256(replica_id.encode()).hexdigest()[:16]
    base = Path(ipc_dir).expanduser().resolve() / name
    publish, replay = f"{base}.pub", f"{base}.replay"
    if len(os.fsencode(replay)) > MAX_IPC_PATH:
        raise ValueError(f"{replay} is longer than a Unix socket path may be")
    return KvEventsEndpoint(f"ipc://{publish}", f"ipc://{replay}")


class EngineKvEndpoints:
    """The agent's SUB socket and endpoints per foreign replica, from the launcher's call
    before the engine starts until the replica is gone."""

    def __init__(self, ctx: zmq.asyncio.Context | None = None) -> None:
        self._ctx = ctx
        self._sockets: dict[str, tuple[KvEventsEndpoint, zmq.asyncio.Socket]] = {}

    @property
    def ctx(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def endpoint_for(self, replica_id: str, kind: EngineKind, ipc_dir: Path) -> KvEventsEndpoint | None:
        """The replica's `ipc://` endpoints in `ipc_dir` (made private to this user; None for
        an engine that publishes no ZMQ events), its SUB connected now so that it reads from
        the engine's first bind. Idempotent per replica. Raises PermissionError, ValueError
        (see `private_dir`, `ipc_endpoints`)."""
        if CAPABILITIES[kind].kv_events != "zmq":
            return None
        known = self._sockets.get(replica_id)
        if known is not None:
            return known[0]
        endpoint = ipc_endpoints(replica_id, private_dir(Path(ipc_dir).expanduser()))
        self._connect(replica_id, endpoint)
        return endpoint

    def subscribe(
        self, replica_id: str, kind: EngineKind, address: str | None, replay: str | None = None
    ) -> KvEventsEndpoint | None:
        """A SUB that connects to an engine's own bound PUB at `address` (a Kubernetes pod's
        "tcp://*:port", reached at the pod's address: agent.runtime.kube_engine); a new
        address (the pod came back elsewhere) replaces the old socket."""
        if address is None or CAPABILITIES[kind].kv_events != "zmq":
            return None
        return self.follow(replica_id, KvEventsEndpoint(address, replay))

    def follow(self, replica_id: str, endpoint: KvEventsEndpoint) -> KvEventsEndpoint:
        """The replica's SUB connected to `endpoint`: kept when it already is, else replaced."""
        known = self._sockets.get(replica_id)
        if known is not None and known[0] == endpoint:
            return endpoint
        self.release(replica_id)
        self._connect(replica_id, endpoint)
        return endpoint

    def _connect(self, replica_id: str, endpoint: KvEventsEndpoint) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sub.connect(endpoint.publish)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._sockets[replica_id] = (endpoint, sub)

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


DATA_PARALLEL_ARGS = ("data_parallel_size", "dp_size", "dp")  # vLLM's, SGLang's


def kv_events_endpoint_for(
    replica_id: str, kind: EngineKind, ipc_dir: Path, engine_args: Mapping[str, object] | None = None
) -> KvEventsEndpoint | None:
    """For the launcher: the endpoints to put in the engine's `--kv-events-config`
    (`kv_events_config(kind, e.publish, replay_endpoint=e.replay)`), in `ipc_dir` (the
    agent's state_dir's `kv-events`); None for an engine without ZMQ KV events, for a
    data-parallel one (the engines give ranks past 0 their own endpoint by offsetting a TCP
    port and refuse an ipc:// one: the engine would not start), or when no private path can
    be made there: the replica then runs unfollowed."""
    args = engine_args or {}
    if any(str(args.get(k, 1)) not in ("1", "0", "None") for k in DATA_PARALLEL_ARGS):
        log.info("replica %s: data-parallel; its KV events are not followed", replica_id)
        return None
    try:
        return ENDPOINTS.endpoint_for(replica_id, kind, ipc_dir)
    except (OSError, ValueError, zmq.ZMQError) as err:
        log.warning(
            "replica %s: no private KV-event endpoint in %s (%s); not followed", replica_id, ipc_dir, err
        )
        return None


def adopt_kv_events_endpoint(
    replica_id: str, kind: EngineKind, argv: Sequence[str]
) -> KvEventsEndpoint | None:
    """For the runtime adopting a running replica after an agent restart: connect again to
    the `ipc://` paths its command line (`--kv-events-config`) names, in a directory still
    private to this user. None when the command line names none, or names anything else
    (a TCP port any local user could reach is not followed)."""
    args = list(argv)
    if "--kv-events-config" not in args[:-1]:
        return None
    try:
        config = json.loads(args[args.index("--kv-events-config") + 1])
        publish, replay = str(config["endpoint"]), config.get("replay_endpoint")
        paths = [publish] + ([str(replay)] if replay else [])
        if not all(p.startswith("ipc://") for p in paths):
            raise ValueError(f"{publish} is not an ipc:// endpoint")
        for p in paths:
            private_dir(Path(p.removeprefix("ipc://")).parent)
        return ENDPOINTS.follow(replica_id, KvEventsEndpoint(publish, str(replay) if replay else None))
    except (ValueError, KeyError, TypeError, IndexError, OSError, zmq.ZMQError) as err:
        log.warning("replica %s: its KV events are not followed again (%s)", replica_id, err)
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


@dataclass
class EngineKvState:
    """What a replica's follower knows that outlives its task: the translations of the
    engine's blocks and the engine's next sequence number, for one `endpoint`. Its relay
    keeps it until the replica is gone; an engine restart clears it (the follower sees the
    numbering start again)."""

    endpoint: KvEventsEndpoint | None = None
    translator: FleetHashTranslator = field(default_factory=FleetHashTranslator)
    expected: int | None = None  # the next engine sequence number


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
        state: EngineKvState | None = None,
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
        self.state = state or EngineKvState()
        self.translator = self.state.translator
        self.intake = intake or Intake(MAX_MESSAGE_BYTES, MESSAGES_PER_S, BYTES_PER_S, clock=clock)
        self.replay_intake = Intake(MAX_MESSAGE_BYTES, REPLAY_MESSAGES_PER_S, BYTES_PER_S, clock=clock)
        self.clock = clock
        self.dup_until = -1  # replayed up to here: live copies of those are skipped
        self.snapshot_due = True  # readers start from a full set
        self.last_snapshot = -SNAPSHOT_MIN_S

    @property
    def expected(self) -> int | None:
        return self.state.expected

    @expected.setter
    def expected(self, seq: int | None) -> None:
        self.state.expected = seq

    def count(self, outcome: str, n: int = 1) -> None:
        if n:
            self.counts[(self.engine, outcome)] += n

    async def run(self) -> None:
        monitor = self._monitor()
        try:
            while True:
                if self.resync_wanted():
                    self.snapshot_due = True
                await self._maybe_snapshot()
                frames = await self._next()
                if frames is None:
                    if self.sub.closed:  # the runtime closed it: the replica left or moved
                        return
                    await self._reconnect_if_dropped(monitor)
                    continue
                try:
                    await self.on_message(frames)
                except (
                    ValueError,
                    TypeError,
                    ArithmeticError,
                    LookupError,
                ) as err:  # a payload no rule foresaw
                    self.count("invalid")
                    self._stale(f"a batch failed: {err!r}")
                await asyncio.sleep(0)  # a flood never holds the loop
        finally:
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    if not self.sub.closed:
                        self.sub.disable_monitor()
                monitor.close(linger=0)

    def _monitor(self) -> zmq.asyncio.Socket | None:
        """Disconnections of the SUB from the engine's PUB, when it knows where to connect."""
        if self.state.endpoint is None:
            return None
        try:
            return self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError:
            return None

    async def _reconnect_if_dropped(self, monitor: zmq.asyncio.Socket | None) -> None:
        """The SUB connects, and ZMQ gives up a connection for good after a protocol error
        (a message past MAXMSGSIZE): connect again; what was missed is asked of replay."""
        if monitor is None or self.state.endpoint is None:
            return
        dropped = False
        try:
            while await monitor.poll(0):
                event = parse_monitor_message(await monitor.recv_multipart())
                dropped |= event["event"] == zmq.EVENT_DISCONNECTED
            if dropped:
                address = self.state.endpoint.publish
                with contextlib.suppress(zmq.ZMQError):
                    self.sub.disconnect(address)
                self.sub.connect(address)
                self.count("reconnect")
        except zmq.ZMQError as err:
            log.debug("kv events of %s: reconnect: %s", self.replica_id, err)

    async def _next(self) -> list[bytes] | None:
        """The next message, or None after POLL_S without one or once the socket is closed
        (pyzmq fails a pending read then with ZMQError, or cancels it: that cancellation is
        not this task's own)."""
        try:
            if not await self.sub.poll(int(POLL_S * 1000), zmq.POLLIN):
                return None
            return await self.sub.recv_multipart()
        except zmq.ZMQError as err:
            log.debug("kv events of %s: %s", self.replica_id, err)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.sub.closed or (task is not None and task.cancelling()):
                raise
        if not self.sub.closed:
            await asyncio.sleep(POLL_S)  # a socket error that is not its closing: not a busy loop
        return None

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

    async def _apply(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        self.expected = seq + 1
        refusal = (self.replay_intake if replayed else self.intake).refusal(self.replica_id, payload)
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
            got = 0
            while got <= MAX_REPLAY:  # each within REPLAY_TIMEOUT_S of the one before
                if not await dealer.poll(int(REPLAY_TIMEOUT_S * 1000), zmq.POLLIN):
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
                await self._apply(seq, frames[2], replayed=True)
                await asyncio.sleep(0)
            self.dup_until = (self.expected or 0) - 1
            return complete and self.expected is not None and self.expected >= live_seq
        except zmq.ZMQError as err:
            log.debug("replay from %s: %s", self.replay_endpoint, err)
            return False
        finally:
            dealer.close(linger=0)
