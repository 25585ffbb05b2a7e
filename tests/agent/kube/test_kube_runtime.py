"""The kubernetes runtime's behaviour table, each row against the fake API server (a real
HTTP server the real lightkube client talks to; it stands in for a kube-apiserver), and
every object the runtime creates validated against the official 1.30 schemas, strictly.

| row | what the cluster does | what the runtime / agent reports |
|---|---|---|
| create | pod Pending -> scheduled -> Running, Ready | starting, then ready at the pod IP |
| adopt | agent restarts without runtime.json | finds the pod by labels, adopts it, starts no second pod |
| restart | container OOMKilled / ImagePullBackOff | failed with the reason and log tail; new pod after the backoff |
| unschedulable | PodScheduled=False Unschedulable | starting + unschedulable; heartbeat lists it, pool shrinks |
| preemption | spot node shut down / node deleted | failed + preempted; heartbeat `preempted` |
| drain | stop | delete with the drain grace; waits for the kubelet to finish |
| delete | kill / owner Deployment deleted | gone at once / garbage-collected, reported failed |

Over ~400 lines: one behaviour table, a test per row, sharing the fake cluster fixtures.
"""

from __future__ import annotations

import pytest

from agent.daemon import Agent
from agent.gateway.capacity_metrics import UnschedulableCollector
from agent.runtime.base import InvalidSpec
from agent.runtime.kube_pod import termination_grace_s
from agent.runtime.kubernetes import KubernetesRuntime
from fleet_base.protocol import DesiredState, ReplicaState
from tests.agent.kube.conftest import NAMESPACE, config_for, run_ready, spec, start_running, validate
from tests.polling import eventually


def created_pods(api) -> list[dict]:
    """Every pod object the runtime POSTed, as the server stored it at creation."""
    return [obj for _, kind, plural, obj in api.events if kind == "ADDED" and plural == "pods"]


def validate_created(api) -> None:
    pods = created_pods(api)
    assert pods
    for pod in pods:
        body = {k: v for k, v in pod.items() if k != "status"}
        meta = {
            k: v
            for k, v in body["metadata"].items()
            if k not in ("uid", "creationTimestamp", "resourceVersion")
        }
        validate({**body, "metadata": meta})
        validate(pod)  # as stored, with server fields


async def serve_desired(api, agent: Agent) -> str:
    """Reconcile the agent's one desired replica into a pod, run it ready and reconcile
    again once the runtime saw it running: the pod's name."""
    await agent.reconcile_once()
    (pod,) = api.pods(NAMESPACE)
    name = pod["metadata"]["name"]
    run_ready(api, name)
    await eventually(lambda: agent.runtime.pods.get(name, {}).get("status", {}).get("phase") == "Running")
    await agent.reconcile_once()
    return name


class Events:
    """Captures what the agent publishes (no NATS here)."""

    def __init__(self, agent: Agent) -> None:
        self.items: list = []

        async def publish(subject, message) -> bool:
            self.items.append(message)
            return True

        agent.link.publish = publish  # type: ignore[method-assign]

    def kinds(self) -> list[str]:
        return [getattr(m, "kind", "") for m in self.items]


async def test_create_pod_then_ready_at_pod_ip(api, tmp_path) -> None:
    rt = KubernetesRuntime(config_for(api, tmp_path))
    try:
        handle = await rt.start(spec())
        name = handle.pod.split("/")[1]
        pod = api.pod(name, NAMESPACE)
        labels = pod["metadata"]["labels"]
        assert labels["fleet.dev/deployment"] == "chat"
        assert labels["fleet.dev/replica"] == "chat-v1-abc123"
        assert labels["fleet.dev/version"] == "1" and labels["fleet.dev/pool"] == "h100-spot"
        owner = pod["metadata"]["ownerReferences"][0]
        assert (
            owner["kind"] == "Deployment"
            and owner["uid"] == api.objects[("deployments", NAMESPACE, "fleet-agent")]["metadata"]["uid"]
        )
        c = pod["spec"]["containers"][0]
        assert (
            c["resources"]["limits"]["nvidia.com/gpu"] == "1" == c["resources"]["requests"]["nvidia.com/gpu"]
        )
        assert pod["spec"]["nodeSelector"] == {
            "cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
            "cloud.google.com/gke-spot": "true",
        }
        assert {t["key"] for t in pod["spec"]["tolerations"]} == {
            "cloud.google.com/gke-spot",
            "nvidia.com/gpu",
        }
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 900
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["spec"]["terminationGracePeriodSeconds"] == termination_grace_s(2.0)
        assert c["lifecycle"]["preStop"]
        assert any(m["mountPath"] == "/models" and m["readOnly"] for m in c["volumeMounts"])
        validate_created(api)

        probe = await rt.poll(handle)
        assert probe.state == ReplicaState.starting, probe
        api.schedule(name, namespace=NAMESPACE)
        api.run(name, ready=False, ip="10.4.0.9", namespace=NAMESPACE)
        assert await eventually(lambda: rt.pods.get(name, {}).get("status", {}).get("podIP"))
        assert (await rt.poll(handle)).state == ReplicaState.starting
        api.run(name, ready=True, ip="10.4.0.9", namespace=NAMESPACE)

        async def ready():
            return (await rt.poll(handle)).state == ReplicaState.ready

        await eventually(ready, what="ready")
        assert handle.url == "http://10.4.0.9:8000"
    finally:
        await rt.close()


async def test_invalid_spec_makes_no_api_call(api, tmp_path) -> None:
    rt = KubernetesRuntime(config_for(api, tmp_path))
    try:
        before = len(api.requests)
        with pytest.raises(InvalidSpec):
            await rt.start(spec(replica_id="Chat_V1"))
        with pytest.raises(InvalidSpec):
            await rt.start(spec().model_copy(update={"engine_args": {"port": 1}}))
        assert len(api.requests) == before
    finally:
        await rt.close()


async def test_adopt_after_agent_restart_without_runtime_json(api, tmp_path) -> None:
    config = config_for(api, tmp_path)
    desired = DesiredState(cluster=config.cluster, generation=1, replicas=[spec()])
    first = Agent(config, KubernetesRuntime(config))
    first.desired = desired
    name = await serve_desired(api, first)
    assert first.replicas["chat-v1-abc123"].state == ReplicaState.ready
    await first.runtime.close()  # the agent dies; its replicas keep running

    config2 = config.model_copy(update={"state_dir": tmp_path / "fresh"})  # runtime.json is gone
    second = Agent(config2, KubernetesRuntime(config2))
    try:
        await second.replica_controller.adopt()
        assert set(second.replicas) == {"chat-v1-abc123"}
        assert second.replicas["chat-v1-abc123"].spec == spec()
        second.desired = desired
        await eventually(second.runtime.synced.is_set)
        await second.reconcile_once()
        assert second.replicas["chat-v1-abc123"].state == ReplicaState.ready
        assert [p["metadata"]["name"] for p in api.pods(NAMESPACE)] == [name]  # no second pod
        assert second.replicas["chat-v1-abc123"].handle.url == "http://10.0.0.7:8000"
        validate_created(api)
    finally:
        await second.runtime.close()


@pytest.mark.parametrize(
    ("fail", "words"),
    [
        ("oom", ["OOMKilled", "exit code 137", "32Gi", "CUDA out of"]),
        ("image", ["ImagePullBackOff", "not found"]),
    ],
)
async def test_failed_pod_restarts_after_backoff(api, tmp_path, fail, words) -> None:
    now = [1000.0]
    config = config_for(api, tmp_path)
    agent = Agent(config, KubernetesRuntime(config), clock=lambda: now[0])
    events = Events(agent)
    try:
        agent.desired = DesiredState(cluster=config.cluster, generation=1, replicas=[spec(pool="h100")])
        await agent.reconcile_once()
        (pod,) = api.pods(NAMESPACE)
        first = pod["metadata"]["name"]
        api.schedule(first, namespace=NAMESPACE)
        if fail == "oom":
            api.run(first, ready=True, namespace=NAMESPACE)
            api.terminate(first, 137, "OOMKilled", namespace=NAMESPACE, log="loading\nCUDA out of memory")
        else:
            api.wait_container(
                first, "ImagePullBackOff", 'Back-off pulling image "fleet:nope": not found', NAMESPACE
            )
        r = agent.replicas["chat-v1-abc123"]

        async def failed():
            await agent.reconcile_once()
            return r.state == ReplicaState.failed

        await eventually(failed, what="failed")
        for word in words:
            assert word in r.last_error
        assert "replica_failed" in events.kinds()
        await eventually(lambda: not api.pods(NAMESPACE), what="failed pod deleted")
        assert r.next_restart_at == pytest.approx(1001.0)
        await agent.reconcile_once()
        assert not api.pods(NAMESPACE)  # still backing off
        now[0] = 1001.5
        await agent.reconcile_once()
        (again,) = api.pods(NAMESPACE)
        assert again["metadata"]["name"] != first
        assert again["metadata"]["labels"]["fleet.dev/replica"] == "chat-v1-abc123"
        assert r.restarts == 1 and r.state == ReplicaState.starting
        assert "replica_restarted" in events.kinds()
        validate_created(api)
    finally:
        await agent.runtime.close()


async def test_unschedulable_reported_in_heartbeat_and_pool_shrinks(api, tmp_path) -> None:
    config = config_for(api, tmp_path)
    agent = Agent(config, KubernetesRuntime(config))
    agent.reporter.pools = list(config.pools)
    events = Events(agent)
    try:
        agent.desired = DesiredState(
            cluster=config.cluster,
            generation=1,
            replicas=[spec("chat-v1-aaa111", gpus=8), spec("chat-v1-bbb222", gpus=8)],
        )
        await agent.reconcile_once()
        a, b = sorted(api.pods(NAMESPACE), key=lambda p: p["metadata"]["labels"]["fleet.dev/replica"])
        run_ready(api, a["metadata"]["name"])
        api.unschedulable(
            b["metadata"]["name"], "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", NAMESPACE
        )

        async def flagged():
            await agent.reconcile_once()
            return agent.replicas["chat-v1-bbb222"].unschedulable

        await eventually(flagged, what="unschedulable")
        hb = agent.heartbeat()
        assert hb.unschedulable == ["chat-v1-bbb222"]
        assert [r.replica_id for r in hb.replicas if r.unschedulable] == ["chat-v1-bbb222"]
        (family,) = UnschedulableCollector(lambda: agent.snapshot().replicas).collect()
        assert [(s.labels, s.value) for s in family.samples] == [
            ({"deployment": "chat", "pool": "h100-spot"}, 1)
        ]
        spot = next(p for p in hb.pools if p.name == "h100-spot")
        assert spot.nodes == 1  # declared 2 nodes of 8; the cluster holds the 8 GPUs in use
        assert next(p for p in hb.pools if p.name == "h100").nodes == 1
        assert "replica_unschedulable" in events.kinds()
        assert agent.replicas["chat-v1-bbb222"].state == ReplicaState.starting
        assert "Insufficient nvidia.com/gpu" in agent.replicas["chat-v1-bbb222"].last_error
        # the control plane re-places it elsewhere: the pending pod goes
        agent.desired = DesiredState(
            cluster=config.cluster, generation=2, replicas=[spec("chat-v1-aaa111", gpus=8)]
        )
        await agent.reconcile_once()
        await eventually(lambda: len(api.pods(NAMESPACE)) == 1, what="pending pod deleted")
        await eventually(lambda: "chat-v1-bbb222" not in agent.replicas, what="replica forgotten")
        assert agent.heartbeat().unschedulable == []
        assert next(p for p in agent.heartbeat().pools if p.name == "h100-spot").nodes == 1  # held
        validate_created(api)
    finally:
        await agent.runtime.close()


@pytest.mark.parametrize(
    ("pool", "how", "preempted"),
    [
        ("h100-spot", "shutdown", True),
        ("h100-spot", "node-deleted", True),
        ("h100", "shutdown", False),
    ],
)
async def test_spot_node_loss_is_preemption(api, tmp_path, pool, how, preempted) -> None:
    config = config_for(api, tmp_path)
    agent = Agent(config, KubernetesRuntime(config))
    events = Events(agent)
    try:
        agent.desired = DesiredState(cluster=config.cluster, generation=1, replicas=[spec(pool=pool)])
        name = await serve_desired(api, agent)
        if how == "shutdown":
            api.node_shutdown(name, namespace=NAMESPACE)
        else:  # the node object is deleted; pod GC removes its pods
            api._remove("pods", NAMESPACE, name)
        r = agent.replicas["chat-v1-abc123"]

        async def failed():
            await agent.reconcile_once()
            return r.state == ReplicaState.failed

        await eventually(failed, what="failed")
        hb = agent.heartbeat()
        assert hb.preempted == (["chat-v1-abc123"] if preempted else [])
        failed_event = next(m for m in events.items if getattr(m, "kind", "") == "replica_failed")
        assert "node lost" in failed_event.message  # replica_preempted is the control plane's record
        assert ("restart in 30.0 s" in failed_event.message) is preempted
        # a preempted replica waits for the control plane to re-place it before restarting here
        assert (r.next_restart_at - r.failed_at >= 30) is preempted
        validate_created(api)
    finally:
        await agent.runtime.close()


async def test_drain_deletes_with_grace_and_waits_for_kubelet(api, tmp_path) -> None:
    import asyncio

    rt = KubernetesRuntime(config_for(api, tmp_path))
    try:
        handle, name = await start_running(api, rt, spec())
        stop = asyncio.create_task(rt.stop(handle, drain_timeout_s=2.0))
        await eventually(
            lambda: api.pod(name, NAMESPACE)["metadata"].get("deletionTimestamp"), what="terminating"
        )
        assert api.pod(name, NAMESPACE)["metadata"]["deletionGracePeriodSeconds"] == termination_grace_s(2.0)

        def waiting_on_the_terminating_pod() -> bool:
            # the cache saw the terminating pod (that sets _changed) and stop's wait for it to
            # go has looked since (it clears _changed, then waits for the next change)
            assert not stop.done(), "stop returned while the pod was still there"
            cached = rt.pods.get(name, {}).get("metadata", {})
            return bool(cached.get("deletionTimestamp")) and not rt._changed.is_set()

        await eventually(waiting_on_the_terminating_pod, what="stop waiting on the terminating pod")
        assert not stop.done()  # still draining: the pod is there
        api.terminate(name, 0, "Completed", namespace=NAMESPACE)
        api.finish_termination(name, namespace=NAMESPACE)
        assert await asyncio.wait_for(stop, 10) == 0
        assert not api.pods(NAMESPACE)
        validate_created(api)
    finally:
        await rt.close()


async def test_kill_and_owner_garbage_collection(api, tmp_path) -> None:
    rt = KubernetesRuntime(config_for(api, tmp_path))
    try:
        one = await rt.start(spec("chat-v1-aaa111"))
        two = await rt.start(spec("chat-v1-bbb222", pool="h100"))
        for h in (one, two):
            api.schedule(h.pod.split("/")[1], namespace=NAMESPACE)
        await rt.kill(one)  # grace 0: gone at once
        assert [p["metadata"]["labels"]["fleet.dev/replica"] for p in api.pods(NAMESPACE)] == [
            "chat-v1-bbb222"
        ]
        # uninstalling the agent (its Deployment) garbage-collects the replica pods
        api._remove("deployments", NAMESPACE, "fleet-agent")
        assert not api.pods(NAMESPACE)

        async def failed():
            return (await rt.poll(two)).state == ReplicaState.failed

        await eventually(failed, what="failed")
        probe = await rt.poll(two)
        assert not probe.preempted and "deleted outside the agent" in probe.error
        validate_created(api)
    finally:
        await rt.close()


async def test_watch_relists_after_410_expired(api, tmp_path) -> None:
    """The cache follows the API across a compacted history: the re-watch from the old
    resourceVersion gets 410 Expired, the runtime lists again and keeps watching."""
    rt = KubernetesRuntime(config_for(api, tmp_path))
    try:
        handle = await rt.start(spec())
        name = handle.pod.split("/")[1]
        await eventually(rt.synced.is_set)
        await eventually(lambda: name in rt.pods)
        watches = sum(r.verb == "watch" for r in api.requests)
        lists = sum(r.verb == "list" for r in api.requests)
        api.drop_watches()
        api.schedule(name, namespace=NAMESPACE)  # written while the watch is down...
        api.compact()  # ...and compacted away before it comes back
        api.run(name, ready=True, ip="10.9.9.9", namespace=NAMESPACE)
        await eventually(
            lambda: rt.pods[name]["status"].get("podIP") == "10.9.9.9", what="cache after relist"
        )
        assert sum(r.verb == "list" for r in api.requests) > lists
        assert sum(r.verb == "watch" for r in api.requests) > watches
        api.terminate(name, 1, namespace=NAMESPACE)  # and the new watch streams again
        await eventually(lambda: rt.pods[name]["status"]["phase"] == "Failed", what="watch after relist")
    finally:
        await rt.close()


async def test_pod_stuck_before_start_fails_after_the_startup_timeout(api, tmp_path) -> None:
    rt = KubernetesRuntime(config_for(api, tmp_path))
    try:
        handle = await rt.start(spec())
        api.schedule(handle.pod.split("/")[1], namespace=NAMESPACE)  # e.g. a volume never attaches
        assert (await rt.poll(handle)).state == ReplicaState.starting
        handle.started_at -= 900 + 61
        probe = await rt.poll(handle)
        assert probe.state == ReplicaState.failed and "not ready after 960 s" in probe.error
        await eventually(lambda: not api.pods(NAMESPACE), what="stuck pod deleted")
    finally:
        await rt.close()


async def test_agent_stop_leaves_pods_serving_and_the_next_agent_adopts(api, tmp_path, nats_server) -> None:
    """SIGTERM to the agent (its pod rescheduled or upgraded) does not drain replica pods;
    a new agent with an empty state_dir adopts them and starts nothing new."""
    import asyncio

    from fleet_base.local_state import LocalState

    async def run_agent(state_dir: str) -> tuple[Agent, asyncio.Event, asyncio.Task]:
        config = config_for(api, tmp_path).model_copy(
            update={"nats_url": nats_server.url, "state_dir": tmp_path / state_dir}
        )
        LocalState(config.state_dir).save_desired(
            DesiredState(cluster=config.cluster, generation=1, replicas=[spec()])
        )
        agent = Agent(config, reconcile_interval_s=0.05)
        stop = asyncio.Event()
        return agent, stop, asyncio.create_task(agent.run(stop))

    first, stop, task = await run_agent("one")
    (pod,) = await eventually(lambda: api.pods(NAMESPACE), what="pod created")
    name = pod["metadata"]["name"]
    run_ready(api, name)
    await eventually(lambda: first.replicas["chat-v1-abc123"].state == ReplicaState.ready, what="ready")
    stop.set()
    await asyncio.wait_for(task, 30)
    assert [p["metadata"]["name"] for p in api.pods(NAMESPACE)] == [name]
    assert not api.pod(name, NAMESPACE)["metadata"].get("deletionTimestamp")

    second, stop, task = await run_agent("two")
    try:
        await eventually(
            lambda: (
                "chat-v1-abc123" in second.replicas
                and second.replicas["chat-v1-abc123"].state == ReplicaState.ready
            ),
            what="adopted and ready",
        )
        assert [p["metadata"]["name"] for p in api.pods(NAMESPACE)] == [name]
        assert second.replicas["chat-v1-abc123"].restarts == 0
        validate_created(api)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
