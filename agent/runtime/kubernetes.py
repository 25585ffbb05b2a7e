"""Runtime `kubernetes`: each replica is one pod (see kube_pod) created through the
Kubernetes API with lightkube's async client.

Why one pod per replica rather than a Deployment per deployment-version: the agent's
reconciler already owns identity (replica ids from the control plane), surge (a new
version's ids come up before the old ones drain) and restart backoff; one pod per
replica id keeps all three exact (drain *this* replica, report *this* one preempted),
where a ReplicaSet would pick its own victims on scale-down.

- a list + watch of this cluster's replica pods (by labels) keeps a local cache, as an
  informer does: resourceVersion from the list, relist after a 410 or a broken stream;
  `poll` reads the cache (a GET until the first list is in);
- a replica whose `engine` is vLLM, SGLang or llama.cpp runs that engine's image and server
  (kube_engine), given the verified local path of its model in the model volume;
- the gateway reaches a replica once the pod has an IP (`handle.url`): with `security`
  over HTTPS at its DNS name under the replica Service, verifying the replica
  certificate and sending the replica token, as for a process replica; without it
  (tests only) over plain HTTP at the pod IP, which is logged as a warning;
- `stop` deletes with the pod's grace (preStop pause + drain timeout + margin) and waits
  until the pod is gone; for an engine that does not drain on SIGTERM (vLLM, SGLang,
  llama.cpp) it first waits, within the drain timeout, until the replica's /metrics shows
  nothing running or waiting (agent/runtime/drain.py); `kill` deletes with grace 0;
- a failed pod (restartPolicy Never) is deleted after its log tail is read; the
  reconciler restarts the replica under a new pod name after its backoff;
- `discover` lists pods by labels and rebuilds handles from the spec annotation, so an
  agent that lost runtime.json (an emptyDir in a new pod) still adopts its replicas;
- node health: a replica's node is its pod's `spec.nodeName`; `cordon_node` makes the
  Node unschedulable and taints it `fleet.dev/unhealthy=<kind>:NoSchedule`,
  `uncordon_node` undoes only that (see kube_node); `recycle_node` deletes Fleet's
  replica pods on the node, with their drain grace, and the agent restarts them where
  the scheduler now puts them: elsewhere.

API calls (deploy/kubernetes grants these and no more): in the agent's namespace pods
create / get / list / watch / delete, pods/log get, deployments get (the owner of
replica pods); cluster-wide (a ClusterRole: nodes are not namespaced) nodes get / patch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.codecs import from_dict
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ConfigError
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from agent.engine_kv_subscriber import release_kv_events_endpoint, subscribe_kv_events
from agent.runtime.base import Probe, ReplicaHandle, Runtime, startup_timeout_s
from agent.runtime.drain import wait_idle
from agent.runtime.kube_engine import kv_events_endpoints, pod_model_path
from agent.runtime.kube_node import cordon_patch, uncordon_patch
from agent.runtime.kube_pod import (
    LABEL,
    SPEC_ANNOTATION,
    replica_pod,
    replica_url,
    secure,
    selector_labels,
    serves_tls,
    termination_grace_s,
)
from agent.runtime.kube_status import PodView, classify, vanished
from agent.security.replica_auth import replica_headers
from fleet_base.cluster_config import ClusterConfig
from fleet_base.engines import CAPABILITIES, redact_text
from fleet_base.models import ModelCache
from fleet_base.protocol import PoolInventory, ReplicaSpec, ReplicaState
from fleet_base.security.tls import replica_verify

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 20
RELIST_BACKOFF_S = (0.2, 5.0)
GONE_WAIT_S = 10.0
MEMORY = 1000  # deleted pods remembered (their last object; whether we deleted them)
STARTUP_SLACK_S = 60.0  # image pull and scheduling on top of the engine's startup timeout
NODE_PATCH_ATTEMPTS = 5  # read-modify-write of a Node that others write too (409 Conflict)


def kube_config(config: ClusterConfig) -> KubeConfig:
    """`server` (no credentials: kubectl proxy, a test's API server), else `kubeconfig`,
    else the pod's service account, else $KUBECONFIG / ~/.kube/config. ValueError when
    none is usable."""
    kc = config.kubernetes
    if kc.server:
        return KubeConfig.from_one(cluster=Cluster(server=kc.server), user=User(), namespace=kc.namespace)
    try:
        return KubeConfig.from_file(kc.kubeconfig) if kc.kubeconfig else KubeConfig.from_env()
    except (ConfigError, OSError, KeyError, ValueError) as err:
        raise ValueError(
            f"runtime kubernetes: no usable Kubernetes API credentials ({err}); run in-cluster "
            "or set kubernetes.kubeconfig / kubernetes.server"
        ) from err


def _status_code(err: ApiError) -> int:
    return int(getattr(err.status, "code", 0) or 0)


class KubernetesRuntime(Runtime):
    name = "kubernetes"
    drain_on_exit = False  # an agent pod that moves or upgrades leaves its replicas serving

    def __init__(self, config: ClusterConfig, client: AsyncClient | None = None) -> None:
        if not config.pools:
            raise ValueError("runtime kubernetes: declare the cluster's pools in cluster.yaml (`pools:`)")
        if secure(config) and not config.kubernetes.replica_secret:
            raise ValueError(
                "runtime kubernetes: security is on, so replicas need kubernetes.replica_secret "
                "(a Secret with replica.pem, replica.key and replica-token from the enrolment bundle)"
            )
        if not secure(config):
            log.warning("no security: replica pods serve plain HTTP on their pod IP without a token")
        self.config = config
        self.kc = config.kubernetes
        self.namespace = self.kc.namespace
        self.client = client or AsyncClient(kube_config(config), namespace=self.namespace)
        self.labels = selector_labels(config.cluster)
        self.pools: dict[str, PoolInventory] = {p.name: p for p in config.pools}
        # the model volume as the agent sees it: where a foreign engine's model is found
        self.model_cache = ModelCache(config.model_cache_dir) if config.model_cache_dir else None
        self.pods: dict[str, dict] = {}  # name -> the latest pod object the watch saw
        self.gone: dict[str, dict] = {}  # name -> the last object of a pod that was deleted
        self.synced = asyncio.Event()
        self._changed = asyncio.Event()
        self._deleting: dict[str, str] = {}  # pods this runtime deleted (not "vanished"): why
        self._pending_since: dict[str, float] = {}
        self._owner: dict | None = None
        self._watch: asyncio.Task[None] | None = None
        self.http_transport: httpx.AsyncBaseTransport | None = None  # tests: a stand-in replica

    # ------------------------------------------------------------- the cache

    def _ensure_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._list_watch(), name="kube-pods")

    def _seen(self, kind: str, pod: dict) -> None:
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            self.pods.pop(name, None)
            self.gone[name] = pod
            for remembered in (self.gone, self._deleting):
                while len(remembered) > MEMORY:
                    remembered.pop(next(iter(remembered)))
        else:
            self.pods[name] = pod
        self._changed.set()

    async def _list_watch(self) -> None:
        delay = RELIST_BACKOFF_S[0]
        while True:
            try:
                listing = self.client.list(Pod, namespace=self.namespace, labels=self.labels)
                fresh = {p.metadata.name: p.to_dict() async for p in listing}
                for name in set(self.pods) - set(fresh):
                    self._seen("DELETED", self.pods[name])
                for pod in fresh.values():
                    self._seen("MODIFIED", pod)
                self.synced.set()
                version = listing.resourceVersion
                delay = RELIST_BACKOFF_S[0]
                async for kind, obj in self.client.watch(
                    Pod, namespace=self.namespace, labels=self.labels, resource_version=version
                ):
                    self._seen(kind, obj.to_dict())
            except asyncio.CancelledError:
                raise
            except Exception as err:  # 410 Expired, a dropped stream, an API outage: relist
                log.info("pod watch ended (%s); relisting in %.1f s", err, delay)
                await asyncio.sleep(delay)
                delay = min(RELIST_BACKOFF_S[1], delay * 2)

    async def _pod(self, name: str) -> dict | None:
        """The pod from the cache; a GET when the cache lacks it (the watch may lag behind
        our own create), so a miss is only believed from the API."""
        self._ensure_watch()
        if name in self.pods:
            return self.pods[name]
        try:
            return (await self.client.get(Pod, name, namespace=self.namespace)).to_dict()
        except ApiError as err:
            if _status_code(err) == 404:
                return None
            raise

    async def _wait_gone(self, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._pod(name) is None:
                return True
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(0.5, max(0.01, deadline - time.monotonic())))
        return False

    # ------------------------------------------------------------- start

    async def _owner_ref(self) -> dict | None:
        if not self.kc.owner_deployment:
            return None
        if self._owner is None:
            owner = await self.client.get(Deployment, self.kc.owner_deployment, namespace=self.namespace)
            self._owner = {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": owner.metadata.name,
                "uid": owner.metadata.uid,
            }
        return self._owner

    def pod_for(self, spec: ReplicaSpec, owner: dict | None = None) -> dict:
        """The pod object `start` would create (raises InvalidSpec)."""
        model_path = pod_model_path(spec, self.config, self.model_cache)
        return replica_pod(spec, self.config, self.pools.get(spec.pool), owner, model_path=model_path)

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        self.pod_for(spec)  # a bad spec fails before any API call
        self._ensure_watch()
        pod = self.pod_for(spec, await self._owner_ref())
        created = await self.client.create(from_dict(pod), namespace=self.namespace)
        name = created.metadata.name
        log.info("replica %s: pod %s/%s created", spec.replica_id, self.namespace, name)
        return ReplicaHandle(
            replica_id=spec.replica_id,
            spec=spec,
            url="",
            port=self.kc.port,
            pod=f"{self.namespace}/{name}",
            argv=pod["spec"]["containers"][0]["command"],
        )

    # ------------------------------------------------------------- poll

    @staticmethod
    def _name(handle: ReplicaHandle) -> str:
        return handle.pod.rsplit("/", 1)[-1]

    async def _log_tail(self, name: str) -> str:
        try:
            lines = [
                line
                async for line in self.client.log(name, namespace=self.namespace, tail_lines=LOG_TAIL_LINES)
            ]
        except Exception:
            return ""
        return redact_text("".join(lines).rstrip(), [self.config.security.replica_token])

    async def poll(self, handle: ReplicaHandle) -> Probe:
        name = self._name(handle)
        pod = await self._pod(name)
        if pod is None and name in self._deleting:
            view = PodView(ReplicaState.failed, self._deleting[name])
        elif pod is None:
            view = vanished(self.gone.get(name))
        else:
            view = classify(pod, self.kc.memory_limit)
        if view.pod_ip and not handle.url and pod is not None:
            handle.url = replica_url(pod, view.pod_ip, self.config)
            self._subscribe_kv_events(handle, view.pod_ip)
        if view.state == ReplicaState.starting and not view.unschedulable:
            # the startup probe bounds a running container; this bounds the rest (a volume
            # that never attaches, an image that never arrives)
            limit = startup_timeout_s(handle.spec, self.config) + STARTUP_SLACK_S
            if time.time() - handle.started_at > limit:
                view = PodView(ReplicaState.failed, f"not ready after {limit:.0f} s (pod {name})")
        if view.state == ReplicaState.failed:
            return await self._failed(handle, name, view, pod is not None)
        unschedulable = False
        if view.unschedulable:
            since = self._pending_since.setdefault(name, time.monotonic())
            unschedulable = time.monotonic() - since >= self.kc.unschedulable_after_s
        else:
            self._pending_since.pop(name, None)
        return Probe(state=view.state, error=view.error if unschedulable else "", unschedulable=unschedulable)

    async def _failed(self, handle: ReplicaHandle, name: str, view: PodView, exists: bool) -> Probe:
        error = view.error
        if exists:
            tail = await self._log_tail(name)
            if tail:
                error = f"{error}; log tail:\n{tail}"
            await self._delete(name, 0)
        self._pending_since.pop(name, None)
        return Probe(
            state=ReplicaState.failed, exit_code=view.exit_code, error=error, preempted=view.preempted
        )

    # ------------------------------------------------------------- stop

    async def _delete(self, name: str, grace: int | None, why: str = "pod deleted by the agent") -> None:
        self._deleting[name] = why
        try:
            await self.client.delete(Pod, name, namespace=self.namespace, grace_period=grace)
        except ApiError as err:
            if _status_code(err) != 404:
                raise

    def _exit_code(self, name: str) -> int | None:
        pod = self.pods.get(name) or self.gone.get(name) or {}
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (status.get("state") or {}).get("terminated") or {}
            if "exitCode" in term:
                return int(term["exitCode"])
        return None

    async def _wait_idle(self, handle: ReplicaHandle, timeout: float) -> None:
        """An engine that stops at once on SIGTERM: until its pod's /metrics shows it idle."""
        if not handle.url or CAPABILITIES[handle.spec.engine].drains_on_sigterm:
            return
        verify = replica_verify(self.config.security) if handle.url.startswith("https") else True
        async with httpx.AsyncClient(verify=verify, timeout=2.0, transport=self.http_transport) as http:
            if not await wait_idle(
                http, handle.url, handle.spec.engine, timeout, replica_headers(self.config.security)
            ):
                log.warning("replica %s: still busy after %.0f s; stopping it", handle.replica_id, timeout)

    async def stop(self, handle: ReplicaHandle, drain_timeout_s: float) -> int | None:
        release_kv_events_endpoint(handle.replica_id)
        name = self._name(handle)
        await self._wait_idle(handle, drain_timeout_s)  # then SIGTERM stops it at once
        grace = termination_grace_s(drain_timeout_s)
        self._ensure_watch()
        await self._delete(name, grace)
        if not await self._wait_gone(name, grace + GONE_WAIT_S):
            log.warning(
                "replica %s: pod %s still there after its grace; deleting now", handle.replica_id, name
            )
            await self.kill(handle)
        return self._exit_code(name)

    def _subscribe_kv_events(self, handle: ReplicaHandle, pod_ip: str) -> None:
        endpoints = kv_events_endpoints(handle.spec, pod_ip, self.config)
        if endpoints is not None:
            subscribe_kv_events(handle.replica_id, handle.spec.engine, *endpoints)

    async def kill(self, handle: ReplicaHandle) -> None:
        release_kv_events_endpoint(handle.replica_id)
        name = self._name(handle)
        self._ensure_watch()
        await self._delete(name, 0)
        await self._wait_gone(name, GONE_WAIT_S)

    # ------------------------------------------------------------- adopt

    async def adopt(self, handle: ReplicaHandle) -> bool:
        if not handle.pod:
            return False
        name = self._name(handle)
        pod = await self._pod(name)
        labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
        if pod is None or labels.get(f"{LABEL}/replica") != handle.replica_id:
            return False
        view = classify(pod, self.kc.memory_limit)
        if view.state in (ReplicaState.failed, ReplicaState.draining):
            await self._delete(name, 0)
            return False
        if not serves_tls(pod, self.config):  # started before security was on: replaced
            log.warning("replica %s: pod %s serves without TLS; replacing it", handle.replica_id, name)
            await self._delete(name, termination_grace_s(self.config.replica.drain_timeout_s))
            return False
        if view.pod_ip:
            handle.url = replica_url(pod, view.pod_ip, self.config)
            self._subscribe_kv_events(handle, view.pod_ip)
        log.info("adopted replica %s (pod %s)", handle.replica_id, handle.pod)
        return True

    async def discover(self) -> list[ReplicaHandle]:
        handles = []
        async for obj in self.client.list(Pod, namespace=self.namespace, labels=self.labels):
            pod = obj.to_dict()
            meta = pod["metadata"]
            try:
                spec = ReplicaSpec.model_validate_json((meta.get("annotations") or {})[SPEC_ANNOTATION])
            except (KeyError, ValueError):
                log.warning(
                    "pod %s has no readable %s annotation; leaving it alone", meta["name"], SPEC_ANNOTATION
                )
                continue
            if spec.replica_id != (meta.get("labels") or {}).get(f"{LABEL}/replica"):
                continue
            handles.append(
                ReplicaHandle(
                    replica_id=spec.replica_id,
                    spec=spec,
                    url="",
                    port=self.kc.port,
                    pod=f"{self.namespace}/{meta['name']}",
                    argv=pod["spec"]["containers"][0].get("command", []),
                )
            )
        return handles

    # ------------------------------------------------------------- node health

    async def replica_node(self, replica_id: str) -> str | None:
        """The node of the replica's live pod; None while it is unscheduled or unknown."""
        self._ensure_watch()
        pods: list[dict] = [
            p
            for p in self.pods.values()
            if ((p.get("metadata") or {}).get("labels") or {}).get(f"{LABEL}/replica") == replica_id
        ]
        if not pods and not self.synced.is_set():  # the cache is not in yet: ask
            labels = {**self.labels, f"{LABEL}/replica": replica_id}
            try:
                listing = self.client.list(Pod, namespace=self.namespace, labels=labels)
                pods = [p.to_dict() async for p in listing]
            except ApiError as err:  # e.g. an id that is no label value: no such pod
                log.info("replica %s: cannot look up its pod (%s)", replica_id, err)
        pods.sort(key=lambda p: bool(p["metadata"].get("deletionTimestamp")))  # live ones first
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node:
                return str(node)
        return None

    async def _patch_node(self, node: str, make_patch: Callable[[dict], dict | None]) -> bool:
        """Read the Node, patch it as `make_patch` says (None: nothing to do), again on a
        409 Conflict (another writer got in between). False when there is no such node."""
        for _ in range(NODE_PATCH_ATTEMPTS):
            try:
                current = (await self.client.get(Node, node)).to_dict()
            except ApiError as err:
                if _status_code(err) == 404:
                    log.warning("node %s: not found in the cluster; nothing to patch", node)
                    return False
                raise
            patch = make_patch(current)
            if patch is None:
                return True
            try:
                await self.client.patch(Node, node, patch, patch_type=PatchType.MERGE)
                return True
            except ApiError as err:
                if _status_code(err) != 409:
                    raise
        raise RuntimeError(f"node {node}: still conflicting after {NODE_PATCH_ATTEMPTS} attempts")

    async def cordon_node(self, node: str, reason: str) -> None:
        if await self._patch_node(node, lambda n: cordon_patch(n, reason)):
            log.warning("node %s: cordoned and tainted (%s)", node, reason)

    async def uncordon_node(self, node: str) -> None:
        if await self._patch_node(node, uncordon_patch):
            log.info("node %s: Fleet's cordon and taint removed", node)

    async def recycle_node(self, node: str) -> list[str]:
        """Delete this cluster's replica pods on `node` with their drain grace (the label
        selector keeps every other pod out); the agent then restarts each replica and the
        scheduler, which no longer places on the cordoned node, puts it elsewhere."""
        grace = termination_grace_s(self.config.replica.drain_timeout_s)
        recycled: list[str] = []
        listing = self.client.list(
            Pod, namespace=self.namespace, labels=self.labels, fields={"spec.nodeName": node}
        )
        async for obj in listing:
            meta = obj.to_dict()["metadata"]
            replica_id = (meta.get("labels") or {}).get(f"{LABEL}/replica")
            if not replica_id or meta.get("deletionTimestamp"):
                continue  # not a replica pod, or already going
            await self._delete(meta["name"], grace, f"pod recycled off node {node}")
            log.warning("replica %s: pod %s recycled off node %s", replica_id, meta["name"], node)
            recycled.append(replica_id)
        return recycled

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        await self.client.close()
