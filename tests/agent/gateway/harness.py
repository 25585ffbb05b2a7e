"""Test harness for the gateway: play the agent's part (write the cluster's state files)
and run gateways as real subprocesses on free ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agent.gateway.state import file_signature
from fleet_base.api_keys import ApiKeyRecord, hash_secret, new_secret
from fleet_base.cluster_config import ClusterConfig, GatewayConfig
from fleet_base.domain import Coordinates
from fleet_base.local_state import KeySet, LocalState, ReplicaSnapshot, RouteSet
from fleet_base.ports import free_port
from fleet_base.processes import stop_process
from fleet_base.protocol import ClusterRoute, ReplicaState, ReplicaStatus, RoutingTable, VersionWeight
from fleet_base.security.tls import Credentials
from tests.polling import wait_for, wait_for_process

ROOT = Path(__file__).resolve().parents[3]
DEPLOYMENT = "tiny"


def make_key(
    key_id: str,
    *,
    deployments: list[str] | None = None,
    scopes: list[str] | None = None,
    revoked: bool = False,
) -> tuple[str, ApiKeyRecord]:
    """(secret, record) as the control plane would issue them."""
    _, secret = new_secret(key_id)
    salt, digest = hash_secret(secret)
    record = ApiKeyRecord(
        key_id=key_id,
        name=key_id,
        salt=salt,
        hash=digest,
        scopes=scopes if scopes is not None else ["inference"],
        deployments=deployments,
        revoked=revoked,
    )
    return secret, record


def replica(
    replica_id: str,
    url: str,
    *,
    deployment: str = DEPLOYMENT,
    version: int = 1,
    state: ReplicaState = ReplicaState.ready,
) -> ReplicaStatus:
    return ReplicaStatus(replica_id=replica_id, deployment=deployment, version=version, state=state, url=url)


def route(
    deployment: str, clusters: list[ClusterRoute], versions: list[VersionWeight] | None = None
) -> RoutingTable:
    return RoutingTable(deployment=deployment, clusters=clusters, versions=versions or [])


def peer(
    cluster: str, url: str, lat: float, lon: float, *, healthy: bool = True, replicas: int = 1
) -> ClusterRoute:
    return ClusterRoute(
        cluster=cluster,
        region=cluster,
        gateway_url=url,
        coordinates=Coordinates(lat=lat, lon=lon),
        replicas=replicas,
        healthy=healthy,
    )


def start_sim(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A simulated replica (`agent.sim.server`) of DEPLOYMENT on a free port, ready at once
    (`args`: more of its flags); the caller waits for /health and kills its group."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.sim.server",
            "--port",
            str(port),
            "--served-model-name",
            DEPLOYMENT,
            "--cold-start",
            "0",
            *args,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"


class ClusterFiles:
    """The agent's side of a cluster's state_dir."""

    def __init__(self, state_dir: Path, cluster: str) -> None:
        self.local = LocalState(state_dir)
        self.cluster = cluster

    def write(
        self,
        *,
        replicas: list[ReplicaStatus] | None = None,
        keys: list[ApiKeyRecord] | None = None,
        routes: list[RoutingTable] | None = None,
    ) -> None:
        if replicas is not None:
            self.local.save_replicas(ReplicaSnapshot(cluster=self.cluster, replicas=replicas))
        if keys is not None:
            self.local.save_keys(KeySet(keys={k.key_id: k for k in keys}))
        if routes is not None:
            self.local.save_routes(RouteSet(routes={r.deployment: r for r in routes}))

    def signatures(self) -> dict[str, str]:
        paths = {
            "replicas": self.local.replicas_path,
            "keys": self.local.keys_path,
            "routes": self.local.routes_path,
        }
        return {name: ":".join(map(str, file_signature(path))) for name, path in paths.items()}


class GatewayProcess:
    """`python -m agent.gateway --config <dir>/cluster.yaml` on a free port."""

    def __init__(
        self,
        workdir: Path,
        cluster: str,
        *,
        nats_url: str,
        lat: float = 0.0,
        lon: float = 0.0,
        queue_size: int = 8,
        queue_timeout_s: float = 2.0,
        max_body_bytes: int = 64 * 1024,
        security: Credentials | None = None,
        root: Path = ROOT,
        **gateway: object,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.root = root  # the checkout whose code runs (a benchmark's "before" is another one)
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = ClusterConfig(
            cluster=cluster,
            region=cluster,
            coordinates=Coordinates(lat=lat, lon=lon),
            nats_url=nats_url,
            state_dir=workdir / "state",
            security=security or Credentials(),
            gateway=GatewayConfig(
                host="127.0.0.1",
                port=self.port,
                queue_size=queue_size,
                queue_timeout_s=queue_timeout_s,
                max_body_bytes=max_body_bytes,
                key_state_max_age_s=3600,  # no agent renews the key set's lease here
                **gateway,
            ),
        )
        self.files = ClusterFiles(self.config.state_dir, cluster)
        self.log_path = workdir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        config_path = self.workdir / "cluster.yaml"
        self.config.dump(config_path)
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agent.gateway",
                    "--config",
                    str(config_path),
                    "--log-level",
                    "warning",
                ],
                cwd=self.root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            wait_for_process(
                self.proc,
                self._healthy,
                timeout,
                "the gateway",
                self.log_tail,
                retry_errors=httpx.TransportError,
            )
        except RuntimeError:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200

    def log_tail(self) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def sync(self, timeout: float = 30.0) -> None:
        """Wait until the gateway has loaded the state files as they are on disk now."""
        want = self.files.signatures()
        wait_for(
            lambda: httpx.get(f"{self.url}/health", timeout=2.0).json()["state"] == want,
            timeout,
            f"the gateway to load the state files {want}",
            0.02,
        )

    def write(self, **kw: object) -> None:
        self.files.write(**kw)  # type: ignore[arg-type]
        self.sync()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout, group=True)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    r = httpx.get(f"{url}/metrics", timeout=5.0)
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def sse_events(lines: list[str]) -> list[dict | str]:
    """The data payloads of an SSE body: parsed JSON, or '[DONE]'."""
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
