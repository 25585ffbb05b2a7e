"""The NATS rows of the attack table, on the real nats-server with the config `fleetctl up`
generates (control_plane.security): TLS required, one user per certificate identity,
per-subject permissions. Every denial is checked twice: the server reports a permissions
violation to the offender, and nobody (the control plane listening on everything) sees
the forged message."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from agent.gateway.kv_index import block_key
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.prefix import PrefixRouting, prefix_keys
from agent.kv_relay import Followed, KvRelay
from control_plane.local.nats_server import NatsServer
from control_plane.security.enroll import Enrolment, NatsListen
from control_plane.security.pki import FleetPki
from fleet_base import api_keys, kv_events, protocol
from fleet_base.batch import names as batch_names
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.nats_store import open_batch_store
from fleet_base.jetstream_budget import JetStreamBudget
from fleet_base.kv_events import KvCacheBatch, KvCacheOp
from fleet_base.nats_io import NatsLink
from fleet_base.ports import free_port
from fleet_base.security.tls import NatsTls, client_context, nats_tls
from fleet_base.subjects import permits
from tests.agent.test_kv_relay import BS, FakeReplica, served
from tests.fleet_base.batch.test_nats_store import batch_store_round_trip
from tests.polling import eventually

pytestmark = pytest.mark.timeout(120)

# a small JetStream store, so a flood reaches every stream limit in seconds
BUDGET = JetStreamBudget(store_bytes=64 << 20)

# what nats-py raises when a server turns it away: TLS alerts (ssl.SSLError is an OSError),
# a reset, its own errors (no servers, authorization), or a timeout
REFUSED = (nats.errors.Error, OSError, asyncio.TimeoutError)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet-home")
    enrolment = Enrolment(home)
    port = free_port()
    listen = NatsListen(port=port, store_dir=str(home / "nats"), clusters=["east", "west"])
    config = enrolment.write_nats_config(listen, budget=BUDGET)
    server = NatsServer(home / "nats", port=port, config_file=config).start()
    env = enrolment.control_plane_env()
    cp = NatsTls(
        ca_file=Path(env["FLEET_NATS_CA"]),
        cert_file=Path(env["FLEET_NATS_CERT"]),
        key_file=Path(env["FLEET_NATS_KEY"]),
        inbox_prefix="_INBOX.control-plane",
    )
    try:
        yield server, enrolment, cp
    finally:
        server.stop()


class Client:
    """A raw nats-py client that records the server's errors (permission violations)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def connect(self, url: str, tls: NatsTls | None = None, **kw):
        async def on_error(err):
            self.errors.append(str(err))

        async def on_disconnect():
            self.errors.append("disconnected")  # shows in a failed assertion, not a silent empty list

        opts = {"tls": tls.context(), "inbox_prefix": tls.inbox_prefix} if tls else {}
        self.nc = await nats.connect(
            url,
            connect_timeout=3,
            allow_reconnect=False,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            **opts,
            **kw,
        )
        return self

    async def violation(self, what: str, timeout: float = 5.0) -> bool:
        """Whether the server reports a permissions violation on `what` within `timeout`
        (nats-py lower-cases the server's message)."""

        def reported() -> bool:
            return any(
                "permissions violation" in e.lower() and what.lower() in e.lower() for e in self.errors
            )

        try:
            return await eventually(reported, timeout, f"a permissions violation on {what}")
        except AssertionError:
            return False

    async def listen(self, *subjects: str) -> list[str]:
        """The subjects of the messages this client receives on `subjects` from now on."""
        seen: list[str] = []

        async def record(msg) -> None:
            seen.append(msg.subject)

        for subject in subjects:
            await self.nc.subscribe(subject, cb=record)
        await self.nc.flush()
        return seen

    async def close(self):
        if self.nc is not None:
            await self.nc.close()


async def _after_sentinel(sender: Client, seen: list[str], allowed_subject: str) -> None:
    """Wait until a fresh allowed message from `sender` reaches the listener. NATS keeps one
    connection's messages in order, so anything forged before it would have arrived by then:
    an absence is proven without guessing a delay."""
    before = seen.count(allowed_subject)
    await sender.nc.publish(allowed_subject, b'{"sentinel": true}')
    await sender.nc.flush()
    await eventually(
        lambda: seen.count(allowed_subject) > before, what=f"the sentinel on {allowed_subject}", timeout=30
    )


async def _control_plane(url: str, cp: NatsTls) -> Client:
    client = await Client().connect(url, cp)
    js = client.nc.jetstream()
    from fleet_base.nats_io import ensure_jetstream

    await ensure_jetstream(js, BUDGET)
    return client


async def test_anonymous_plaintext_and_foreign_clients_are_refused(secured, tmp_path):
    server, enrolment, _ = secured
    # plaintext: the server requires TLS
    with pytest.raises(REFUSED):
        await nats.connect(server.url.replace("tls://", "nats://"), connect_timeout=3, allow_reconnect=False)
    # TLS that trusts the fleet CA, but no client certificate: no identity, no entry
    anonymous = client_context(enrolment.pki.ca_file)
    with pytest.raises(REFUSED):
        await nats.connect(server.url, tls=anonymous, connect_timeout=3, allow_reconnect=False)
    # a certificate from another CA with the right name: refused at the handshake
    foreign = FleetPki(tmp_path / "elsewhere").cluster("east")
    ctx = client_context(enrolment.pki.ca_file, foreign.agent_cert, foreign.agent_key)
    with pytest.raises(REFUSED):
        await nats.connect(server.url, tls=ctx, connect_timeout=3, allow_reconnect=False)
    # a fleet certificate without a NATS user (a replica's) is refused too
    creds = enrolment.enroll("east")
    replica = client_context(enrolment.pki.ca_file, creds.replica_cert, creds.replica_key)
    with pytest.raises(REFUSED):
        await nats.connect(server.url, tls=replica, connect_timeout=3, allow_reconnect=False)
    # the old plaintext, anonymous defaults (ssl.create_default_context) get nowhere either
    with pytest.raises(REFUSED):
        await nats.connect(
            server.url, tls=ssl.create_default_context(), connect_timeout=3, allow_reconnect=False
        )


async def test_agent_a_is_confined_to_its_own_subjects_and_desired_key(secured):
    server, enrolment, cp_tls = secured
    cp = await _control_plane(server.url, cp_tls)
    east = await Client().connect(server.url, nats_tls(enrolment.enroll("east"), "agent", "east"))
    try:
        seen = await cp.listen("fleet.v1.>", "$KV.>")
        cp_kv = {b: await cp.nc.jetstream().key_value(b) for b in protocol.BUCKETS}
        west_state = protocol.DesiredState(cluster="west", generation=7)
        await cp_kv[protocol.BUCKET_DESIRED].put("west", west_state.to_bytes())
        await cp_kv[protocol.BUCKET_DESIRED].put("east", protocol.DesiredState(cluster="east").to_bytes())

        # allowed: its own heartbeat, and its own desired key
        await east.nc.publish(protocol.heartbeat_subject("east"), b"{}")
        east_js = east.nc.jetstream()
        desired = await east_js.key_value(protocol.BUCKET_DESIRED)
        assert (await desired.get("east")).value
        await eventually(
            lambda: protocol.heartbeat_subject("east") in seen, what="east's heartbeat", timeout=30
        )

        # denied: west's heartbeat (the forged registration / gateway_url attack)
        await east.nc.publish(protocol.heartbeat_subject("west"), b'{"cluster": "west"}')
        assert await east.violation(protocol.heartbeat_subject("west"))
        # denied: writing keys (a key of its own making) or any desired state
        record_bytes = api_keys.ApiKeyRecord(key_id="evil", name="evil", salt="s", hash="h").to_bytes()
        for subject in ("$KV.fleet_keys.evil", "$KV.fleet_desired.east", "$KV.fleet_desired.west"):
            await east.nc.publish(subject, record_bytes)
            assert await east.violation(subject), east.errors
        keys = await east_js.key_value(protocol.BUCKET_KEYS)
        with pytest.raises(REFUSED):
            await keys.put("evil", record_bytes)
        # denied: reading west's desired state, by direct get or by subscribing
        with pytest.raises(REFUSED):
            await asyncio.wait_for(desired.get("west"), 3)
        assert await east.violation("DIRECT.GET.KV_fleet_desired.$KV.fleet_desired.west")
        await east.nc.subscribe("$KV.fleet_desired.west")
        assert await east.violation("$KV.fleet_desired.west")
        # denied: a consumer on the desired bucket (its filter would sit in the payload)
        with pytest.raises(REFUSED):
            await asyncio.wait_for(
                east_js.subscribe("$KV.fleet_desired.west", stream="KV_fleet_desired", ordered_consumer=True),
                3,
            )
        # denied: listening to other identities' replies
        await east.nc.subscribe("_INBOX.control-plane.>")
        assert await east.violation("_INBOX.control-plane.>")

        await _after_sentinel(east, seen, protocol.heartbeat_subject("east"))
        assert protocol.heartbeat_subject("west") not in seen
        assert not any(s.startswith("$KV.fleet_keys.") for s in seen)
        assert (await cp_kv[protocol.BUCKET_DESIRED].get("west")).value == west_state.to_bytes()
        with pytest.raises(KeyNotFoundError):
            await cp_kv[protocol.BUCKET_KEYS].get("evil")
    finally:
        await east.close()
        await cp.close()


async def test_gateway_identity_publishes_only_usage_and_demand_of_its_cluster(secured):
    server, enrolment, cp_tls = secured
    cp = await _control_plane(server.url, cp_tls)
    gw = await Client().connect(server.url, nats_tls(enrolment.enroll("west"), "gateway", "west"))
    try:
        seen = await cp.listen("fleet.v1.>")
        allowed = [protocol.usage_subject("west"), protocol.demand_subject("west")]
        for subject in allowed:
            await gw.nc.publish(subject, b"{}")
        try:
            await eventually(
                lambda: sorted(seen) == sorted(allowed), what="the allowed publishes", timeout=30
            )
        except AssertionError as err:
            raise AssertionError(
                f"{err}; seen {seen}; errors: gateway {gw.errors}, control plane {cp.errors}"
            ) from err
        for forged in (
            protocol.usage_subject("east"),
            protocol.heartbeat_subject("west"),
            "$KV.fleet_routes.x",
        ):
            await gw.nc.publish(forged, b"{}")
            assert await gw.violation(forged), gw.errors
        await _after_sentinel(gw, seen, protocol.usage_subject("west"))
        assert sorted(seen) == sorted([*allowed, protocol.usage_subject("west")])
    finally:
        await gw.close()
        await cp.close()


def _link(server, enrolment: Enrolment, role: str, cluster: str) -> NatsLink:
    """A link as the agent's or gateway's own: its certificate and its subject table."""
    creds = enrolment.enroll(cluster)
    tls = nats_tls(creds, role, cluster)
    return NatsLink(
        server.url, f"{role}-{cluster}", tls=tls, manage_jetstream=False, permits=permits(role, cluster)
    )


async def test_prefix_resync_is_allowed_after_a_gateway_restart(secured):
    """A gateway that (re)starts after a replica cached its prefixes asks the replica's
    agent for the full set (`fleet.v1.kvresync.<cluster>`): the generated permissions let
    the gateway ask and the agent hear it, and neither side is refused anything."""
    server, enrolment, _ = secured
    replica = FakeReplica()
    agent = _link(server, enrolment, "agent", "east")
    relay = KvRelay(agent, "east")
    gateways: list[NatsLink] = []
    async with served(replica):
        try:
            agent.start()
            assert await agent.wait_connected(10)
            await eventually(lambda: relay._nc is agent.nc, what="the relay's resync subscription")
            await agent.nc.flush()
            relay.sync([Followed("r1", "d", replica.url)])
            a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
            keys = prefix_keys(a, BS)
            replica.run(a)  # published before any gateway listens: only a resync tells it
            for _restart in range(2):
                link = _link(server, enrolment, "gateway", "west")
                gateways.append(link)
                prefix = PrefixRouting(link, "west", GatewayMetrics(load=dict), clusters=lambda: ["east"])
                link.start()
                await eventually(
                    lambda p=prefix: p.index.match("east", "r1", keys) == 2, 20, "the resynced set"
                )
                await link.close()
            assert not agent.refused and not any(g.refused for g in gateways), (agent.refused, gateways)
        finally:
            await relay.close()
            await agent.close()
            for g in gateways:
                await g.close()


async def test_a_flooding_cluster_leaves_room_for_revocations(secured):
    """A cluster's agent and gateway fill the events and usage streams with the largest
    messages they may send; each stream stays within its budget, the flooder evicts its
    own records before another cluster's, and the control plane's KV writes (a
    revocation, desired state) still succeed."""
    server, enrolment, cp_tls = secured
    cp = await _control_plane(server.url, cp_tls)
    js = cp.nc.jetstream()
    east = await Client().connect(server.url, nats_tls(enrolment.enroll("east"), "gateway", "east"))
    gw = await Client().connect(server.url, nats_tls(enrolment.enroll("west"), "gateway", "west"))
    agent = await Client().connect(server.url, nats_tls(enrolment.enroll("west"), "agent", "west"))
    try:
        record = protocol.UsageRecord(cluster="east", key_id="k1", deployment="d", prompt_tokens=3)
        await east.nc.publish(protocol.usage_subject("east"), record.to_bytes())
        await east.nc.flush()
        for client, name, subject in (
            (gw, protocol.STREAM_USAGE, protocol.usage_subject("west")),
            (agent, protocol.STREAM_EVENTS, protocol.events_subject("west")),
        ):
            limits = BUDGET.limits(name)
            big = b"x" * (limits.max_msg_size - 64)
            for _ in range(limits.max_msgs_per_subject * 2):
                await client.nc.publish(subject, big)
            await client.nc.publish(subject, b"y" * (limits.max_msg_size * 4))  # over the size cap
            await client.nc.flush()
            info = await js.stream_info(name, subjects_filter=subject)
            assert 0 < info.state.bytes <= limits.max_bytes, info.state
            assert (info.state.subjects or {}).get(subject, 0) <= limits.max_msgs_per_subject
        usage = await js.stream_info(protocol.STREAM_USAGE, subjects_filter=protocol.usage_subject("east"))
        assert (usage.state.subjects or {}).get(protocol.usage_subject("east")) == 1  # not evicted
        keys = await js.key_value(protocol.BUCKET_KEYS)
        revoked = api_keys.ApiKeyRecord(key_id="k1", name="k1", salt="s", hash="h", revoked=True)
        assert await keys.put("k1", revoked.to_bytes())
        desired = await js.key_value(protocol.BUCKET_DESIRED)
        assert await desired.put("west", protocol.DesiredState(cluster="west").to_bytes())
    finally:
        for c in (east, gw, agent, cp):
            await c.close()


def _kv_batch(cluster: str, replica: str, hashes: list[str]) -> bytes:
    op = KvCacheOp(kind="stored", block_hashes=[])
    op.block_hashes = hashes  # built past the wire's bounds, as a hostile sender would
    batch = KvCacheBatch(cluster=cluster, deployment="d", replica_id=replica, epoch="e", seq=0, snapshot=True)
    batch.ops = [op]
    return batch.to_bytes()


def _kv_seen(prefix: PrefixRouting) -> float:
    """KV-event messages this gateway has dealt with, whatever became of them."""
    counters = (prefix.events, getattr(prefix, "dropped", None))
    return sum(child._value.get() for c in counters if c is not None for child in c._metrics.values())


async def test_a_cluster_flooding_kv_events_harms_only_itself(secured):
    """A compromised cluster (west's agent identity) publishes 4 MB KV-event batches and
    thousands of batches for made-up replicas; the gateway of east drops the big ones
    unparsed and west's flood past its budget, keeps west's share of the index bounded,
    and keeps knowing east's own replica."""
    server, enrolment, _ = secured
    gateway = _link(server, enrolment, "gateway", "east")
    prefix = PrefixRouting(gateway, "east", GatewayMetrics(load=dict), events_per_s=100.0)
    west = await Client().connect(server.url, nats_tls(enrolment.enroll("west"), "agent", "west"))
    east = await Client().connect(server.url, nats_tls(enrolment.enroll("east"), "agent", "east"))
    try:
        gateway.start()
        assert await gateway.wait_connected(10)
        await eventually(lambda: prefix._nc is gateway.nc, what="the gateway's KV-event subscription")
        await gateway.nc.flush()
        mine = [f"{i:064x}" for i in range(8)]
        await east.nc.publish(kv_events.kvcache_subject("east"), _kv_batch("east", "e1", mine))
        await east.nc.flush()
        await eventually(lambda: prefix.index.holds("east", "e1", block_key(bytes.fromhex(mine[0]))))
        big = _kv_batch("west", "w-big", [f"{i:064x}" for i in range(60_000)])  # ~4 MB
        sent = 1
        for _ in range(3):
            await west.nc.publish(kv_events.kvcache_subject("west"), big)
            sent += 1
        for i in range(5000):
            await west.nc.publish(kv_events.kvcache_subject("west"), _kv_batch("west", f"w{i}", mine[:1]))
            sent += 1
        await west.nc.flush()
        await eventually(lambda: _kv_seen(prefix) >= sent, 60, "the flood through the gateway")
        assert prefix.index.holds("east", "e1", block_key(bytes.fromhex(mine[0])))  # not crowded out
        assert len(prefix.index.replicas("west", "d")) <= 256
        assert prefix.index.cluster_blocks("west") <= 262144
        assert prefix.dropped.labels("size")._value.get() == 3  # never parsed
        assert prefix.dropped.labels("rate")._value.get() > 0
    finally:
        await west.close()
        await east.close()
        await gateway.close()


async def test_gateway_identity_runs_the_batch_store_and_nothing_beside_it(secured):
    """A gateway's identity does every store operation on the batch resources the control
    plane created, and is refused the same operations on the resources beside them."""
    server, enrolment, cp_tls = secured
    cp = await _control_plane(server.url, cp_tls)
    gw = await Client().connect(server.url, nats_tls(enrolment.enroll("west"), "gateway", "west"))
    try:
        await batch_store_round_trip(await open_batch_store(gw.nc, BatchConfig()))
        assert gw.errors == []
        # a denied API request is never answered: the server's violation report is the
        # refusal, so the request need not wait out nats-py's default 5 s for its reply
        js = gw.nc.jetstream(timeout=1.0)
        for forged in (f"$KV.{protocol.BUCKET_DESIRED}.forged", "$O.other.C.x"):
            await gw.nc.publish(forged, b"{}")
            assert await gw.violation(forged), gw.errors
        consumer = batch_names.work_consumer("d1", 2)
        for subject, denied in (
            (f"STREAM.INFO.KV_{protocol.BUCKET_DESIRED}", js.stream_info(f"KV_{protocol.BUCKET_DESIRED}")),
            (f"STREAM.DELETE.{batch_names.STREAM_WORK}", js.delete_stream(batch_names.STREAM_WORK)),
            (f"STREAM.PURGE.{batch_names.STREAM_WEBHOOKS}", js.purge_stream(batch_names.STREAM_WEBHOOKS)),
            (
                f"CONSUMER.DELETE.{batch_names.STREAM_WORK}.{consumer}",
                js.delete_consumer(batch_names.STREAM_WORK, consumer),
            ),
        ):
            with pytest.raises(REFUSED):
                await denied
            assert await gw.violation(f"$JS.API.{subject}"), gw.errors
        with pytest.raises(KeyNotFoundError):  # the forged desired state was not stored
            await (await cp.nc.jetstream().key_value(protocol.BUCKET_DESIRED)).get("forged")
    finally:
        await gw.close()
        await cp.close()
