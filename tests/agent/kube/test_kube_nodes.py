"""Node health on the kubernetes runtime: a replica's node is its pod's; cordon makes the
Node unschedulable and taints it `fleet.dev/unhealthy`, uncordon undoes only Fleet's part;
recycle deletes only this agent's replica pods on the node. The runtime runs against the
fake API server (it stands in for a kube-apiserver) with the RBAC rules of
deploy/kubernetes/base/rbac.yaml enforced: a call the Role and ClusterRole do not grant
is a 403, and the grants are checked to be no more than the calls.

| row | the node before | what the runtime does | the node / pods after |
|---|---|---|---|
| cordon | schedulable, an admin's taint | cordon "xid 79 on GPU 3" | unschedulable, both taints, reason annotated |
| cordon again | Fleet's cordon | cordon (same reason) | no write |
| cordon a cordoned node | an admin cordoned it | cordon, then uncordon | Fleet's taint gone, still unschedulable |
| uncordon | Fleet's cordon, foreign taints | uncordon | schedulable, foreign taints kept |
| conflict | another writer between get and patch | cordon | 409, read again, both writes kept |
| recycle | Fleet pods on n1 and n2, a foreign pod on n1 | recycle n1 | only Fleet's n1 pods deleted, ids returned |
| restart | n1 cordoned (then uncordoned by hand, taint left) | start the replica again | its pod does not fit n1 either way, fits n2 |
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightkube import ApiError
from lightkube.resources.core_v1 import Node, Pod

from agent.runtime.kube_node import (
    CORDONED_ANNOTATION,
    REASON_ANNOTATION,
    TAINT_KEY,
    cordon_patch,
    taint_value,
    uncordon_patch,
)
from agent.runtime.kubernetes import KubernetesRuntime
from tests.agent.kube.conftest import NAMESPACE, config_for, fake_cluster, spec
from tests.agent.kube.fake_apiserver import FakeApiServer, Rbac
from tests.polling import eventually

RBAC = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes" / "base" / "rbac.yaml"
ADMIN_TAINT = {"key": "maintenance.example.com/window", "value": "tuesday", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.fixture
async def api():
    async with fake_cluster() as server:
        server.rbac = Rbac.from_manifest(RBAC, NAMESPACE)
        yield server


@pytest.fixture
async def rt(api, tmp_path):
    runtime = KubernetesRuntime(config_for(api, tmp_path))
    yield runtime
    await runtime.close()


def taints(api: FakeApiServer, node: str) -> list[dict]:
    return api.node(node)["spec"].get("taints") or []


def forbidden(api: FakeApiServer) -> list:
    return [r for r in api.requests if not api.rbac.allows(r)]


# ------------------------------------------------------------------ pure


@pytest.mark.parametrize(
    ("reason", "value"),
    [
        ("xid 79 on GPU 3", "xid"),
        ("wrong_answer: replica r1 answered differently", "wrong_answer"),
        ("ecc_uncorrectable", "ecc_uncorrectable"),
        ("", "fault"),
        ("--- !!!", "fault"),
        ("x" * 100, "x" * 63),
        ("ünïcode", "n-code"),
    ],
)
def test_taint_value_is_a_label_value(reason: str, value: str) -> None:
    assert taint_value(reason) == value


def test_patches_are_idempotent_and_keep_foreign_taints() -> None:
    node = {"metadata": {"name": "n1", "resourceVersion": "7"}, "spec": {"taints": [GPU_TAINT]}}
    patch = cordon_patch(node, "xid 79")
    assert patch is not None and patch["metadata"]["resourceVersion"] == "7"
    assert patch["spec"] == {
        "unschedulable": True,
        "taints": [GPU_TAINT, {"key": TAINT_KEY, "value": "xid", "effect": "NoSchedule"}],
    }
    cordoned = {
        "metadata": {"name": "n1", "resourceVersion": "8", "annotations": patch["metadata"]["annotations"]},
        "spec": patch["spec"],
    }
    assert cordon_patch(cordoned, "xid 79") is None  # already so: nothing to write
    assert cordon_patch(cordoned, "stall")["spec"]["taints"][-1]["value"] == "stall"  # type: ignore[index]
    assert uncordon_patch(node) is None  # not Fleet's: nothing to undo
    undo = uncordon_patch(cordoned)
    assert undo == {
        "metadata": {
            "resourceVersion": "8",
            "annotations": {REASON_ANNOTATION: None, CORDONED_ANNOTATION: None},
        },
        "spec": {"taints": [GPU_TAINT], "unschedulable": None},
    }


# ------------------------------------------------------------------ against the API


async def test_cordon_then_uncordon_keeps_foreign_taints(api, rt) -> None:
    api.add_node("n1", taints=[GPU_TAINT])
    await rt.cordon_node("n1", "xid 79 on GPU 3")
    node = api.node("n1")
    assert node["spec"]["unschedulable"] is True
    assert taints(api, "n1") == [GPU_TAINT, {"key": TAINT_KEY, "value": "xid", "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"][REASON_ANNOTATION] == "xid 79 on GPU 3"
    writes = len(api.events)
    await rt.cordon_node("n1", "xid 79 on GPU 3")
    assert len(api.events) == writes  # a repeated cordon writes nothing

    api.update_node("n1", lambda n: n["spec"]["taints"].append(ADMIN_TAINT))  # an admin adds one
    await rt.uncordon_node("n1")
    node = api.node("n1")
    assert "unschedulable" not in node["spec"]
    assert taints(api, "n1") == [GPU_TAINT, ADMIN_TAINT]
    assert not (node["metadata"].get("annotations") or {})
    await rt.uncordon_node("n1")  # nothing of Fleet's left: no write
    assert {(r.resource, r.verb) for r in api.requests if r.resource == "nodes"} == {
        ("nodes", "get"),
        ("nodes", "patch"),
    }
    assert forbidden(api) == []


async def test_an_admins_cordon_outlives_fleets_uncordon(api, rt) -> None:
    api.add_node("n1", taints=[ADMIN_TAINT], unschedulable=True)
    await rt.cordon_node("n1", "stall")
    assert api.node("n1")["metadata"]["annotations"][CORDONED_ANNOTATION] == "kept"
    await rt.uncordon_node("n1")
    assert api.node("n1")["spec"]["unschedulable"] is True
    assert taints(api, "n1") == [ADMIN_TAINT]


async def test_cordon_retries_a_conflict_and_keeps_the_other_write(api, rt, monkeypatch) -> None:
    api.add_node("n1")
    real_get = rt.client.get

    async def get_then_someone_writes(res, name, **kw):
        obj = await real_get(res, name, **kw)
        if not any(r.verb == "patch" for r in api.requests):  # before the first patch only
            api.update_node("n1", lambda n: n["spec"].setdefault("taints", []).append(ADMIN_TAINT))
        return obj

    monkeypatch.setattr(rt.client, "get", get_then_someone_writes)
    await rt.cordon_node("n1", "thermal")
    assert taints(api, "n1") == [ADMIN_TAINT, {"key": TAINT_KEY, "value": "thermal", "effect": "NoSchedule"}]
    assert [r.verb for r in api.requests if r.resource == "nodes"] == ["get", "patch", "get", "patch"]


async def test_missing_node_is_not_an_error(api, rt) -> None:
    await rt.cordon_node("gone", "xid 79")
    await rt.uncordon_node("gone")


async def test_replica_node_and_recycle_only_fleets_pods(api, rt) -> None:
    api.add_node("n1")
    api.add_node("n2")
    handles = {}
    for rid, node in (("chat-v1-aaa111", "n1"), ("chat-v1-bbb222", "n1"), ("chat-v1-ccc333", "n2")):
        handles[rid] = await rt.start(spec(rid))
        assert await rt.replica_node(rid) is None  # not scheduled yet
        api.schedule(handles[rid].pod.split("/")[1], node=node, namespace=NAMESPACE)
    pod_of = {rid: h.pod.split("/")[1] for rid, h in handles.items()}
    foreign = {  # carries one of Fleet's labels, but not this agent's selector
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "someone-elses", "labels": {"app.kubernetes.io/name": "fleet"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i:1"}]},
    }
    api.add(foreign, namespace=NAMESPACE)

    async def placed() -> bool:
        return [await rt.replica_node(rid) for rid in pod_of] == ["n1", "n1", "n2"]

    await eventually(placed)
    assert await rt.replica_node("no-such-replica") is None

    assert sorted(await rt.recycle_node("n1")) == ["chat-v1-aaa111", "chat-v1-bbb222"]
    left = {p["metadata"]["name"]: p for p in api.pods(NAMESPACE)}
    assert not left["someone-elses"]["metadata"].get("deletionTimestamp")
    assert not left[pod_of["chat-v1-ccc333"]]["metadata"].get("deletionTimestamp")
    for rid in ("chat-v1-aaa111", "chat-v1-bbb222"):  # bound: they drain with their grace
        assert left[pod_of[rid]]["metadata"]["deletionGracePeriodSeconds"] > 0
    assert await rt.recycle_node("n1") == []  # the rest is already terminating
    api.finish_termination(pod_of["chat-v1-aaa111"], namespace=NAMESPACE)

    async def failed():
        probe = await rt.poll(handles["chat-v1-aaa111"])
        return probe if probe.state.value == "failed" else None

    probe = await eventually(failed)
    assert "recycled off node n1" in probe.error  # the agent restarts it...
    await rt.cordon_node("n1", "xid 79")
    again = await rt.start(spec("chat-v1-aaa111", pool="h100-spot"))  # GPU + spot tolerations
    pod = api.pod(again.pod.split("/")[1], NAMESPACE)
    assert pod["spec"]["tolerations"]
    assert "unschedulable" in api.why_not_fits(pod, "n1")  # ...and the scheduler avoids n1
    api.update_node("n1", lambda n: n["spec"].pop("unschedulable"))  # someone uncordons by hand
    assert TAINT_KEY in api.why_not_fits(pod, "n1")  # Fleet's taint still keeps it off
    assert api.why_not_fits(pod, "n2") == ""
    assert forbidden(api) == []


async def test_the_fake_enforces_the_role(api, rt) -> None:
    """The fake's RBAC answers what the real authorizer would: nodes may not be listed or
    deleted by the agent, and its Role does not reach another namespace."""
    api.add_node("n1")
    with pytest.raises(ApiError) as err:
        await rt.client.delete(Node, "n1")
    assert err.value.status.code == 403
    with pytest.raises(ApiError) as err:
        [n async for n in rt.client.list(Node)]
    assert err.value.status.code == 403
    with pytest.raises(ApiError) as err:
        [p async for p in rt.client.list(Pod, namespace="kube-system")]
    assert err.value.status.code == 403
