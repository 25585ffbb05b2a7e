"""The webhook delivery loop against a real local receiver: retried while the receiver is
down, delivered exactly once when it is up, signed so the Standard Webhooks library
verifies it; given up after webhook_give_up_s with the result still stored; redirects are
failures; the connection goes to the addresses vetted at delivery time (DNS rebinding)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
from prometheus_client import CollectorRegistry
from standardwebhooks import Webhook

from agent.gateway.batch.async_api import finish_async_record
from agent.gateway.batch.webhooks import WebhookMetrics, WebhookSender
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import AsyncRecord, LineResponse, LineResult, StoredResult
from fleet_base.batch.names import new_async_id, result_key
from fleet_base.batch.webhook_signing import key_secret, new_master
from tests.agent.batch.receiver import Receiver
from tests.agent.batch.webhook_store import WebhookStore
from tests.polling import eventually

MASTER = new_master()
KEY = ApiKeyRecord(key_id="k1", name="k1", salt="s", hash="h", webhook_secret_version=3)
FAST = BatchConfig(
    webhook_allow=["127.0.0.1"], webhook_backoff_s=0.05, webhook_backoff_max_s=0.2, webhook_give_up_s=60
)


async def finished(store: WebhookStore, url: str) -> AsyncRecord:
    """An async request as the worker leaves it: result stored, record finished, webhook due."""
    now = time.time()
    record = AsyncRecord(
        id=new_async_id(),
        endpoint="/v1/chat/completions",
        model="tiny",
        status="succeeded",
        created_at=int(now),
        finished_at=int(now),
        result_expires_at=int(now + 3600),
        max_time_in_queue_s=600,
        webhook_url=url,
        delivery="pending",
        key_id=KEY.key_id,
    )
    body = {"object": "chat.completion", "choices": [{"message": {"content": "héllo"}}]}
    line = LineResult(
        id="r1", custom_id=record.id, response=LineResponse(status_code=200, request_id="q", body=body)
    )
    await store.put_result(result_key(record.id, None), StoredResult(line=line))
    await store.create_async(record)
    await store.enqueue_webhook(record.id)
    return record


def sender(
    store: WebhookStore, config: BatchConfig, registry: CollectorRegistry, **kw: object
) -> WebhookSender:
    keys: Callable[[str], ApiKeyRecord | None] = {KEY.key_id: KEY}.get
    metrics = WebhookMetrics(registry)
    return WebhookSender(store, config, keys, MASTER, metrics, draw=lambda: 1.0, **kw)  # type: ignore[arg-type]


def count(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("fleet_batch_webhook_deliveries_total", {"outcome": outcome}) or 0.0


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    yield r
    await r.stop()


async def test_down_receiver_gets_it_once_when_up(receiver: Receiver) -> None:
    store, registry = WebhookStore(), CollectorRegistry()
    loop = asyncio.create_task(sender(store, FAST, registry).run())
    try:
        record = await finished(store, receiver.url)
        await eventually(lambda: count(registry, "retried") >= 3, timeout=10)  # connection refused
        assert not receiver.received
        await receiver.start()
        await eventually(lambda: store.records[record.id].value.delivery == "delivered", timeout=10)
        await asyncio.sleep(0.5)  # nothing more comes
    finally:
        loop.cancel()
    assert len(receiver.received) == 1
    got = receiver.received[0]
    secret = key_secret(MASTER, KEY.key_id, KEY.webhook_secret_version)
    payload = Webhook(secret).verify(got.body, got.headers)
    assert got.headers["webhook-id"] == record.id
    assert got.headers["host"] == f"127.0.0.1:{receiver.port}"
    assert payload["id"] == record.id and payload["status"] == "succeeded"
    assert payload["result"]["response"]["body"]["choices"][0]["message"]["content"] == "héllo"
    final = store.records[record.id].value
    assert final.delivered_at is not None and final.delivery_attempts == payload["delivery_attempts"] >= 4
    assert store.acked == [record.id]
    assert count(registry, "delivered") == 1 and count(registry, "failed") == 0
    assert store.naks == sorted(store.naks)  # backing off


async def test_errors_and_redirects_are_retried(receiver: Receiver) -> None:
    receiver.statuses = [500, 302, 404]
    await receiver.start()
    store, registry = WebhookStore(), CollectorRegistry()
    loop = asyncio.create_task(sender(store, FAST, registry).run())
    try:
        record = await finished(store, receiver.url)
        await eventually(lambda: store.records[record.id].value.delivery == "delivered", timeout=10)
    finally:
        loop.cancel()
    assert len(receiver.received) == 4  # the redirect was not followed
    assert count(registry, "retried") == 3 and count(registry, "delivered") == 1
    assert len({r.headers["webhook-id"] for r in receiver.received}) == 1


async def test_given_up_keeps_the_result(receiver: Receiver) -> None:
    config = FAST.model_copy(update={"webhook_give_up_s": 0.6})
    store, registry = WebhookStore(), CollectorRegistry()
    loop = asyncio.create_task(sender(store, config, registry).run())
    try:
        record = await finished(store, receiver.url)
        await eventually(lambda: store.records[record.id].value.delivery == "failed", timeout=10)
    finally:
        loop.cancel()
    assert store.acked == [record.id] and count(registry, "failed") == 1
    assert store.results[result_key(record.id, None)].line.custom_id == record.id


async def test_duplicates_of_a_settled_delivery_send_nothing(receiver: Receiver) -> None:
    await receiver.start()
    store, registry = WebhookStore(), CollectorRegistry()
    loop = asyncio.create_task(sender(store, FAST, registry).run())
    try:
        record = await finished(store, receiver.url)
        await eventually(lambda: store.records[record.id].value.delivery == "delivered", timeout=10)
        await store.enqueue_webhook(record.id)  # e.g. the worker re-ran after a crash
        await eventually(lambda: len(store.acked) == 2, timeout=10)
    finally:
        loop.cancel()
    assert len(receiver.received) == 1


async def test_rebinding_to_a_refused_address_reaches_nothing(receiver: Receiver) -> None:
    """The name was public when the request was accepted; at delivery it resolves to
    loopback, which only the name's own allow-listing could open: nothing is sent."""
    await receiver.start()

    async def resolve(host: str, port: int) -> Sequence[str]:
        return ["127.0.0.1"]

    store, registry = WebhookStore(), CollectorRegistry()
    config = FAST.model_copy(update={"webhook_allow": []})
    loop = asyncio.create_task(sender(store, config, registry, resolve=resolve).run())
    try:
        record = await finished(store, f"http://hooks.example.com:{receiver.port}/hook")
        await eventually(lambda: count(registry, "retried") >= 2, timeout=10)
        assert not receiver.received
        # allow-listed by name: delivered to the vetted address with the name as Host
        loop.cancel()
        loop = asyncio.create_task(
            sender(
                store,
                FAST.model_copy(update={"webhook_allow": ["hooks.example.com"]}),
                CollectorRegistry(),
                resolve=resolve,
            ).run()
        )
        await eventually(lambda: store.records[record.id].value.delivery == "delivered", timeout=10)
    finally:
        loop.cancel()
    assert [r.headers["host"] for r in receiver.received] == [f"hooks.example.com:{receiver.port}"]
    assert json.loads(receiver.received[0].body)["id"] == record.id


def test_master_from_the_bundle_else_the_environment(tmp_path, monkeypatch) -> None:
    from agent.gateway.batch.webhooks import load_master
    from fleet_base.batch.webhook_signing import MASTER_ENV, encode_master

    bundle, env = tmp_path / "bundle-master", tmp_path / "env-master"
    bundle.write_bytes(encode_master(MASTER))
    other = new_master()
    env.write_bytes(encode_master(other))
    monkeypatch.setenv(MASTER_ENV, str(env))
    assert load_master(bundle) == MASTER
    assert load_master(None) == other
    monkeypatch.delenv(MASTER_ENV)
    assert load_master(None) is None
    assert load_master(tmp_path / "missing") is None


@pytest.mark.parametrize(("cert", "expected"), [("named", "delivered"), ("bare", "failed")])
async def test_https_to_the_vetted_address_checks_the_names_certificate(
    tmp_path, cert: str, expected: str
) -> None:
    """The connection goes to the vetted IP, yet TLS sends the URL's name (SNI) and checks
    the certificate against it: a certificate for the name verifies, one that only the
    address would match does not."""
    import ssl

    from control_plane.security.pki import FleetCA

    ca = FleetCA(tmp_path / "ca")
    ca.issue(tmp_path / "named.pem", tmp_path / "named.key", "replica", "east", ["hooks.example.com"])
    ca.issue(tmp_path / "bare.pem", tmp_path / "bare.key", "replica", "east", ["127.0.0.1"])
    verify = ssl.create_default_context(cafile=str(ca.cert_path))

    async def resolve(host: str, port: int) -> Sequence[str]:
        assert host == "hooks.example.com"
        return ["127.0.0.1"]

    config = FAST.model_copy(update={"webhook_allow": ["hooks.example.com"], "webhook_give_up_s": 1.0})
    receiver = Receiver(tls=(str(tmp_path / f"{cert}.pem"), str(tmp_path / f"{cert}.key")))
    await receiver.start()
    store, registry = WebhookStore(), CollectorRegistry()
    loop = asyncio.create_task(sender(store, config, registry, resolve=resolve, verify=verify).run())
    try:
        record = await finished(store, f"https://hooks.example.com:{receiver.port}/hook")
        await eventually(lambda: store.records[record.id].value.delivery == expected, timeout=10)
    finally:
        loop.cancel()
        await receiver.stop()
    assert len(receiver.received) == (1 if expected == "delivered" else 0)
    if receiver.received:
        assert receiver.received[0].headers["host"] == f"hooks.example.com:{receiver.port}"


async def test_the_workers_finishing_step_is_idempotent_and_queues_the_webhook() -> None:
    store = WebhookStore()
    now = time.time()
    record = AsyncRecord(
        id=new_async_id(),
        endpoint="/v1/embeddings",
        model="tiny",
        status="in_progress",
        created_at=int(now),
        max_time_in_queue_s=600,
        webhook_url="https://hooks.example.com/",
        delivery="pending",
        key_id=KEY.key_id,
    )
    await store.create_async(record)
    done = await finish_async_record(store, record.id, "succeeded", FAST, now)
    assert done is not None and done.status == "succeeded" and done.finished_at == int(now)
    assert done.result_expires_at == int(now + FAST.result_retention_s)
    again = await finish_async_record(store, record.id, "failed", FAST, now + 5)  # a re-run
    assert again == done
    assert store.webhooks.qsize() == 2  # the real queue drops the duplicate by message id
    assert await finish_async_record(store, "async_gone", "succeeded", FAST, now) is None
    quiet = record.model_copy(update={"id": new_async_id(), "webhook_url": None, "delivery": "none"})
    await store.create_async(quiet)
    assert (await finish_async_record(store, quiet.id, "expired", FAST, now)).status == "expired"  # type: ignore[union-attr]
    assert store.webhooks.qsize() == 2


async def test_a_request_that_never_ran_is_delivered_without_a_result(receiver: Receiver) -> None:
    """Expired in the queue: no result, the record says so, and the webhook still tells."""
    await receiver.start()
    store, registry = WebhookStore(), CollectorRegistry()
    loop = asyncio.create_task(sender(store, FAST, registry).run())
    try:
        now = time.time()
        record = AsyncRecord(
            id=new_async_id(),
            endpoint="/v1/chat/completions",
            model="tiny",
            status="queued",
            created_at=int(now),
            max_time_in_queue_s=1,
            webhook_url=receiver.url,
            delivery="pending",
            key_id=KEY.key_id,
        )
        await store.create_async(record)
        await store.enqueue_webhook(record.id)  # early: the record is not finished yet
        await eventually(lambda: len(store.naks) >= 2, timeout=10)
        assert not receiver.received
        await finish_async_record(store, record.id, "expired", FAST, time.time())
        await eventually(lambda: store.records[record.id].value.delivery == "delivered", timeout=10)
    finally:
        loop.cancel()
    assert len(receiver.received) == 1
    payload = json.loads(receiver.received[0].body)
    assert payload["status"] == "expired" and payload["result"] is None


async def test_a_stalling_receiver_costs_one_bounded_attempt(receiver: Receiver) -> None:
    # Each phase of an attempt has 1 s (the whole attempt 2 s): room for a prompt answer on a
    # loaded machine (0.3 s once timed out a second attempt's connect in CI), and well short
    # of the stall.
    timeout_s, stall_s = 1.0, 6.0
    receiver.delays = [stall_s]
    await receiver.start()
    store, registry = WebhookStore(), CollectorRegistry()
    loop = asyncio.create_task(sender(store, FAST, registry, timeout_s=timeout_s).run())
    started = time.monotonic()
    try:
        record = await finished(store, receiver.url)
        await eventually(lambda: store.records[record.id].value.delivery == "delivered", timeout=10)
    finally:
        loop.cancel()
    # The first attempt was cut at its bound and retried (a sender that waited out the stall
    # would have had its 200 on the first attempt), before the stall ended.
    assert len(receiver.received) == 2 and count(registry, "retried") == 1  # the same webhook-id twice
    assert time.monotonic() - started < stall_s
