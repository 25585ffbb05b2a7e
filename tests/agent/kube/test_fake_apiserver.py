"""The fake API server keeps to the API's semantics as the real client sees them: Status
errors (409 AlreadyExists, 404 NotFound), label selectors, resourceVersion on every write,
watch replay and 410 Expired, graceful deletion of bound pods."""

from __future__ import annotations

import pytest
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.codecs import from_dict
from lightkube.config.models import Cluster, User
from lightkube.resources.core_v1 import Pod

from tests.agent.kube.fake_apiserver import parse_selector, selector_matches

NS = "fleet"


def pod(name: str, **labels: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "i:1"}]},
    }


@pytest.fixture
async def client(api):
    c = AsyncClient(KubeConfig.from_one(cluster=Cluster(server=api.url), user=User(), namespace=NS))
    yield c
    await c.close()


async def test_errors_are_status_objects(api, client) -> None:
    await client.create(from_dict(pod("a")), namespace=NS)
    with pytest.raises(ApiError) as err:
        await client.create(from_dict(pod("a")), namespace=NS)
    assert (err.value.status.code, err.value.status.reason) == (409, "AlreadyExists")
    with pytest.raises(ApiError) as err:
        await client.get(Pod, "nope", namespace=NS)
    assert (err.value.status.code, err.value.status.reason) == (404, "NotFound")


async def test_every_write_bumps_resource_version_and_watch_replays(api, client) -> None:
    created = await client.create(from_dict(pod("a", app="x")), namespace=NS)
    rv0 = int(created.metadata.resourceVersion)
    api.schedule("a", namespace=NS)
    api.run("a", ready=True, namespace=NS)
    assert int(api.pod("a", NS)["metadata"]["resourceVersion"]) == rv0 + 2
    seen = []
    async for kind, obj in client.watch(Pod, namespace=NS, resource_version=str(rv0), server_timeout=1):
        seen.append((kind, obj.status.phase))
        if len(seen) == 2:
            break
    assert seen == [("MODIFIED", "Pending"), ("MODIFIED", "Running")]
    api.compact()
    with pytest.raises(ApiError) as err:
        async for _ in client.watch(Pod, namespace=NS, resource_version=str(rv0)):
            pass
    assert err.value.status.code == 410


async def test_graceful_delete_of_a_bound_pod(api, client) -> None:
    await client.create(from_dict(pod("a")), namespace=NS)
    await client.create(from_dict(pod("b")), namespace=NS)
    api.schedule("a", namespace=NS)
    await client.delete(Pod, "a", namespace=NS, grace_period=30)
    await client.delete(Pod, "b", namespace=NS, grace_period=30)  # unbound: at once
    assert api.pod("a", NS)["metadata"]["deletionGracePeriodSeconds"] == 30
    assert [p["metadata"]["name"] for p in api.pods(NS)] == ["a"]
    await client.delete(Pod, "a", namespace=NS, grace_period=60)  # may only shorten
    assert api.pod("a", NS)["metadata"]["deletionGracePeriodSeconds"] == 30
    await client.delete(Pod, "a", namespace=NS, grace_period=0)
    assert api.pods(NS) == []


@pytest.mark.parametrize(
    ("selector", "labels", "match"),
    [
        ("a=1,b==2", {"a": "1", "b": "2"}, True),
        ("a=1,b==2", {"a": "1"}, False),
        ("a!=1", {}, True),
        ("a", {"a": ""}, True),
        ("!a", {"a": "x"}, False),
        ("tier in (spot, on-demand)", {"tier": "spot"}, True),
        ("tier notin (spot)", {"tier": "spot"}, False),
    ],
)
def test_label_selectors(selector, labels, match) -> None:
    assert selector_matches(parse_selector(selector), labels) is match


def test_bad_selector_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_selector("a=1,=b")
