"""The admin API's batches and async requests over real HTTP, against a control plane
process (SQLite, no loops: any instance serves these) whose NATS is a real nats-server
holding the batch store: list (every key's, newest first, filters, paging), get, cancel
(compare-and-set to cancelling; 404, 409 with the reason, a CAS lost to a concurrent
writer), async requests without their results, the console's page, and 503 with the reason
while NATS is down, back to 200 when it returns."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import nats
import pytest

from control_plane.batch_store import CANCEL_ATTEMPTS, CancelRaced, NotCancellable, cancel_batch
from control_plane.local.nats_server import NatsServer
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import RequestCounts
from fleet_base.batch.nats_store import open_batch_store
from tests.control_plane.batch_seed import (
    async_record,
    batch_record,
    ensure_resources,
    seed_async,
    seed_batches,
    store_batch,
)
from tests.control_plane.cp_server import ControlPlaneServer
from tests.control_plane.test_console import Console

T0 = 1_700_000_000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batches-api")
    nats_server = NatsServer(tmp / "nats").start()
    server = None
    try:
        ensure_resources(nats_server.url)
        server = ControlPlaneServer(tmp / "home", f"sqlite:///{tmp / 'fleet.db'}", nats_server.url).start()
        yield server, nats_server
    finally:
        if server is not None:
            server.kill()
        nats_server.stop()


@pytest.fixture(scope="module")
def admin(fleet):
    with fleet[0].client() as client:
        yield client


def new_key(admin: httpx.Client, scopes: list[str] | None = None) -> tuple[str, str]:
    """(key id, secret) of a new key with a unique name."""
    body = admin.post(
        "/v1/keys", json={"name": f"k-{uuid.uuid4().hex[:8]}", "scopes": scopes or ["inference"]}
    )
    assert body.status_code == 201, body.text
    return body.json()["key_id"], body.json()["key"]


def ok(response: httpx.Response, status: int = 200) -> dict:
    assert response.status_code == status, response.text
    return response.json()


def test_list_every_keys_batches_newest_first_with_filters_and_paging(fleet, admin):
    url = fleet[1].url
    a, _ = new_key(admin)
    b, _ = new_key(admin)
    seeded = [
        batch_record(a, created_at=T0 + 1, status="completed", counts=(10, 0, 10)),
        batch_record(b, created_at=T0 + 3, status="in_progress", counts=(2, 1, 8)),
        batch_record(a, created_at=T0 + 2, status="in_progress"),
    ]
    seed_batches(url, seeded)
    mine = {r.id for r in seeded}

    listed = ok(admin.get("/v1/batches", params={"limit": 1000}))
    ours = [item for item in listed["items"] if item["id"] in mine]
    assert [item["id"] for item in ours] == [seeded[1].id, seeded[2].id, seeded[0].id]
    created = [item["created_at"] for item in listed["items"]]
    assert created == sorted(created, reverse=True)
    assert ours[0]["key_id"] == b and ours[0]["key_name"].startswith("k-")
    assert ours[0]["request_counts"] == {"total": 8, "completed": 2, "failed": 1}

    of_a = ok(admin.get("/v1/batches", params={"key_id": a}))
    assert [item["id"] for item in of_a["items"]] == [seeded[2].id, seeded[0].id] and of_a["total"] == 2
    done = ok(admin.get("/v1/batches", params={"key_id": a, "status": "completed"}))
    assert [item["id"] for item in done["items"]] == [seeded[0].id]
    first = ok(admin.get("/v1/batches", params={"key_id": a, "limit": 1}))
    second = ok(admin.get("/v1/batches", params={"key_id": a, "limit": 1, "offset": 1}))
    assert (first["total"], first["items"][0]["id"], second["items"][0]["id"]) == (
        2,
        seeded[2].id,
        seeded[0].id,
    )
    assert admin.get("/v1/batches", params={"status": "done"}).status_code == 422

    got = ok(admin.get(f"/v1/batches/{seeded[1].id}"))
    assert (
        got["status"] == "in_progress"
        and got["cluster"] == "east"
        and got["endpoint"] == "/v1/chat/completions"
    )
    missing = admin.get("/v1/batches/batch_nope")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "batch 'batch_nope' not found"


def test_cancel_moves_to_cancelling_from_validating_or_in_progress_only(fleet, admin):
    server, nats_server = fleet
    key, _ = new_key(admin)
    running = batch_record(key, created_at=T0 + 10, status="in_progress", counts=(1, 0, 4))
    validating = batch_record(key, created_at=T0 + 11, status="validating")
    finished = batch_record(key, created_at=T0 + 12, status="completed", counts=(4, 0, 4))
    seed_batches(nats_server.url, [running, validating, finished])

    before = time.time()
    moved = ok(admin.post(f"/v1/batches/{running.id}/cancel"))
    assert moved["status"] == "cancelling" and before - 1 <= moved["cancelling_at"] <= time.time() + 1
    stored = store_batch(nats_server.url, running.id)
    assert stored.status == "cancelling" and stored.request_counts == running.request_counts
    assert ok(admin.post(f"/v1/batches/{validating.id}/cancel"))["status"] == "cancelling"

    for batch, status in ((running, "cancelling"), (finished, "completed")):
        refused = admin.post(f"/v1/batches/{batch.id}/cancel")
        assert refused.status_code == 409
        assert refused.json()["error"]["message"] == (
            f"batch {batch.id} is {status}: only a validating or in_progress batch can be cancelled"
        )
    assert store_batch(nats_server.url, finished.id).status == "completed"
    assert admin.post("/v1/batches/batch_nope/cancel").status_code == 404

    trail = ok(admin.get("/v1/audit", params={"resource_type": "batch", "resource_id": running.id}))
    assert [r["action"] for r in trail["items"]] == ["batch.cancel"]

    _, read_secret = new_key(admin, ["read"])
    with server.client(read_secret) as reader:
        assert reader.get(f"/v1/batches/{finished.id}").status_code == 200
        assert reader.post(f"/v1/batches/{finished.id}/cancel").status_code == 403


class Racing:
    """The real store, where another writer updates the batch (`race`) right after each of
    the first `times` reads: the cancel's compare-and-set on the revision read loses."""

    def __init__(self, store, race, times: int) -> None:
        self.store, self.race, self.times = store, race, times

    async def batch(self, batch_id: str):
        read = await self.store.batch(batch_id)
        if self.times > 0:
            self.times -= 1
            await self.store.update_batch(self.race(read.value), read.revision)
        return read

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def test_cancel_compare_and_set_loses_to_a_concurrent_writer(fleet):
    url = fleet[1].url

    def progressed(record):
        counts = record.request_counts
        return record.model_copy(
            update={"request_counts": RequestCounts(total=counts.total, completed=counts.completed + 1)}
        )

    def finalized(record):
        return record.model_copy(update={"status": "finalizing"})

    async def run() -> None:
        nc = await nats.connect(url)
        try:
            store = await open_batch_store(nc, BatchConfig())
            one, two, three = (
                batch_record("racer", created_at=T0 + 20 + i, counts=(0, 0, 5)) for i in range(3)
            )
            for record in (one, two, three):
                await store.create_batch(record)

            # a driver counted a line between our read and write: re-read, cancel, counts kept
            moved = await cancel_batch(Racing(store, progressed, 1), one.id)
            assert moved.status == "cancelling" and moved.request_counts.completed == 1
            assert (await store.batch(one.id)).value.request_counts.completed == 1

            # the batch began finalizing meanwhile: the re-read refuses the cancel
            with pytest.raises(NotCancellable, match="is finalizing"):
                await cancel_batch(Racing(store, finalized, 1), two.id)
            assert (await store.batch(two.id)).value.status == "finalizing"

            # it loses every time: CancelRaced (the API's 409), the record untouched by us
            with pytest.raises(CancelRaced):
                await cancel_batch(Racing(store, progressed, CANCEL_ATTEMPTS), three.id)
            after = (await store.batch(three.id)).value
            assert after.status == "in_progress" and after.request_counts.completed == CANCEL_ATTEMPTS
        finally:
            await nc.close()

    asyncio.run(run())


def test_async_requests_every_keys_newest_first_without_results(fleet, admin):
    key, _ = new_key(admin)
    seeded = [
        async_record(key, created_at=T0 + 30, status="succeeded", delivery="delivered"),
        async_record(key, created_at=T0 + 31, status="queued", delivery="pending"),
    ]
    seed_async(fleet[1].url, seeded)
    listed = ok(admin.get("/v1/async/requests", params={"key_id": key}))
    assert [r["id"] for r in listed["items"]] == [seeded[1].id, seeded[0].id] and listed["total"] == 2
    assert all(r["result"] is None and r["key_name"].startswith("k-") for r in listed["items"])
    assert listed["items"][1]["delivery"] == "delivered"
    done = ok(admin.get("/v1/async/requests", params={"key_id": key, "status": "succeeded"}))
    assert [r["id"] for r in done["items"]] == [seeded[0].id]
    every = ok(admin.get("/v1/async/requests", params={"limit": 1000}))
    assert {r.id for r in seeded} <= {r["id"] for r in every["items"]}


def test_console_shows_batches_with_progress_and_async_requests(fleet, admin):
    server, nats_server = fleet
    key, _ = new_key(admin)
    batch = batch_record(key, created_at=int(time.time()), status="in_progress", counts=(30, 10, 160))
    request = async_record(key, created_at=int(time.time()), status="failed", delivery="failed")
    seed_batches(nats_server.url, [batch])
    seed_async(nats_server.url, [request])
    page = Console(server, server.token).get("/console/batches")
    assert page.status_code == 200 and 'id="batches-down"' not in page.text
    row = page.text.split(f'data-batch="{batch.id}"')[1].split("</tr>")[0]
    for cell in (
        '<span class="badge in_progress">in_progress</span>',
        'max="160" value="40"',
        "25%",
        "30 / 10 / 160",
    ):
        assert cell in row, cell
    async_row = page.text.split(f'data-async="{request.id}"')[1].split("</tr>")[0]
    assert '<span class="badge failed">failed</span>' in async_row and "tiny" in async_row
    panel = Console(server, server.token).get("/console/batches/panel")
    assert f'data-batch="{batch.id}"' in panel.text


ROUTES = (("get", "/v1/batches"), ("get", "/v1/batches/batch_x"), ("post", "/v1/batches/batch_x/cancel"),
          ("get", "/v1/async/requests"))  # fmt: skip


def test_503_with_the_reason_while_nats_is_down_then_back(fleet, admin):
    """Last in the module: it stops the nats-server (same port and store on restart)."""
    _, nats_server = fleet
    nats_server.stop()
    try:
        deadline = time.time() + 20
        while admin.get("/v1/batches").status_code != 503 and time.time() < deadline:
            time.sleep(0.2)
        for method, path in ROUTES:
            answer = admin.request(method.upper(), path)
            assert answer.status_code == 503, (path, answer.text)
            assert "NATS is unreachable" in answer.json()["error"]["message"]
    finally:
        nats_server.start()
    deadline = time.time() + 30
    while admin.get("/v1/batches").status_code != 200 and time.time() < deadline:
        time.sleep(0.2)
    assert ok(admin.get("/v1/batches"))["total"] >= 3
