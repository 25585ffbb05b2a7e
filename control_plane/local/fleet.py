"""A whole Fleet on one machine, as processes: nats-server, the control plane, and one
agent plus one gateway per region; the agents start the engine replicas.

The process table lives in `$FLEET_HOME/local/fleet.json` so `fleetctl ps` and
`fleetctl down` work from any shell, also when the control plane is already dead. Every
process of a local fleet carries `FLEET_LOCAL_FLEET=<fleet id>` in its environment
(replicas inherit it from their agent): `down` sweeps for that marker at the end, so
nothing survives even when an agent was killed and left its replicas orphaned.

Slightly over ~400 lines: the process table, start order and the marker sweep are one
lifecycle that `fleetctl up/ps/down` share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import httpx
import psutil
from pydantic import BaseModel, Field, ValidationError

from control_plane.local.nats_server import NatsServer
from control_plane.local.prometheus_sd import TARGETS_FILE, prometheus_targets, write_targets
from control_plane.security.enroll import Enrolment
from control_plane.security.pki import ensure_webhook_master
from fleet_base.batch.webhook_signing import MASTER_ENV, MASTER_FILE
from fleet_base.cluster_config import ClusterConfig, GatewayConfig, ReplicaConfig
from fleet_base.domain import Coordinates
from fleet_base.local_state import LocalState, atomic_write
from fleet_base.ports import free_port
from fleet_base.security.tls import Credentials

ProcessKind = Literal["nats", "control-plane", "agent", "gateway", "replica"]
MARKER_ENV = "FLEET_LOCAL_FLEET"
ROOT = Path(__file__).resolve().parents[2]

# Rough coordinates so geo-aware policies have something real to work with.
KNOWN_REGIONS: dict[str, tuple[float, float]] = {
    "local-east": (39.0, -77.5),  # like us-east (N. Virginia)
    "local-west": (45.6, -121.2),  # like us-west (Oregon)
    "local-central": (41.3, -95.9),
    "local-eu": (50.1, 8.7),
    "local-asia": (35.7, 139.7),
}


class ProcessRecord(BaseModel):
    kind: ProcessKind
    name: str
    pid: int
    url: str = ""
    log: str = ""
    config: str = ""
    started_at: float = Field(default_factory=time.time)


class FleetState(BaseModel):
    fleet_id: str
    home: str
    # TLS and per-identity NATS permissions, HTTPS between gateways and to replicas.
    secure: bool = True
    nats_url: str = ""
    api_url: str = ""
    regions: list[str] = Field(default_factory=list)
    # region (cluster id) -> jurisdiction, recorded at enrolment (`fleetctl up --jurisdictions`)
    jurisdictions: dict[str, str] = Field(default_factory=dict)
    processes: list[ProcessRecord] = Field(default_factory=list)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def region_coordinates(region: str, index: int) -> Coordinates:
    lat, lon = KNOWN_REGIONS.get(region, (10.0 * index, 20.0 * index))
    return Coordinates(lat=lat, lon=lon)


class LocalFleet:
    def __init__(self, home: Path, *, secure: bool = True) -> None:
        self.home = Path(home).expanduser()
        self.dir = self.home / "local"
        self.state_path = self.dir / "fleet.json"
        self.secure = secure  # for new_state; a loaded state says for itself
        self._enrolment: Enrolment | None = None

    @property
    def enrolment(self) -> Enrolment:
        """The fleet CA and enrolled clusters under FLEET_HOME (created on first use)."""
        if self._enrolment is None:
            self._enrolment = Enrolment(self.home)
        return self._enrolment

    # ------------------------------------------------------------------ state file

    def load(self) -> FleetState | None:
        try:
            return FleetState.model_validate_json(self.state_path.read_bytes())
        except (FileNotFoundError, ValidationError, ValueError):
            return None

    def save(self, state: FleetState) -> None:
        atomic_write(self.state_path, state.model_dump_json(indent=1).encode())

    def running(self) -> FleetState | None:
        """The recorded fleet if any of its processes is still alive."""
        state = self.load()
        if state and any(pid_alive(p.pid) for p in state.processes):
            return state
        return None

    def new_state(self, regions: list[str], jurisdictions: dict[str, str] | None = None) -> FleetState:
        return FleetState(
            fleet_id=uuid.uuid4().hex[:12],
            home=str(self.home),
            regions=regions,
            secure=self.secure,
            jurisdictions=dict(jurisdictions or {}),
        )

    # ------------------------------------------------------------------ processes

    def env(self, state: FleetState) -> dict[str, str]:
        env = dict(os.environ)
        env["FLEET_HOME"] = str(self.home)
        env[MARKER_ENV] = state.fleet_id
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        # the webhook signing master for every process of the fleet, secured or not (a secured
        # cluster's bundle carries a copy of the same file)
        env.setdefault(MASTER_ENV, str(ensure_webhook_master(self.home / "pki" / MASTER_FILE)))
        return env

    def spawn(
        self,
        state: FleetState,
        kind: ProcessKind,
        name: str,
        argv: list[str],
        url: str = "",
        config: str = "",
        extra_env: dict[str, str] | None = None,
    ) -> ProcessRecord:
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{kind}-{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env(state), **(extra_env or {})},
                cwd=str(ROOT),
                start_new_session=True,
            )
        record = ProcessRecord(kind=kind, name=name, pid=proc.pid, url=url, log=str(log_path), config=config)
        state.processes.append(record)
        self.save(state)
        return record

    def start_nats(
        self, state: FleetState, port: int | None = None, profile_port: int | None = None
    ) -> ProcessRecord:
        port = port or _port_or_free(4222)
        config_file = None
        if state.secure:  # TLS required; one user per identity (control_plane.security)
            listen = self.enrolment.load().model_copy(
                update={"host": "127.0.0.1", "port": port, "store_dir": str(self.dir / "nats")}
            )
            listen.server_name = f"fleet-{state.fleet_id}"
            listen.clusters = sorted(set(listen.clusters) | set(state.regions))
            config_file = self.enrolment.write_nats_config(listen)
        server = NatsServer(
            self.dir / "nats",
            port=port,
            log_file=self.dir / "logs" / "nats-nats.log",
            config_file=config_file,
            profile_port=profile_port,
        )
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        record = self.spawn(state, "nats", "nats", server.command(), url=server.url)
        if state.secure:
            listen.pid = record.pid
            self.enrolment.save(listen)
        state.nats_url = server.url
        self.save(state)
        return record

    def control_plane_ports(self, count: int) -> list[int]:
        """Ports for `count` instances: 7070 first when free, then any free ones."""
        ports = [_port_or_free(7070)]
        while len(ports) < count:
            port = free_port()
            if port not in ports:
                ports.append(port)
        return ports

    def write_api_urls(self, urls: list[str]) -> None:
        """List every instance in the api file before any starts: each instance then finds
        itself there and leaves the list whole (`control_plane.server.record_api_url`)."""
        self.home.mkdir(parents=True, exist_ok=True)
        atomic_write(self.home / "api-url", "".join(f"{u}\n" for u in urls).encode())

    def start_control_plane(
        self,
        state: FleetState,
        port: int | None = None,
        name: str = "control-plane",
        extra_env: dict[str, str] | None = None,
    ) -> ProcessRecord:
        port = port or _port_or_free(7070)
        url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable,
            "-m",
            "control_plane",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--nats-url",
            state.nats_url,
        ]
        env = {**(self.enrolment.control_plane_env() if state.secure else {}), **(extra_env or {})}
        first = not self.control_planes(state)  # the API URL `up` prints and registers with
        record = self.spawn(state, "control-plane", name, argv, url=url, extra_env=env)
        if first:
            state.api_url = url
        self.save(state)
        return record

    def start_control_planes(
        self,
        state: FleetState,
        ports: list[int],
        wait_healthy: Callable[[list[ProcessRecord]], None],
        extra_env: dict[str, str] | None = None,
    ) -> list[ProcessRecord]:
        """One instance per port on the fleet's one database, every URL in the api file. The
        first starts alone (`wait_healthy` returns once it is): it migrates the database and
        writes the admin token the others then find and share; the rest start together."""
        self.write_api_urls([f"http://127.0.0.1:{p}" for p in ports])
        names = (
            ["control-plane"] if len(ports) == 1 else [f"control-plane-{i + 1}" for i in range(len(ports))]
        )
        first = self.start_control_plane(state, ports[0], names[0], extra_env)
        wait_healthy([first])
        rest = [
            self.start_control_plane(state, port, name, extra_env) for port, name in zip(ports[1:], names[1:])
        ]
        wait_healthy(rest)
        return [first, *rest]

    def control_planes(self, state: FleetState) -> list[ProcessRecord]:
        return [p for p in state.processes if p.kind == "control-plane"]

    def write_cluster_config(
        self,
        state: FleetState,
        region: str,
        index: int,
        slots: int,
        replica_args: list[str],
        runtime: str = "process",
    ) -> ClusterConfig:
        cluster_dir = self.dir / "clusters" / region
        security = self.enrolment.enroll(region) if state.secure else Credentials()
        config = ClusterConfig(
            cluster=region,
            provider="local",
            region=region,
            coordinates=region_coordinates(region, index),
            nats_url=state.nats_url,
            state_dir=cluster_dir / "state",
            cpu_slots=slots,
            gateway=GatewayConfig(
                port=_port_or_free(9000 + index + 1), peer_port=free_port() if state.secure else 0
            ),
            replica=ReplicaConfig(extra_args=replica_args),
            runtime=runtime,  # "sim": simulated replicas
            security=security,
        )
        cluster_dir.mkdir(parents=True, exist_ok=True)
        config.dump(cluster_dir / "cluster.yaml")
        return config

    def register_cluster(self, state: FleetState, config: ClusterConfig) -> None:
        """Record the cluster, its peer gateway URL and its jurisdiction with the control plane:
        the URL peers forward to and the jurisdiction residency is judged by come from this
        record (enrolment), never from a heartbeat's claim."""
        if not state.api_url:
            return
        token = (self.home / "admin-token").read_text().strip()
        url = config.gateway.peer_url or config.gateway.url
        body = {
            "id": config.cluster,
            "provider": config.provider,
            "region": config.region,
            "lat": config.coordinates.lat,
            "lon": config.coordinates.lon,
            "gateway_url": url,
            "jurisdiction": state.jurisdictions.get(config.cluster, ""),
        }
        with httpx.Client(
            base_url=state.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as api:
            response = api.post("/v1/clusters", json=body)
            if response.status_code == 409:
                update = {"gateway_url": url}
                if body["jurisdiction"]:
                    update["jurisdiction"] = body["jurisdiction"]
                response = api.patch(f"/v1/clusters/{config.cluster}", json=update)
            response.raise_for_status()

    def start_cluster(self, state: FleetState, config: ClusterConfig) -> tuple[ProcessRecord, ProcessRecord]:
        self.register_cluster(state, config)
        path = str(self.dir / "clusters" / config.cluster / "cluster.yaml")
        agent = self.spawn(
            state, "agent", config.cluster, [sys.executable, "-m", "agent", "--config", path], config=path
        )
        gateway = self.spawn(
            state,
            "gateway",
            config.cluster,
            [sys.executable, "-m", "agent.gateway", "--config", path],
            url=config.gateway.url,
            config=path,
        )
        return agent, gateway

    def replicas(self, state: FleetState) -> list[ProcessRecord]:
        """Replica processes the agents report (from their state files)."""
        out: list[ProcessRecord] = []
        for region in state.regions:
            snapshot = LocalState(self.dir / "clusters" / region / "state").load_replicas()
            for replica in snapshot.replicas if snapshot else []:
                if replica.pid:
                    out.append(
                        ProcessRecord(
                            kind="replica",
                            name=f"{region}/{replica.replica_id}",
                            pid=replica.pid,
                            url=replica.url,
                            log=str(
                                self.dir
                                / "clusters"
                                / region
                                / "state"
                                / "logs"
                                / f"{replica.replica_id}.log"
                            ),
                        )
                    )
        return out

    @property
    def targets_path(self) -> Path:
        return self.dir / TARGETS_FILE

    def write_prometheus_targets(self, state: FleetState) -> Path:
        """Rewrite `prometheus-targets.json` (Prometheus file_sd): control plane, gateways,
        and the replicas the agents report now. Called by `up` and `ps`."""
        gateways = {p.name: p.url for p in state.processes if p.kind == "gateway"}
        dirs = {region: self.dir / "clusters" / region / "state" for region in state.regions}
        api_urls = [p.url for p in self.control_planes(state)] or [state.api_url]
        return write_targets(self.targets_path, prometheus_targets(state.fleet_id, api_urls, gateways, dirs))

    def marked_processes(self, fleet_id: str) -> list[psutil.Process]:
        """Every live process carrying this fleet's marker (children included)."""
        found = []
        me = os.getpid()
        for proc in psutil.process_iter(["pid"]):
            if proc.pid == me:
                continue
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(MARKER_ENV) == fleet_id and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def ps(self) -> list[dict]:
        state = self.load()
        if state is None:
            return []
        with contextlib.suppress(OSError):  # monitoring only: never fail `ps` for it
            self.write_prometheus_targets(state)
        rows = []
        for record in [*state.processes, *self.replicas(state)]:
            rows.append({**record.model_dump(), "alive": pid_alive(record.pid)})
        return rows

    def down(self, timeout: float = 30.0) -> list[StopReport]:
        """Stop everything: gateways and agents first (agents drain their replicas),
        then the control plane and NATS, then anything else still carrying the marker.
        Returns what each step stopped, how long it took, and what had to be killed."""
        state = self.load()
        if state is None:
            return []
        order: list[tuple[str, Iterable[ProcessRecord]]] = [
            ("gateways", [p for p in state.processes if p.kind == "gateway"]),
            ("agents (draining replicas)", [p for p in state.processes if p.kind == "agent"]),
            ("replicas", self.replicas(state)),
            ("control plane", [p for p in state.processes if p.kind == "control-plane"]),
            ("nats", [p for p in state.processes if p.kind == "nats"]),
        ]
        reports: list[StopReport] = []
        for name, group in order:
            pids = [p.pid for p in group if pid_alive(p.pid)]
            started = time.monotonic()
            killed = terminate(pids, timeout)
            reports.append(
                StopReport(step=name, stopped=len(pids), killed=killed, seconds=time.monotonic() - started)
            )
        leftovers = [p.pid for p in self.marked_processes(state.fleet_id)]
        started = time.monotonic()
        killed = terminate(leftovers, 5.0)
        reports.append(
            StopReport(
                step="leftovers", stopped=len(leftovers), killed=killed, seconds=time.monotonic() - started
            )
        )
        with contextlib.suppress(FileNotFoundError):
            self.state_path.unlink()
        return reports


class StopReport(BaseModel):
    step: str
    stopped: int
    killed: list[int]
    seconds: float


def terminate(pids: list[int], timeout: float) -> list[int]:
    """SIGTERM each live pid, wait up to `timeout`, SIGKILL the rest; returns killed pids.

    A zombie counts as gone: a process started by another parent (a foreground `up`, a
    test) stays a zombie until that parent reaps it, and waiting for it would only stall."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            procs.append(proc)
    alive = _wait_gone(procs, timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _wait_gone(alive, 5.0)
    return [p.pid for p in alive]


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive:
        for proc in alive:
            with contextlib.suppress(psutil.Error, psutil.TimeoutExpired):
                proc.wait(0)  # reaps our own children
        alive = [p for p in alive if pid_alive(p.pid)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return alive


def _port_or_free(preferred: int) -> int:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            return free_port()


def wait_http(
    url: str, timeout: float, ok=lambda r: r.status_code == 200, proc_pid: int | None = None
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_pid is not None and not pid_alive(proc_pid):
            return False
        with contextlib.suppress(httpx.HTTPError):
            if ok(httpx.get(url, timeout=2.0)):
                return True
        time.sleep(0.2)
    return False
