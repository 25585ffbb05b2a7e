"""deploy/kubernetes: every overlay rendered with `kubectl kustomize` validates strictly
against the official 1.30 schemas, holds the security properties we promise, and the
agent's Role grants exactly the API calls agent/runtime/kubernetes.py makes (read from its
source, and seen by the fake API server while the runtime runs)."""

from __future__ import annotations

import ast
import base64
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from agent.runtime import kubernetes as kube_runtime
from agent.runtime.kube_pod import replica_pod, selector_labels
from agent.runtime.kubernetes import KubernetesRuntime
from fleet_base.cluster_config import ClusterConfig
from fleet_base.kube_config import KubernetesConfig
from fleet_base.protocol import ReplicaSpec, Resources
from tests.agent.kube.conftest import NAMESPACE, config_for, fake_cluster, spec, start_running, validate
from tests.agent.kube.fake_apiserver import Rbac
from tests.polling import eventually

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("local", "gke", "eks")


def kubectl() -> str:
    found = shutil.which("kubectl") or str(ROOT / ".venv" / "bin" / "kubectl")
    assert os.access(found, os.X_OK), "kubectl not found: run scripts/install-kubectl.sh"
    return found


def render(overlay: str) -> list[dict]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: render(o) for o in OVERLAYS}


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(docs: list[dict]) -> list[dict]:
    return [d["spec"]["template"]["spec"] for d in by_kind(docs, "Deployment")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(rendered, overlay) -> None:
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "Deployment", "Service", "Role", "RoleBinding", "NetworkPolicy"} <= kinds
    assert {"PodDisruptionBudget", "ServiceAccount", "ConfigMap"} <= kinds
    for doc in docs:
        validate(doc)
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert all(d["metadata"].get("namespace") == "fleet" for d in docs if d["kind"] not in cluster_scoped)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_hardened(rendered, overlay) -> None:
    (ns,) = by_kind(rendered[overlay], "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for spec_ in pod_templates(rendered[overlay]):
        assert spec_["securityContext"]["runAsNonRoot"] is True
        for c in spec_.get("initContainers", []) + spec_["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "memory" in c["resources"]["limits"]
            assert ":" in c["image"] and not c["image"].endswith(":latest")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_control_plane_migrates_first_from_secret_url(rendered, overlay) -> None:
    (cp,) = [
        d for d in by_kind(rendered[overlay], "Deployment") if d["metadata"]["name"] == "fleet-control-plane"
    ]
    pod = cp["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["fleetctl", "db", "upgrade"]
    for c in (init, pod["containers"][0]):
        env = {e["name"]: e for e in c["env"]}
        ref = env["FLEET_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert ref["name"].startswith("fleet-database") and ref["key"] == "url"
    secrets = [s["metadata"]["name"] for s in by_kind(rendered[overlay], "Secret")]
    assert (ref["name"] in secrets) == (overlay == "local")  # real clusters bring their own


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_control_plane_is_highly_available(rendered, overlay) -> None:
    """Two instances on PostgreSQL, surged one at a time, a budget that keeps one serving, and
    probes any healthy instance passes (a follower is as ready as the leader)."""
    docs = rendered[overlay]
    (cp,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "fleet-control-plane"]
    spec_ = cp["spec"]
    assert spec_["replicas"] == 2
    assert spec_["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    (container,) = spec_["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    (budget,) = [
        p for p in by_kind(docs, "PodDisruptionBudget") if p["metadata"]["name"] == "fleet-control-plane"
    ]
    assert budget["spec"]["minAvailable"] == 1 and "maxUnavailable" not in budget["spec"]
    assert budget["spec"]["selector"]["matchLabels"] == spec_["selector"]["matchLabels"]
    env = {e["name"]: e for e in container["env"]}
    assert "secretKeyRef" in env["FLEET_DATABASE_URL"]["valueFrom"]  # one shared database, never SQLite
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    names = [e["name"] for e in container["env"]]  # $(POD_IP) expands only after its definition
    assert env["FLEET_ADVERTISE_URL"]["value"] == "http://$(POD_IP):7070"
    assert names.index("POD_IP") < names.index("FLEET_ADVERTISE_URL")
    secrets = {
        s["metadata"]["name"]: s
        for s in by_kind(docs, "Secret")
        if s["metadata"]["name"].startswith("fleet-database")
    }
    for secret in secrets.values():
        url = base64.b64decode(secret["data"]["url"]).decode()
        assert url.startswith("postgresql"), url


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_and_budgets(rendered, overlay) -> None:
    docs = rendered[overlay]
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    replicas = policies["fleet-replicas"]
    assert replicas["policyTypes"] == ["Ingress", "Egress"]
    assert [p["port"] for e in replicas["egress"] for p in e["ports"]] == [53, 53]
    # the KV-event and replay ports of vLLM and SGLang replicas: the agent's pods alone
    kc = KubernetesConfig()
    (kv_rule,) = [r for r in replicas["ingress"] if kc.kv_events_port in [p["port"] for p in r["ports"]]]
    assert [p["port"] for p in kv_rule["ports"]] == [kc.kv_events_port, kc.kv_replay_port]
    assert kv_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "agent"}}}]
    budgets = {p["metadata"]["name"] for p in by_kind(docs, "PodDisruptionBudget")}
    assert budgets == {"fleet-control-plane", "fleet-agent", "fleet-replicas"}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) applied to `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("engine", ["fleet", "vllm", "sglang", "llama.cpp"])
def test_a_foreign_engines_serving_port_admits_the_agent_pod_alone(rendered, overlay, engine) -> None:
    """vLLM's API key guards /v1/* only (/tokenize, /pooling, /score, /invocations are
    open): every policy that selects a foreign engine's pod admits its serving port from
    the agent's pod (agent and gateway) and nothing else; our engine's is scraped too."""
    docs = rendered[overlay]
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("fleet-agent-config")]
    config = ClusterConfig.model_validate(yaml.safe_load(cm["data"]["cluster.yaml"]))
    pool = config.pools[0]
    spec = ReplicaSpec(
        replica_id="chat-v1-abc123",
        deployment="chat",
        version=1,
        model="/models/qwen",
        engine=engine,
        resources=Resources(gpu_count=1),
        pool=pool.name,
    )
    labels = replica_pod(spec, config, pool)["metadata"]["labels"]
    serving = config.kubernetes.port
    sources = [
        source
        for p in by_kind(docs, "NetworkPolicy")
        if selects(p["spec"]["podSelector"], labels)
        for rule in p["spec"].get("ingress", [])
        if serving in [port["port"] for port in rule.get("ports", [])]
        for source in rule["from"]
    ]
    agent = {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "agent"}}}
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert agent in sources
    assert all(s in (agent, monitoring) for s in sources)
    assert (monitoring in sources) == (engine == "fleet")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_agent_config_and_the_pods_it_would_create(rendered, overlay) -> None:
    """The overlay's cluster.yaml is a valid agent config, and the replica pod of every one
    of its pools validates strictly (GPU requests, node pool selection, model volume)."""
    docs = rendered[overlay]
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("fleet-agent-config")]
    config = ClusterConfig.model_validate(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert config.runtime == "kubernetes" and config.kubernetes.owner_deployment == "fleet-agent"
    agent = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "fleet-agent")
    mounted = {v["name"]: v for v in agent["spec"]["template"]["spec"]["volumes"]}
    assert mounted["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert mounted["credentials"]["secret"]["secretName"] == "fleet-agent-credentials"
    # only the agent container holds the Kubernetes API token; the gateway has none
    pod = agent["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    token_mounts = {
        c["name"]: any(m["name"] == "kube-api-access" for m in c["volumeMounts"]) for c in pod["containers"]
    }
    assert token_mounts == {"agent": True, "gateway": False}
    assert mounted["kube-api-access"]["projected"]["sources"][0]["serviceAccountToken"]["path"] == "token"
    assert config.pools
    for pool in config.pools:
        s = ReplicaSpec(
            replica_id="chat-v1-abc123",
            deployment="chat",
            version=1,
            model="smollm2-135m",
            resources=Resources(gpu_count=2 if pool.gpus_per_node >= 2 else 1),
            pool=pool.name,
        )
        pod = replica_pod(
            s,
            config,
            pool,
            owner={"apiVersion": "apps/v1", "kind": "Deployment", "name": "fleet-agent", "uid": "0"},
        )
        validate(pod)
        requests = pod["spec"]["containers"][0]["resources"]["requests"]
        assert ("nvidia.com/gpu" in requests) == (pool.gpu_model != "cpu")
        if config.kubernetes.pools.get(pool.name) and config.kubernetes.pools[pool.name].node_pool:
            assert config.kubernetes.pools[pool.name].node_pool in pod["spec"]["nodeSelector"].values()
        if pool.tier.value == "spot" and config.kubernetes.node_provider == "eks":
            assert pod["spec"]["nodeSelector"]["eks.amazonaws.com/capacityType"] == "SPOT"
        if pool.tier.value == "spot" and config.kubernetes.node_provider == "gke":
            assert pod["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replica_service_gives_replica_pods_their_tls_name(rendered, overlay) -> None:
    """The headless Service a secure replica pod names as its subdomain exists and selects
    exactly the agent's replica pods (their DNS names are what the gateway verifies)."""
    docs = rendered[overlay]
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("fleet-agent-config")]
    config = ClusterConfig.model_validate(yaml.safe_load(cm["data"]["cluster.yaml"]))
    (svc,) = [
        d for d in by_kind(docs, "Service") if d["metadata"]["name"] == config.kubernetes.replica_service
    ]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    pod_labels = selector_labels(config.cluster)
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [config.kubernetes.port]


# ----------------------------------------------------------------------- RBAC


def role_grants(docs: list[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the agent's ServiceAccount is granted: its Role in the
    namespace and the ClusterRole(s) bound to it (nodes are cluster-scoped)."""
    rbac = Rbac.from_docs(docs, NAMESPACE)
    return {
        (group, resource, verb)
        for rule in rbac.role_rules + rbac.cluster_rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def calls_in_source() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every `self.client.<method>(...)` in the runtime."""
    tree = ast.parse(Path(kube_runtime.__file__).read_text())
    resources = {"Pod": kube_runtime.Pod, "Deployment": kube_runtime.Deployment, "Node": kube_runtime.Node}
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        target = node.func.value
        if not (isinstance(target, ast.Attribute) and target.attr == "client"):
            continue
        method = node.func.attr
        if method == "close":
            continue
        if method == "log":
            found.add(("", "pods/log", "get"))
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Call) and getattr(arg.func, "id", "") == "from_dict":
            kind = "Pod"  # the runtime creates only replica_pod's objects (checked below)
        else:
            assert isinstance(arg, ast.Name), ast.dump(arg)
            kind = arg.id
        info = resources[kind]._api_info
        found.add((info.resource.group, info.plural, method))
    return found


def test_role_allows_exactly_what_the_code_calls(rendered) -> None:
    assert replica_pod(spec(), ClusterConfig(cluster="x"), None)["kind"] == "Pod"
    code = calls_in_source()
    assert code == {
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods/log", "get"),
        ("apps", "deployments", "get"),
        ("", "nodes", "get"),
        ("", "nodes", "patch"),
    }
    for overlay in OVERLAYS:
        assert role_grants(rendered[overlay]) == code, overlay
    (role,) = [r for r in by_kind(rendered["gke"], "Role") if r["metadata"]["name"] == "fleet-agent"]
    dep_rule = next(r for r in role["rules"] if "deployments" in r["resources"])
    assert dep_rule["resourceNames"] == ["fleet-agent"]
    # cluster-wide: nodes get / patch, nothing else (no list, watch, delete; no pods)
    (cluster_role,) = by_kind(rendered["gke"], "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    (binding,) = by_kind(rendered["gke"], "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleet-agent", "namespace": NAMESPACE}]


async def test_role_covers_every_request_the_runtime_makes(tmp_path, rendered) -> None:
    async with fake_cluster() as api:
        api.rbac = Rbac.from_docs(rendered["gke"], NAMESPACE)  # a call not granted is a 403
        await _exercise_runtime(api, tmp_path)
    seen = {(r.group, r.resource, r.verb) for r in api.requests}
    grants = role_grants(rendered["gke"])
    assert seen == grants, (seen - grants, grants - seen)  # all used, none missing
    assert all(api.rbac.allows(r) for r in api.requests)


async def _exercise_runtime(api, tmp_path) -> None:
    """Every runtime method once: start, adopt, discover, poll a failure, node health, kill."""
    rt = KubernetesRuntime(config_for(api, tmp_path))
    try:
        api.add_node("node-1")
        handle, name = await start_running(api, rt, spec())
        await eventually(lambda: name in rt.pods)
        assert await rt.adopt(handle)
        assert await rt.discover()
        other = await rt.start(spec("chat-v1-bbb222", pool="h100"))
        api.schedule(other.pod.split("/")[1], namespace=NAMESPACE)
        api.terminate(other.pod.split("/")[1], 1, namespace=NAMESPACE, log="boom")

        async def failed():
            return (await rt.poll(other)).state.value == "failed"

        await eventually(failed)
        assert await rt.replica_node(handle.replica_id) == "node-1"
        await rt.cordon_node("node-1", "xid 79")
        await rt.uncordon_node("node-1")
        assert await rt.recycle_node("node-1") == [handle.replica_id]
        await rt.kill(handle)
    finally:
        await rt.close()
