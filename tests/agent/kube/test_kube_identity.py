"""Kubernetes replicas get the process replicas' identity: with `security`, the pod serves
HTTPS with the replica certificate and requires the replica token, both from the replica
Secret (no secret value in the pod object), its probes use HTTPS, and gateways reach it
at a DNS name its certificate covers.

The attack test runs a replica the way a kubelet would run the generated pod (its command
with the simulated engine, its env resolved from the Secret, the secret volume's items as
files) and talks to it as a client in the cluster network and as the gateway."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agent.runtime.base import InvalidSpec
from agent.runtime.command import replica_argv
from agent.runtime.kube_pod import CREDENTIALS_DIR, pod_hostname, replica_pod, replica_url
from agent.runtime.kubernetes import KubernetesRuntime
from agent.security.replica_auth import replica_headers
from control_plane.security.pki import FleetPki
from fleet_base.cluster_config import ClusterConfig
from fleet_base.kube_config import KubernetesConfig
from fleet_base.ports import free_port
from fleet_base.processes import stop_process
from fleet_base.protocol import PoolInventory, ReplicaState
from fleet_base.security.tls import Credentials, replica_verify
from tests.agent.kube.conftest import NAMESPACE, config_for, spec, start_running, validate
from tests.agent.kube.fake_apiserver import FakeApiServer
from tests.polling import eventually

ROOT = Path(__file__).resolve().parents[3]
SECRET = "fleet-replica-credentials"
CPU = PoolInventory(name="cpu", gpu_model="cpu")
WILDCARD = f"*.fleet-replicas.{NAMESPACE}.svc"


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    """A cluster bundle whose replica certificate covers the replica Service's names only."""
    return FleetPki(tmp_path_factory.mktemp("pki")).cluster("gke-east", hosts=[WILDCARD])


def secure_config(creds: Credentials, port: int = 8000, **kube: object) -> ClusterConfig:
    return ClusterConfig(
        cluster="gke-east",
        security=creds,
        kubernetes=KubernetesConfig(namespace=NAMESPACE, port=port, replica_secret=SECRET, **kube),
    )


def test_secure_pod_has_identity_https_probes_and_no_secret_value(creds: Credentials) -> None:
    config = secure_config(creds)
    pod = replica_pod(spec(pool="cpu"), config, CPU)
    validate(pod)
    text = json.dumps(pod)
    for secret_file in (creds.replica_key, creds.replica_cert, creds.replica_token_file):
        assert secret_file is not None
        assert secret_file.read_text().strip() not in text
    assert str(creds.replica_key) not in text  # not even the agent's own paths
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["FLEET_ENGINE_API_KEY"] == {
        "name": "FLEET_ENGINE_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "replica-token"}},
    }
    assert env["FLEET_ENGINE_SSL_CERTFILE"]["value"] == f"{CREDENTIALS_DIR}/replica.pem"
    assert env["FLEET_ENGINE_SSL_KEYFILE"]["value"] == f"{CREDENTIALS_DIR}/replica.key"
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "credentials"]
    assert [i["key"] for i in vol["secret"]["items"]] == ["replica.pem", "replica.key"]  # not agent.key
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "https", "scheme": "HTTPS"}
    assert c["ports"] == [{"name": "https", "containerPort": 8000, "protocol": "TCP"}]
    # the process runtime's one command line, on every address of the pod
    assert c["command"] == replica_argv(spec(pool="cpu"), config, host="0.0.0.0", port=8000, python="python")
    assert pod["spec"]["subdomain"] == "fleet-replicas"
    assert pod["spec"]["hostname"] == pod["metadata"]["name"]
    url = replica_url(pod, "10.0.0.7", config)
    assert url == f"https://{pod['metadata']['name']}.fleet-replicas.{NAMESPACE}.svc:8000"


def test_a_long_pod_name_gets_a_valid_hostname() -> None:
    name = "fleet-" + "a" * 70 + "-beef"
    host = pod_hostname(name)
    assert len(host) <= 63 and host != pod_hostname(name.replace("beef", "cafe"))
    assert pod_hostname("fleet-short-beef") == "fleet-short-beef"


def test_security_without_a_replica_secret_is_refused(creds: Credentials, tmp_path: Path) -> None:
    config = secure_config(creds).model_copy(
        update={"kubernetes": KubernetesConfig(namespace=NAMESPACE), "pools": [CPU]}
    )
    with pytest.raises(InvalidSpec, match="replica_secret"):
        replica_pod(spec(pool="cpu"), config, CPU)
    with pytest.raises(ValueError, match="replica_secret"):
        KubernetesRuntime(config, client=object())  # type: ignore[arg-type]


async def test_runtime_hands_out_the_https_name_and_replaces_a_plaintext_pod(
    api: FakeApiServer, tmp_path: Path, creds: Credentials
) -> None:
    plain = config_for(api, tmp_path)
    rt = KubernetesRuntime(plain)
    old, old_name = await _start_ready(api, rt)
    assert old.url == "http://10.0.0.7:8000"
    await rt.close()

    secure = config_for(api, tmp_path, replica_secret=SECRET).model_copy(update={"security": creds})
    rt = KubernetesRuntime(secure)
    assert not await rt.adopt(old)  # served without TLS: replaced, not adopted
    handle, name = await _start_ready(api, rt)
    assert handle.url == f"https://{name}.fleet-replicas.{NAMESPACE}.svc:8000"
    created = api.pod(name, namespace=NAMESPACE)
    assert created["spec"]["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    deleted = api.pod(old_name, namespace=NAMESPACE)["metadata"].get("deletionTimestamp")
    assert deleted, "the plaintext pod is being deleted"
    await rt.close()


async def _start_ready(api: FakeApiServer, rt: KubernetesRuntime):
    handle, name = await start_running(api, rt, spec())
    await eventually(lambda: _ready(rt, handle), 10, "pod ready", 0.05)
    return handle, name


async def _ready(rt: KubernetesRuntime, handle) -> bool:
    return (await rt.poll(handle)).state == ReplicaState.ready and bool(handle.url)


def _run_as_kubelet(pod: dict, creds: Credentials, volume_dir: Path) -> subprocess.Popen[bytes]:
    """Run the pod's container as a kubelet would: the Secret is the enrolment bundle (its
    file names are its keys), the secret volume's items are files, env refs are resolved.
    The simulated replica takes the engine's command line and environment."""
    bundle = {p.name: p for p in (creds.replica_cert, creds.replica_key, creds.replica_token_file) if p}
    (c,) = pod["spec"]["containers"]
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "credentials"]
    volume_dir.mkdir()
    for item in vol["secret"]["items"]:
        (volume_dir / item["path"]).write_bytes(bundle[item["key"]].read_bytes())
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    for e in c["env"]:
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["name"] == SECRET
            env[e["name"]] = bundle[ref["key"]].read_text()  # with its newline, as a kubelet does
        else:
            env[e["name"]] = e["value"].replace(CREDENTIALS_DIR, str(volume_dir))
    argv = list(c["command"])
    assert argv[:3] == ["python", "-m", "engine.server"]
    argv[:3] = [sys.executable, "-m", "agent.sim.server"]
    log = open(volume_dir.parent / "replica.log", "wb")
    return subprocess.Popen(
        [*argv, "--cold-start", "0"],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


async def test_a_replica_pod_serves_only_tls_and_only_with_the_token(
    creds: Credentials, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    config = secure_config(creds, port=port)
    pod = replica_pod(spec(pool="cpu"), config, CPU)
    url = replica_url(pod, "127.0.0.1", config)
    host = url.split("//")[1].rsplit(":", 1)[0]
    real = socket.getaddrinfo

    def cluster_dns(name, *args, **kwargs):
        asked = name.decode() if isinstance(name, bytes) else name  # anyio passes IDNA bytes
        return real("127.0.0.1" if asked == host else name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", cluster_dns)
    proc = _run_as_kubelet(pod, creds, tmp_path / "credentials")
    gateway = httpx.AsyncClient(verify=replica_verify(creds), headers=replica_headers(creds), timeout=5)
    anyone = httpx.AsyncClient(verify=replica_verify(creds), timeout=5)
    try:

        async def healthy() -> bool:
            try:
                return (await anyone.get(f"{url}/health")).status_code == 200  # open: status only
            except httpx.TransportError:
                return False

        await eventually(healthy, 30, "the replica pod answers /health over verified TLS", 0.1)
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = await anyone.post(f"{url}/v1/chat/completions", json=body)
        assert refused.status_code == 401, refused.text  # a client in the cluster network
        served = await gateway.post(f"{url}/v1/chat/completions", json=body)
        assert served.status_code == 200, served.text  # the gateway: verified TLS and the token
        with pytest.raises(httpx.TransportError):  # no plaintext HTTP on the pod's port
            await anyone.get(f"http://127.0.0.1:{port}/health")
        with pytest.raises(httpx.ConnectError):  # the certificate names the Service, not any IP
            await anyone.get(f"https://127.0.0.1:{port}/health")
    finally:
        await gateway.aclose()
        await anyone.aclose()
        stop_process(proc, 10)
