"""vLLM/SGLang KV events over real ZMQ sockets -> the agent's subscriber and relay -> a
gateway's real prefix index, under Fleet's block hashes.

The engine side is a stand-in (tests/agent/engine_kv_standin.py: vLLM's frames, sockets and
msgspec structs, not the engine). NATS is a stand-in too (`WireLink`: the relay's messages
as bytes into the gateway's `admit` and `apply`, what its NATS callback does)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from agent import engine_kv_snapshot
from agent import engine_kv_subscriber as sub_mod
from agent.engine_kv_subscriber import (
    EngineKvEndpoints,
    EngineKvFollower,
    KvEventsEndpoint,
    adopt_kv_events_endpoint,
    kv_events_endpoint_for,
    release_kv_events_endpoint,
)
from agent.gateway.engine_kv_metrics import EngineKvEventsCollector
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.prefix import PrefixRouting, prefix_keys
from agent.gateway.tenancy import cache_salt
from agent.kv_relay import Followed, KvRelay
from bench.engine_kv_layouts import MBatch as KVEventBatch
from bench.engine_kv_layouts import MCleared as AllBlocksCleared
from bench.engine_kv_layouts import MRemoved as BlockRemoved
from bench.engine_kv_layouts import SgBatch, SgRemoved, SgStored
from fleet_base.engines import kv_events_config, launch_command
from fleet_base.kv_events import KvResyncRequest, kvresync_subject
from fleet_base.local_state import LocalState
from fleet_base.protocol import Message
from tests.agent.engine_kv_standin import (
    StandInPublisher,
    engine_hash,
    stored_chain,
)
from tests.polling import eventually

BS = 16
SALT = cache_salt("key-a")  # what the gateway sends a replica for this key's requests
PROMPT = list(range(1000, 1000 + 6 * BS + 5))  # six full blocks and a tail


class WireLink:
    """A STAND-IN for NatsLink: each published message's bytes go to a gateway's
    PrefixRouting exactly as its `fleet.v1.kvcache.*` callback takes them."""

    def __init__(self, gateway: PrefixRouting) -> None:
        self.gateway = gateway
        self.nc = None
        self.sent: list[Message] = []
        self.up = True
        self.refused = 0

    def on_connect(self, callback: object) -> None:
        pass

    async def publish(self, subject: str, message: Message) -> bool:
        if not self.up:
            self.refused += 1
            return False
        self.sent.append(message)
        batch = self.gateway.admit(subject, message.to_bytes())
        if batch is not None:
            self.gateway.apply(batch)
        return True


def matched(env: SimpleNamespace, tokens: list[int], salt: str | None = SALT) -> int:
    """Leading blocks of `tokens` the gateway's index says the replica holds."""
    return env.gateway.index.match("east", "r1", prefix_keys(tokens, BS, salt))


@contextlib.contextmanager
def ipc_dir() -> Iterator[Path]:
    """A short private directory (a Unix socket path holds at most 107 bytes; pytest's
    tmp_path can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="fleet-kv-"))
    try:
        yield path / "kv-events"
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def replica(
    engine: str = "vllm", *, replay: bool = True, topic: bytes = b"kv-events"
) -> AsyncIterator[SimpleNamespace]:
    with ipc_dir() as directory:
        async with _replica(directory, engine, replay=replay, topic=topic) as env:
            yield env


@contextlib.asynccontextmanager
async def _replica(
    directory: Path, engine: str, *, replay: bool, topic: bytes
) -> AsyncIterator[SimpleNamespace]:
    endpoints = EngineKvEndpoints()
    endpoint = endpoints.endpoint_for("r1", engine, directory)  # type: ignore[arg-type]
    assert endpoint is not None
    gateway = PrefixRouting(None, "west", GatewayMetrics(load=dict))
    link = WireLink(gateway)
    relay = KvRelay(link, "east", endpoints=endpoints)  # type: ignore[arg-type]
    engine_pub = StandInPublisher(endpoint.publish, endpoint.replay if replay else None, topic)
    async with engine_pub:
        relay.sync([Followed("r1", "chat", "http://127.0.0.1:9", engine)])  # type: ignore[arg-type]
        try:
            # the follower's first full set (empty) tells readers to trust what follows
            await eventually(lambda: link.sent and link.sent[0].snapshot, what="first snapshot")
            env = SimpleNamespace(pub=engine_pub, relay=relay, gateway=gateway, link=link, endpoint=endpoint)
            await warm_up(env)
            yield env
        finally:
            await relay.close()


async def warm_up(env: SimpleNamespace) -> None:
    """Empty batches until one reaches the follower (a PUB drops what it sends before the
    subscription arrives), then counts start from zero."""

    async def arrived() -> bool:
        await env.pub.send(KVEventBatch(ts=0.0, events=[]))
        await asyncio.sleep(0.05)
        return counts(env).get("batches", 0) > 0

    await eventually(arrived, what="the subscription reached the engine's PUB")

    async def drained() -> bool:
        return not await env.relay.endpoints.get("r1")[1].poll(0)

    await eventually(drained, what="warm-up drained")
    await asyncio.sleep(0.05)  # the follower applies what it read last
    env.relay.engine_counts.clear()
    env.pub.replays.clear()


def counts(env: SimpleNamespace) -> dict[str, int]:
    return {outcome: n for (_, outcome), n in env.relay.engine_counts.items()}


async def test_stored_blocks_become_routable_under_fleet_hashes() -> None:
    async with replica() as env:
        first, hashes = stored_chain(PROMPT[: 2 * BS], BS, SALT)
        rest, _ = stored_chain(PROMPT[2 * BS :], BS, None, parent=hashes[-1])
        await env.pub.send(KVEventBatch(ts=1.0, events=[first]))
        await env.pub.send(KVEventBatch(ts=2.0, events=[rest]))
        await eventually(lambda: matched(env, PROMPT) == 6, what="six blocks routable")
        # the engine's own hashes are not what the gateway looks up; Fleet's are
        assert env.gateway.index.block_size("chat") == BS
        assert matched(env, PROMPT, salt=cache_salt("key-b")) == 0  # another tenant's salt
        assert matched(env, PROMPT, salt=None) == 0
        assert matched(env, [7, *PROMPT]) == 0
        assert counts(env)["stored"] == 6


async def test_removal_and_clear() -> None:
    async with replica() as env:
        stored, hashes = stored_chain(PROMPT, BS, SALT)
        await env.pub.send(KVEventBatch(ts=1.0, events=[stored]))
        await eventually(lambda: matched(env, PROMPT) == 6)
        await env.pub.send(KVEventBatch(ts=2.0, events=[BlockRemoved(hashes[3:], "GPU")]))
        await eventually(lambda: matched(env, PROMPT) == 3, what="the tail evicted")
        await env.pub.send(KVEventBatch(ts=3.0, events=[BlockRemoved([b"\x01" * 32], "GPU")]))
        await env.pub.send(KVEventBatch(ts=4.0, events=[AllBlocksCleared()]))
        await eventually(lambda: matched(env, PROMPT) == 0, what="cleared")
        assert counts(env)["unknown_block"] == 1 and counts(env)["cleared"] == 1


async def test_host_tier_blocks_keep_their_tier() -> None:
    async with replica() as env:
        gpu, hashes = stored_chain(PROMPT, BS, SALT)
        cpu, _ = stored_chain(PROMPT, BS, SALT, medium="CPU")
        await env.pub.send(KVEventBatch(ts=1.0, events=[gpu, cpu, BlockRemoved(hashes[2:], "GPU")]))
        keys = prefix_keys(PROMPT, BS, SALT)
        await eventually(lambda: env.gateway.index.match_tiers("east", "r1", keys) == (2, 4))


async def test_a_gap_is_filled_by_replay() -> None:
    async with replica() as env:
        chain = [PROMPT[i : i + BS] for i in range(0, 6 * BS, BS)]
        base = env.pub.seq
        parent = None
        for i, block in enumerate(chain):
            event, hashes = stored_chain(block, BS, SALT if parent is None else None, parent=parent)
            parent = hashes[-1]
            await env.pub.send(KVEventBatch(ts=float(i), events=[event]), lose=i in (2, 3))
        await eventually(lambda: matched(env, PROMPT) == 6, what="all six after the replay")
        assert env.pub.replays == [base + 2]
        c = counts(env)
        assert c["gap"] == 1 and c["replayed"] >= 2 and "stale" not in c
        assert c["duplicate"] >= 1  # the live copies of replayed batches are not applied twice


async def test_a_gap_without_replay_marks_the_replica_stale_until_stored_again() -> None:
    async with replica(replay=False) as env:
        first, hashes = stored_chain(PROMPT[: 2 * BS], BS, SALT)
        await env.pub.send(KVEventBatch(ts=1.0, events=[first]))
        await eventually(lambda: matched(env, PROMPT) == 2)
        lost, lost_hashes = stored_chain(PROMPT[2 * BS : 3 * BS], BS, None, parent=hashes[-1])
        await env.pub.send(KVEventBatch(ts=2.0, events=[lost]), lose=True)
        # the lost batch might have evicted anything: nothing is claimed any more
        nxt, _ = stored_chain(PROMPT[3 * BS : 4 * BS], BS, None, parent=lost_hashes[-1])
        await env.pub.send(KVEventBatch(ts=3.0, events=[nxt]))
        await eventually(lambda: counts(env).get("stale") == 1)
        await eventually(lambda: matched(env, PROMPT) == 0, what="the stale set dropped")
        assert counts(env)["unknown_parent"] == 1  # its parent was in the lost batch
        # blocks stored again are placed: the translations survived the gap
        again, _ = stored_chain(PROMPT[: 2 * BS], BS, SALT)
        child, _ = stored_chain(PROMPT[2 * BS : 3 * BS], BS, None, parent=hashes[-1])
        await env.pub.send(KVEventBatch(ts=4.0, events=[again, child]))
        await eventually(lambda: matched(env, PROMPT) == 3)


async def test_an_engine_restart_clears_its_blocks() -> None:
    async with replica() as env:
        stored, _ = stored_chain(PROMPT, BS, SALT)
        await env.pub.send(KVEventBatch(ts=1.0, events=[stored]))
        await env.pub.send(KVEventBatch(ts=2.0, events=[]))
        await eventually(lambda: matched(env, PROMPT) == 6)
        env.pub.restart()
        short, _ = stored_chain(PROMPT[:BS], BS, SALT)
        await env.pub.send(KVEventBatch(ts=3.0, events=[short]))
        await eventually(lambda: counts(env).get("restart") == 1)
        await eventually(lambda: matched(env, PROMPT) == 1, what="only what the new engine stored")


async def test_a_closed_socket_ends_the_follower_quietly_and_its_successor_keeps_the_translations() -> None:
    """The runtime closes a replica's socket (released on an agent restart, replaced when a
    pod moves): the follower returns instead of dying on ZMQError, and the one `sync`
    starts next resumes with the blocks it knew, so a child of an earlier block is placed."""
    async with replica() as env:
        first, hashes = stored_chain(PROMPT[: 2 * BS], BS, SALT)
        await env.pub.send(KVEventBatch(ts=1.0, events=[first]))
        await eventually(lambda: matched(env, PROMPT) == 2)
        task = env.relay._tasks["r1"][1]
        env.relay.endpoints.release("r1")
        await eventually(task.done, what="the follower ended")
        assert not task.cancelled() and task.exception() is None
        env.relay.endpoints.follow("r1", env.endpoint)  # connected again
        env.relay.sync([Followed("r1", "chat", "http://127.0.0.1:9", "vllm")])
        assert env.relay._tasks["r1"][1] is not task
        await warm_up(env)
        child, _ = stored_chain(PROMPT[2 * BS : 3 * BS], BS, None, parent=hashes[-1])
        await env.pub.send(KVEventBatch(ts=2.0, events=[child]))
        await eventually(lambda: matched(env, PROMPT) == 3, what="the child placed under its parent")
        assert "unknown_parent" not in counts(env)
        env.relay.sync([])  # the replica is gone: so is what the relay kept of it
        assert env.relay._engine_states == {}


async def test_a_resumed_follower_replays_a_full_engine_buffer_past_the_live_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A follower started after an agent restart asks replay for everything the engine kept
    (up to its 10,000 batches): more than the live budget's burst, none refused; the replay
    budget still bounds what replays may cost."""
    empty = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[]))
    live_burst = int(sub_mod.MESSAGES_PER_S * sub_mod.BURST_S)

    def live(seq: int) -> list[bytes]:
        return [b"kv-events", seq.to_bytes(8, "big"), empty]

    async def publish(ops: object, snapshot: bool, block_size: int) -> bool:
        return True

    endpoints = EngineKvEndpoints()
    with ipc_dir() as directory:
        e = endpoints.endpoint_for("r1", "vllm", directory)
        assert e is not None
        try:
            async with StandInPublisher(e.publish, e.replay) as engine:
                for _ in range(live_burst + 500):
                    await engine.send(payload=empty, lose=True)
                got: Counter[tuple[str, str]] = Counter()
                sub = endpoints.get("r1")[1]  # type: ignore[index]
                follower = EngineKvFollower(
                    "r1", "vllm", sub, e.replay, publish, counts=got, ctx=endpoints.ctx, clock=lambda: 0.0
                )
                await follower.on_message(live(engine.seq))
                c = {outcome: n for (_, outcome), n in got.items()}
                assert c["replayed"] == live_burst + 500 and "rate" not in c and "stale" not in c
                assert follower.expected == engine.seq + 1

                monkeypatch.setattr(sub_mod, "REPLAY_MESSAGES_PER_S", 100 / sub_mod.BURST_S)
                got.clear()
                bounded = EngineKvFollower(
                    "r1", "vllm", sub, e.replay, publish, counts=got, ctx=endpoints.ctx, clock=lambda: 0.0
                )
                await bounded.on_message(live(engine.seq + 1))
                c = {outcome: n for (_, outcome), n in got.items()}
                assert c["rate"] > 0 and c["stale"] >= 1
        finally:
            endpoints.close()


async def test_a_gateway_resync_gets_the_translated_full_set() -> None:
    async with replica() as env:
        stored, _ = stored_chain(PROMPT, BS, SALT)
        await env.pub.send(KVEventBatch(ts=1.0, events=[stored]))
        await eventually(lambda: matched(env, PROMPT) == 6)
        env.gateway.index.forget("east", "r1")  # a gateway that lost track asks
        request = KvResyncRequest(cluster="east", replica_id="r1", requester="west")
        subject = kvresync_subject("east")
        await env.relay._on_resync(SimpleNamespace(subject=subject, data=request.to_bytes()))
        await eventually(lambda: matched(env, PROMPT) == 6, timeout=10, what="the full set again")
        assert env.link.sent[-1].snapshot


async def test_sglang_layout_end_to_end() -> None:
    async with replica("sglang", topic=b"") as env:
        ints = [int.from_bytes(engine_hash(None, PROMPT[:BS], None)[:8], "big") >> 1]
        ints.append(ints[0] + 1)
        await env.pub.send(SgBatch(ts=1.0, events=[SgStored(ints, None, PROMPT[: 2 * BS], BS, None)]))
        # SGLang reports no cache salt: its chains are rooted unsalted
        await eventually(lambda: matched(env, PROMPT, salt=None) == 2)
        await env.pub.send(SgBatch(ts=2.0, events=[SgRemoved([ints[1]])]))
        await eventually(lambda: matched(env, PROMPT, salt=None) == 1)


async def test_a_hostile_stream_is_bounded_and_never_blocks_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sub_mod, "REPLAY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(sub_mod, "MESSAGES_PER_S", 20.0)  # a burst of 160 messages
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t - 0.01)

    async with replica() as env:
        tick = asyncio.create_task(ticker())
        enc = msgspec.msgpack.Encoder()
        # garbage, a batch past the event bound, an unknown parent, then 10^6 events in one
        # payload (past the byte bound: the socket refuses it)
        await env.pub.send(payload=b"\xc1\x00garbage")
        await env.pub.send(KVEventBatch(ts=1.0, events=[AllBlocksCleared()] * (sub_mod.MAX_EVENTS + 1)))
        orphan, _ = stored_chain(PROMPT, BS, None, parent=b"\x02" * 32)
        await env.pub.send(KVEventBatch(ts=2.0, events=[orphan]))
        huge = enc.encode(KVEventBatch(ts=3.0, events=[BlockRemoved([i], "GPU") for i in range(10**6)]))
        assert len(huge) > sub_mod.MAX_MESSAGE_BYTES
        await env.pub.send(payload=huge)

        async def reconnected() -> bool:  # the SUB dropped the connection that sent it
            await env.pub.send(KVEventBatch(ts=3.5, events=[]))
            await asyncio.sleep(0.1)
            return counts(env).get("gap", 0) > 0

        await eventually(reconnected, what="the SUB connected again")
        # a flood past the replica's message budget
        for i in range(400):
            await env.pub.send(KVEventBatch(ts=4.0 + i, events=[BlockRemoved([i], "GPU")]))
        await eventually(lambda: counts(env).get("rate", 0) > 0, what="the budget refused some")
        c = counts(env)
        assert c["invalid"] >= 2 and c["unknown_parent"] == 6
        assert c["gap"] >= 1  # the 10^6-event payload never arrived: the socket refused it
        assert c["reconnect"] >= 1  # ZMQ dropped that connection for good: the SUB connected again
        assert c["stale"] >= 2
        assert matched(env, PROMPT) == 0
        # still following: once the budget refills, a good batch is applied
        good, _ = stored_chain(PROMPT, BS, SALT)

        async def routable() -> bool:
            await env.pub.send(KVEventBatch(ts=9.0, events=[good]))
            await asyncio.sleep(0.2)
            return matched(env, PROMPT) == 6

        await eventually(routable, timeout=20, what="a good batch applied after the flood")
        tick.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tick
        assert max(lags) < 1.0, f"the event loop stalled {max(lags):.2f}s"


# ---------------------------------------------------------------------- endpoints


def test_endpoints_are_ipc_paths_in_a_private_directory_per_replica() -> None:
    endpoints = EngineKvEndpoints()
    with ipc_dir() as directory:
        try:
            directory.mkdir(mode=0o755)  # left open by someone: made private again
            assert endpoints.endpoint_for("a", "fleet", directory) is None
            assert endpoints.endpoint_for("a", "llama.cpp", directory) is None
            e = endpoints.endpoint_for("a", "vllm", directory)
            assert e is not None and e == endpoints.endpoint_for("a", "vllm", directory)  # idempotent
            assert e.replay is not None
            for endpoint in (e.publish, e.replay):
                assert endpoint.startswith("ipc://") and Path(endpoint[6:]).parent == directory.resolve()
            st = directory.stat()
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
            other = endpoints.endpoint_for("b", "sglang", directory)
            assert other is not None and other.publish != e.publish
            endpoints.release("a")
            assert endpoints.get("a") is None and endpoints.get("b") is not None
            (directory.parent / "elsewhere").mkdir()
            link = directory.parent / "link"
            link.symlink_to(directory.parent / "elsewhere")
            with pytest.raises(PermissionError):  # a link is nobody's private directory
                endpoints.endpoint_for("c", "vllm", link)
            with pytest.raises(ValueError, match="Unix socket path"):
                endpoints.endpoint_for("d", "vllm", directory / ("x" * 100))
        finally:
            endpoints.close()


async def test_no_local_process_can_inject_events_into_the_agents_socket() -> None:
    """The agent listens on nothing: a PUB that connects to the replica's endpoint (what any
    local user could do to a loopback TCP port) reaches no SUB, so its BlockStored never
    becomes routable. Only the engine, binding the path in the 0700 directory, is read."""
    async with replica() as env:
        ctx = zmq.asyncio.Context()
        intruder = ctx.socket(zmq.PUB)
        intruder.setsockopt(zmq.LINGER, 0)
        try:
            intruder.connect(env.endpoint.publish)
            forged, _ = stored_chain(PROMPT, BS, SALT)
            payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[forged]))
            for seq in range(env.pub.seq, env.pub.seq + 20):
                await intruder.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
                await asyncio.sleep(0.02)
            await env.pub.send(KVEventBatch(ts=2.0, events=[]))  # the engine's own still arrive
            await eventually(lambda: counts(env).get("batches") == 1)
            assert matched(env, PROMPT) == 0 and "stored" not in counts(env)
        finally:
            ctx.destroy(linger=0)


async def test_the_launch_command_carries_both_endpoints_and_adoption_connects_them_again() -> None:
    with ipc_dir() as directory:
        e = kv_events_endpoint_for("adopt-1", "vllm", directory)
        assert isinstance(e, KvEventsEndpoint) and e.replay is not None
        argv = launch_command(
            "vllm", "/m", 8000, None, "chat", kv_events_endpoint=e.publish, kv_events_replay_endpoint=e.replay
        )
        config = json.loads(argv[argv.index("--kv-events-config") + 1])
        # ipc:// endpoints: the engine binds its PUB and ROUTER there; the agent's SUB connects
        assert config == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": e.publish,
            "topic": "kv-events",
            "replay_endpoint": e.replay,
        }
        assert "replay_endpoint" not in json.loads(kv_events_config("sglang", e.publish))
        engine = StandInPublisher(e.publish, e.replay)
        async with engine:
            release_kv_events_endpoint("adopt-1")  # the agent restarted: its sockets are gone
            assert adopt_kv_events_endpoint("adopt-1", "vllm", argv) == e
            _, sub = sub_mod.ENDPOINTS.get("adopt-1")  # type: ignore[misc]

            async def arrived() -> bool:
                await engine.send(KVEventBatch(ts=0.0, events=[]))
                return bool(await sub.poll(50))

            await eventually(arrived, what="the running engine's batches reach the new SUB")
            release_kv_events_endpoint("adopt-1")
        assert adopt_kv_events_endpoint("adopt-2", "vllm", ["vllm", "serve", "/m"]) is None
        # ranks past 0 of a data-parallel engine refuse an ipc:// endpoint: none is given
        assert kv_events_endpoint_for("dp-1", "vllm", directory, {"data_parallel_size": 2}) is None
        assert kv_events_endpoint_for("dp-2", "sglang", directory, {"dp_size": "4"}) is None
        assert kv_events_endpoint_for("dp-3", "vllm", directory, {"data_parallel_size": 1}) is not None
        release_kv_events_endpoint("dp-3")
        # a command line naming a TCP port (anyone on the host could reach it) is not followed
        tcp = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"})
        assert adopt_kv_events_endpoint("adopt-3", "vllm", ["vllm", "--kv-events-config", tcp]) is None
        directory.chmod(0o755)
        assert adopt_kv_events_endpoint("adopt-4", "vllm", argv) == e  # made private again
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        release_kv_events_endpoint("adopt-4")


async def test_relay_follows_no_replica_without_events_or_socket() -> None:
    endpoints = EngineKvEndpoints()
    relay = KvRelay(
        WireLink(PrefixRouting(None, "west", GatewayMetrics(load=dict))), "east", endpoints=endpoints
    )  # type: ignore[arg-type]
    relay.sync(
        [
            Followed("cpp", "d", "http://127.0.0.1:9", "llama.cpp"),
            Followed("v", "d", "http://127.0.0.1:9", "vllm"),  # the launcher asked for no socket
        ]
    )
    assert set(relay._tasks) == {"v"}
    await asyncio.sleep(0.05)
    assert relay._tasks["v"][1].done()  # nothing to read: it ended
    await relay.close()


async def test_fleet_engine_http_events_take_the_same_publish_path() -> None:
    """Fleet's own engine (HTTP long-poll) through the same `_send`, a failed publish
    answered by the full set."""
    from tests.agent.test_kv_relay import BS as FLEET_BS
    from tests.agent.test_kv_relay import FakeReplica, served

    fleet_replica = FakeReplica()
    gateway = PrefixRouting(None, "west", GatewayMetrics(load=dict))
    link = WireLink(gateway)
    relay = KvRelay(link, "east", endpoints=EngineKvEndpoints())  # type: ignore[arg-type]
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    keys = prefix_keys(a, FLEET_BS)
    async with served(fleet_replica):
        try:
            relay.sync([Followed("r1", "d", fleet_replica.url)])
            fleet_replica.run(a)
            await eventually(lambda: gateway.index.match("east", "r1", keys) == 2)
            link.up = False  # NATS away: the delta is lost, the next read is the full set
            fleet_replica.run([50, 51, 52, 53])
            await eventually(lambda: link.refused > 0, what="a publish refused")
            gateway.index.forget("east", "r1")
            n = len(link.sent)
            link.up = True
            await eventually(lambda: gateway.index.match("east", "r1", keys) == 2, timeout=20)
            assert any(m.snapshot for m in link.sent[n:])
        finally:
            await relay.close()


async def test_outcomes_reach_the_gateway_metrics(tmp_path) -> None:
    """The relay's counts -> engine_kv_events.json (agent) -> /metrics (gateway)."""
    async with replica() as env:
        stored, _ = stored_chain(PROMPT, BS, SALT)
        orphan, _ = stored_chain(PROMPT, BS, None, parent=b"\x03" * 32)
        await env.pub.send(KVEventBatch(ts=1.0, events=[stored, orphan]))
        await eventually(lambda: counts(env).get("unknown_parent") == 6)
        files = LocalState(tmp_path)
        engine_kv_snapshot.save(files, env.relay.engine_counts)
    registry = CollectorRegistry()
    registry.register(EngineKvEventsCollector(lambda: engine_kv_snapshot.load(files)))
    text = generate_latest(registry).decode()
    assert 'fleet_agent_engine_kv_events_total{engine="vllm",outcome="stored"} 6.0' in text
    assert 'fleet_agent_engine_kv_events_total{engine="vllm",outcome="unknown_parent"} 6.0' in text


async def test_a_long_prefill_batch_is_translated_in_a_worker_thread() -> None:
    long_prompt = [(7919 * i) % 128_000 for i in range(1200 * BS)]
    async with replica() as env:
        stored, _ = stored_chain(long_prompt, BS, SALT)
        payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[stored]))
        assert len(payload) > sub_mod.INLINE_BYTES
        await env.pub.send(payload=payload)
        await eventually(lambda: matched(env, long_prompt) == 1200)


async def test_the_process_runtime_launches_vllm_onto_the_agents_socket(tmp_path, monkeypatch) -> None:
    """ProcessRuntime's launch of a vLLM replica (a stand-in executable: nothing is started)
    names ipc:// paths in the state_dir's private kv-events directory, the agent's SUB
    connected to the first; stopping the replica closes it."""
    from agent.runtime.base import ReplicaHandle
    from agent.runtime.process import ProcessRuntime
    from fleet_base.protocol import ReplicaSpec
    from tests.agent.conftest import cluster_config

    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\nexit 0\n")
    vllm.chmod(0o755)
    monkeypatch.setenv("FLEET_VLLM", str(vllm))
    state_dir = Path(tempfile.mkdtemp(prefix="fleet-st-"))
    cc = cluster_config(tmp_path, "nats://127.0.0.1:1").model_copy(update={"state_dir": state_dir})
    runtime = ProcessRuntime(cc)
    spec = ReplicaSpec(replica_id="v-1", deployment="chat", version=1, model=str(tmp_path), engine="vllm")
    try:
        launch = runtime._launch(spec)
        config = json.loads(launch.argv[launch.argv.index("--kv-events-config") + 1])
        bound = sub_mod.ENDPOINTS.get("v-1")
        assert bound is not None
        assert (config["endpoint"], config["replay_endpoint"]) == (bound[0].publish, bound[0].replay)
        kv_dir = LocalState(state_dir).kv_events_dir.resolve()
        assert config["endpoint"].startswith(f"ipc://{kv_dir}/")
        assert stat.S_IMODE(kv_dir.stat().st_mode) == 0o700
        runtime._forget(ReplicaHandle(replica_id="v-1", spec=spec, url="", argv=launch.argv))
        assert sub_mod.ENDPOINTS.get("v-1") is None
    finally:
        release_kv_events_endpoint("v-1")
        await runtime.close()
        shutil.rmtree(state_dir, ignore_errors=True)
