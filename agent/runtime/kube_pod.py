"""The pod of one replica, as a plain Kubernetes object (dict): pure, so tests validate it
against the official schemas and the runtime only sends it.

- identity: labels `fleet.dev/{cluster,deployment,version,replica,pool,tier,engine}` plus the
  `app.kubernetes.io/*` set; the full ReplicaSpec in the `fleet.dev/spec` annotation, so
  an agent that lost its disk adopts the pod from a label list alone;
- placement: `nvidia.com/gpu` (or the pool's resource) requests = limits, node selector
  and tolerations from the pool (`node_placement`);
- lifecycle: restartPolicy Never (restarts and their backoff are the agent's, one policy
  for every runtime), startup probe sized to the startup timeout, readiness and liveness
  on /health, a preStop pause so endpoints and gateways stop sending before SIGTERM
  starts the engine's own drain, termination grace = pause + drain timeout + margin;
- hardening: non-root, read-only root filesystem, no privilege escalation, all
  capabilities dropped, RuntimeDefault seccomp, no service-account token;
- identity (with `security`, as for a process replica): the engine serves HTTPS with the
  replica certificate and requires the replica token, both from `kubernetes.replica_secret`
  (certificate and key as a secret volume holding only those two files, the token by
  secretKeyRef: the pod object holds no secret value); probes use HTTPS; the pod is named
  `<hostname>.<replica_service>.<namespace>.svc`, the name gateways verify the certificate
  against (`replica_url`). Binding every address of the pod is then safe: nothing is
  served without TLS, and nothing but /health and /metrics without the token;
- a foreign engine (vLLM, SGLang, llama.cpp): its image, command, GPUs, /dev/shm, KV-event
  port and health path from kube_engine, with the same identity, hardening and lifecycle.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets

from agent.runtime.base import InvalidSpec, startup_timeout_s
from agent.runtime.command import replica_argv
from agent.runtime.kube_engine import engine_container, is_foreign
from agent.security.replica_auth import SECRET_CERT, SECRET_KEY, replica_pod_env
from fleet_base.cluster_config import ClusterConfig
from fleet_base.domain import Tier
from fleet_base.engines import TlsFiles
from fleet_base.kube_config import PoolPlacement
from fleet_base.protocol import PoolInventory, ReplicaSpec

LABEL = "fleet.dev"
SPEC_ANNOTATION = f"{LABEL}/spec"
CONTAINER = "engine"
PRESTOP_PAUSE_S = 5
KILL_MARGIN_S = 5
PROBE_PERIOD_S = 10
UID = 10001
CREDENTIALS_DIR = "/etc/fleet/credentials"

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# GKE's accelerator label values for the GPU models Fleet pools name.
GKE_ACCELERATORS = {
    "h200": "nvidia-h200-141gb",
    "h100": "nvidia-h100-80gb",
    "h100-mega": "nvidia-h100-mega-80gb",
    "a100": "nvidia-tesla-a100",
    "a100-80gb": "nvidia-a100-80gb",
    "l4": "nvidia-l4",
    "t4": "nvidia-tesla-t4",
    "v100": "nvidia-tesla-v100",
}
NODE_POOL_LABELS = {
    "gke": "cloud.google.com/gke-nodepool",
    "eks": "eks.amazonaws.com/nodegroup",
    "aks": "kubernetes.azure.com/agentpool",
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def label_value(what: str, value: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise InvalidSpec(
            f"{what} {value!r} cannot be a Kubernetes label value (63 characters, [A-Za-z0-9-_.])"
        )
    return value


def pool_label(pool: str) -> str:
    """A pool name as a label value (pool names are free text in cluster.yaml)."""
    text = re.sub(r"[^A-Za-z0-9_.-]+", "-", pool)[:63].strip("-_.")
    return text


def pod_name(replica_id: str) -> str:
    """`fleet-<replica id>-<4 hex>`: a new name per start, so a restart never waits for the
    failed pod's name to be free; the replica id label is the identity."""
    name = f"fleet-{replica_id}"
    if not _DNS_NAME.match(name) or len(name) > 240:
        raise InvalidSpec(f"replica id {replica_id!r} must be lowercase [a-z0-9-] to name a pod")
    return f"{name}-{secrets.token_hex(2)}"


def selector_labels(cluster: str) -> dict[str, str]:
    """The labels every replica pod of this cluster's agent carries (list/watch selector)."""
    return {
        "app.kubernetes.io/name": "fleet",
        "app.kubernetes.io/component": "replica",
        "app.kubernetes.io/managed-by": "fleet-agent",
        f"{LABEL}/cluster": cluster,
    }


def _gpu_key(gpu_model: str, memory_gb: float) -> str:
    key = re.sub(r"[^a-z0-9]+", "-", gpu_model.lower().removeprefix("nvidia ")).strip("-")
    if key == "a100" and memory_gb >= 79:
        return "a100-80gb"
    return key


def node_placement(
    pool: PoolInventory | None, placement: PoolPlacement | None, provider: str
) -> tuple[dict[str, str], list[dict]]:
    """(nodeSelector, tolerations) of a pool: the provider's node-pool or GPU label, its
    spot / on-demand label and taint, then the pool's own selector and tolerations."""
    placement = placement or PoolPlacement()
    selector: dict[str, str] = {}
    tolerations: list[dict] = []
    gpu = pool is not None and pool.gpu_model.lower() != "cpu" and bool(placement.gpu_resource)
    if placement.node_pool and provider in NODE_POOL_LABELS:
        selector[NODE_POOL_LABELS[provider]] = placement.node_pool
    elif pool is not None and gpu and provider == "gke":
        accel = GKE_ACCELERATORS.get(_gpu_key(pool.gpu_model, pool.gpu_memory_gb))
        if accel:
            selector["cloud.google.com/gke-accelerator"] = accel
    spot = pool is not None and pool.tier == Tier.spot
    if provider == "gke" and pool is not None:
        if spot:
            selector["cloud.google.com/gke-spot"] = "true"
            tolerations.append(
                {
                    "key": "cloud.google.com/gke-spot",
                    "operator": "Equal",
                    "value": "true",
                    "effect": "NoSchedule",
                }
            )
    elif provider == "eks" and pool is not None:
        selector["eks.amazonaws.com/capacityType"] = "SPOT" if spot else "ON_DEMAND"
    elif provider == "aks" and pool is not None and spot:
        selector["kubernetes.azure.com/scalesetpriority"] = "spot"
        tolerations.append(
            {
                "key": "kubernetes.azure.com/scalesetpriority",
                "operator": "Equal",
                "value": "spot",
                "effect": "NoSchedule",
            }
        )
    if gpu:
        tolerations.append(dict(GPU_TOLERATION))
    selector.update(placement.node_selector)
    for t in placement.tolerations:
        item = {"key": t.key, "operator": t.operator}
        if t.operator == "Equal":
            item["value"] = t.value
        if t.effect:
            item["effect"] = t.effect
        if item not in tolerations:
            tolerations.append(item)
    return selector, tolerations


def pod_hostname(name: str) -> str:
    """The pod's hostname, a DNS label (63 characters at most): its name, or a prefix of it
    and a hash of the whole when longer."""
    if len(name) <= 63:
        return name
    return f"{name[:52].rstrip('-')}-{hashlib.sha256(name.encode()).hexdigest()[:10]}"


def secure(config: ClusterConfig) -> bool:
    """Replicas of this cluster serve HTTPS and require the replica token."""
    return config.security.enabled


def replica_url(pod: dict, pod_ip: str, config: ClusterConfig) -> str:
    """Where the agent and the gateway reach a replica pod: with `security`, its DNS name
    under the replica Service (which the replica certificate covers), else its IP."""
    port = config.kubernetes.port
    spec = pod.get("spec") or {}
    if secure(config):
        namespace = (pod.get("metadata") or {}).get("namespace") or config.kubernetes.namespace
        return f"https://{spec['hostname']}.{spec['subdomain']}.{namespace}.svc:{port}"
    return f"http://[{pod_ip}]:{port}" if ":" in pod_ip else f"http://{pod_ip}:{port}"


def serves_tls(pod: dict, config: ClusterConfig) -> bool:
    """A pod made for this config's security (a pod started before it was enabled is not)."""
    spec = pod.get("spec") or {}
    return not secure(config) or bool(spec.get("hostname") and spec.get("subdomain"))


def termination_grace_s(drain_timeout_s: float) -> int:
    return PRESTOP_PAUSE_S + math.ceil(drain_timeout_s) + KILL_MARGIN_S


def engine_command(spec: ReplicaSpec, config: ClusterConfig) -> list[str]:
    """The container's command line: the process runtime's, on the pod's port."""
    return replica_argv(spec, config, host="0.0.0.0", port=config.kubernetes.port, python="python")


def _volumes(config: ClusterConfig) -> tuple[list[dict], list[dict]]:
    kc = config.kubernetes
    volumes = [{"name": "scratch", "emptyDir": {"sizeLimit": kc.scratch_size}}]
    mounts = [{"name": "scratch", "mountPath": "/tmp"}]
    mv = kc.model_volume
    if mv.kind == "pvc":
        if not mv.claim_name:
            raise InvalidSpec("kubernetes.model_volume: kind pvc needs claim_name")
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": mv.claim_name, "readOnly": True}}
        )
    elif mv.kind == "host_path":
        volumes.append({"name": "models", "hostPath": {"path": mv.host_path, "type": "DirectoryOrCreate"}})
    if mv.kind != "none":
        mounts.append({"name": "models", "mountPath": mv.mount_path, "readOnly": True})
    if kc.replica_secret:
        source: dict = {"secretName": kc.replica_secret, "defaultMode": 0o440}
        if secure(config):  # only the replica's own files, never the rest of a shared bundle
            source["items"] = [{"key": name, "path": name} for name in (SECRET_CERT, SECRET_KEY)]
        volumes.append({"name": "credentials", "secret": source})
        mounts.append({"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True})
    return volumes, mounts


def _identity_env(config: ClusterConfig) -> list[dict]:
    """The replica's certificate, key and token (none without `security`)."""
    if not secure(config):
        return []
    if not config.kubernetes.replica_secret:
        raise InvalidSpec(
            "security is on: replicas need kubernetes.replica_secret (their certificate, key and token)"
        )
    return replica_pod_env(config.kubernetes.replica_secret, CREDENTIALS_DIR)


def replica_pod(
    spec: ReplicaSpec,
    config: ClusterConfig,
    pool: PoolInventory | None,
    owner: dict | None = None,
    name: str | None = None,
    model_path: str | None = None,
) -> dict:
    """The Pod object of one start of `spec`. Raises InvalidSpec for a spec that cannot
    become a pod (names, engine args). `model_path`: where a foreign engine finds the model
    in the pod (kube_engine.pod_model_path; default the spec's model as given)."""
    kc = config.kubernetes
    placement = kc.pools.get(spec.pool) if spec.pool else None
    tier = pool.tier.value if pool is not None else ""
    labels = {
        **selector_labels(config.cluster),
        f"{LABEL}/deployment": label_value("deployment", spec.deployment),
        f"{LABEL}/version": str(spec.version),
        f"{LABEL}/replica": label_value("replica id", spec.replica_id),
        f"{LABEL}/pool": pool_label(spec.pool),
        f"{LABEL}/tier": tier,
        f"{LABEL}/engine": spec.engine,  # the NetworkPolicy keeps foreign engines' ports to the agent
    }
    selector, tolerations = node_placement(pool, placement, kc.node_provider)
    gpu_resource = (placement or PoolPlacement()).gpu_resource
    requests = {"cpu": kc.cpu_request, "memory": kc.memory_request}
    limits = {"memory": kc.memory_limit}
    volumes, mounts = _volumes(config)
    identity = _identity_env(config)
    port_name = "https" if identity else "http"
    ports = [{"name": port_name, "containerPort": kc.port, "protocol": "TCP"}]
    image, gpus, health_path = kc.image, spec.resources.gpu_count, "/health"
    if is_foreign(spec):
        tls = None
        if identity:
            tls = TlsFiles(
                certfile=f"{CREDENTIALS_DIR}/{SECRET_CERT}", keyfile=f"{CREDENTIALS_DIR}/{SECRET_KEY}"
            )
        engine = engine_container(spec, config, model_path or spec.model, tls)
        image, gpus, health_path = engine.image, engine.gpus, engine.health_path
        command, env = engine.command, engine.env
        ports += engine.ports
        volumes += engine.volumes
        mounts += engine.mounts
    else:
        command = engine_command(spec, config)
        ours = {e["name"] for e in identity}
        env = [{"name": k, "value": v} for k, v in sorted(config.replica.env.items()) if k not in ours]
        env += identity
        env.append({"name": "HOME", "value": "/tmp"})
        if kc.model_volume.kind != "none" and "FLEET_MODEL_CACHE" not in config.replica.env:
            # a model URI resolves from the volume (the node cache layout, docs/models.md)
            env.append({"name": "FLEET_MODEL_CACHE", "value": kc.model_volume.mount_path})
    if pool is not None and pool.gpu_model.lower() != "cpu" and gpu_resource:
        requests[gpu_resource] = limits[gpu_resource] = str(gpus)
    # the health path is open on a replica (OPEN_PATHS, and the engines' own): a status and nothing else
    health = {"path": health_path, "port": port_name, "scheme": "HTTPS" if identity else "HTTP"}
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": kc.image_pull_policy,
        "command": command,
        "ports": ports,
        "env": env,
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": {
            "httpGet": health,
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(startup_timeout_s(spec, config) / PROBE_PERIOD_S)),
        },
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": health,
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_PAUSE_S)]}}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict = {
        "restartPolicy": "Never",
        "serviceAccountName": kc.service_account,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_s(config.replica.drain_timeout_s),
        "securityContext": {
            "runAsNonRoot": True,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if selector:
        pod_spec["nodeSelector"] = selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if kc.priority_class:
        pod_spec["priorityClassName"] = kc.priority_class
    if kc.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in kc.image_pull_secrets]
    name = name or pod_name(spec.replica_id)
    if identity:  # <hostname>.<replica_service>.<namespace>.svc: the name its certificate covers
        pod_spec["hostname"] = pod_hostname(name)
        pod_spec["subdomain"] = kc.replica_service
    metadata: dict = {
        "name": name,
        "namespace": kc.namespace,
        "labels": labels,
        "annotations": {SPEC_ANNOTATION: spec.model_dump_json()},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
