"""A local fleet of real processes (nats-server, control plane, one agent + gateway per
region) whose agents run the `sim` runtime: simulated replicas start in a fraction of a
second and fail on demand (`error_rate`), so traffic-shaped tests run without torch.
`runtime="process"` runs real engine replicas instead (`replica_args` for every one).
Plus a steady load generator that records every request."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from control_plane.local.fleet import LocalFleet, pid_alive
from fleet_base.ports import free_port
from fleet_base.protocol import PoolInventory
from tests import polling


def wait_for(check, timeout: float, interval: float = 0.2, what: str = "condition"):
    """`tests.polling.wait_for` in the e2e argument order; a component may be restarting,
    so an error from `check` means "not yet"."""
    return polling.wait_for(check, timeout, what, interval, retry_errors=True)


def start_threads(run: Callable[[int], None], count: int) -> list[threading.Thread]:
    """`count` daemon threads running `run(index)`, started."""
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads


@contextlib.contextmanager
def serving_fleet(
    home: Path,
    region: str,
    name: str,
    replicas: int,
    slots: int,
    control_plane_env: dict[str, str] | None = None,
    **fields: Any,
) -> Iterator[SimFleet]:
    """A one-region SimFleet serving `name` (`fields`: more of its body) with `replicas` ready."""
    fleet = SimFleet(home, [region], slots=slots, control_plane_env=control_plane_env)
    try:
        fleet.up()
        fleet.deploy(name, replicas, **fields)
        fleet.wait_ready(name, replicas)
        yield fleet
    finally:
        fleet.down()


class Workers:
    """`workers` threads, each running `_run(index)` until `stop()` (which waits for them)."""

    workers = 1
    join_s = 35.0
    _stop: threading.Event

    def _run(self, index: int) -> None:
        raise NotImplementedError

    def start(self):
        self._threads = start_threads(self._run, self.workers)
        return self

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(self.join_s)


class Sampler(Workers):
    """Calls `sample()` every `interval` s on a thread, from `start()` (or `with`) to `stop()`;
    a failed sample is skipped (a component may be restarting)."""

    interval = 0.1
    join_s = 5.0

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self, _: int) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.sample()
            time.sleep(self.interval)

    def start(self) -> Sampler:
        self._stop = threading.Event()
        return super().start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SimFleet:
    def __init__(
        self,
        home: Path,
        regions: list[str],
        slots: int = 4,
        gateway: dict[str, dict] | None = None,
        *,
        cluster: dict | None = None,
        runtime: str = "sim",
        replica_args: list[str] | None = None,
        pool: dict | None = None,
        control_planes: int = 1,
        control_plane_env: dict[str, str] | None = None,
        nats_profile_port: int | None = None,
    ) -> None:
        self.home = home
        self.regions = regions
        self.slots = slots
        self.gateway_overrides = gateway or {}  # region -> GatewayConfig fields
        self.cluster_overrides = cluster or {}  # ClusterConfig fields of every region
        self.runtime = runtime
        self.replica_args = replica_args or []
        self.pool_overrides = pool or {}  # more PoolInventory fields of every region's pool (a price)
        self.control_plane_count = control_planes  # instances on one database (FLEET_DATABASE_URL)
        self.control_plane_env = control_plane_env or {}  # FLEET_DATABASE_URL, FLEET_LEADER_*...
        self.nats_profile_port = nats_profile_port  # nats-server's pprof (bench.soak --heap-profile)
        self.local = LocalFleet(home)
        self.state = self.local.new_state(regions)
        self.token = ""
        self.key = ""
        self.gateways: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle

    def up(self, timeout: float = 60) -> SimFleet:
        local, state = self.local, self.state
        local.save(state)
        local.start_nats(
            state, port=free_port(), profile_port=self.nats_profile_port
        )  # never a shared default port: others run fleets too
        if self.control_plane_count == 1:
            self.start_control_plane(port=free_port(), timeout=timeout)
        else:
            self.start_control_planes(timeout)
        pool = "sim" if self.runtime == "sim" else "cpu"
        for index, region in enumerate(self.regions):
            config = local.write_cluster_config(state, region, index, self.slots, self.replica_args)
            config = config.model_copy(
                update={
                    **self.cluster_overrides,
                    "runtime": self.runtime,
                    "gateway": config.gateway.model_copy(
                        update={"port": free_port(), **self.gateway_overrides.get(region, {})}
                    ),
                    "pools": [
                        PoolInventory(
                            name=pool,
                            gpu_model="cpu",
                            gpus_per_node=self.slots,
                            nodes=1,
                            **self.pool_overrides,
                        )
                    ],
                }
            )
            config.dump(local.dir / "clusters" / region / "cluster.yaml")
            local.start_cluster(state, config)
            self.gateways[region] = config.gateway.url

        def healthy():
            clusters = {c["id"]: c for c in self.api("GET", "/v1/clusters").json()["items"]}
            return all(
                clusters.get(r, {}).get("status") == "healthy" and clusters[r]["last_heartbeat_at"]
                for r in self.regions
            )  # enrolment registers a cluster before its first heartbeat

        wait_for(healthy, timeout, 0.2, "every cluster's first heartbeat")
        for url in self.gateways.values():
            wait_for(
                lambda url=url: httpx.get(f"{url}/health", timeout=2).status_code == 200, timeout, 0.2, url
            )
        self.key = self.api("POST", "/v1/keys", json={"name": "e2e", "scopes": ["inference"]}).json()["key"]
        return self

    def start_control_plane(self, port: int | None = None, timeout: float = 60) -> None:
        record = self.local.start_control_plane(self.state, port=port, extra_env=self.control_plane_env)
        self._wait_control_planes([record], timeout)

    def start_control_planes(self, timeout: float = 60) -> None:
        """`control_planes` instances on one database, as `fleetctl up --control-planes` starts them."""
        ports = [free_port() for _ in range(self.control_plane_count)]
        wait = lambda records: self._wait_control_planes(records, timeout)  # noqa: E731
        self.local.start_control_planes(self.state, ports, wait, self.control_plane_env)

    def _wait_control_planes(self, records, timeout: float) -> None:
        token_file = self.home / "admin-token"
        for record in records:
            wait_for(
                lambda record=record: (
                    httpx.get(f"{record.url}/healthz", timeout=1).status_code == 200 and token_file.exists()
                ),
                timeout,
                0.1,
                f"the control plane {record.name}",
            )
        self.token = token_file.read_text().strip()

    def process(self, kind: str, name: str | None = None):
        for record in self.local.load().processes:
            if record.kind == kind and (name is None or record.name == name):
                return record
        raise KeyError(kind, name)

    def kill_control_plane(self, name: str | None = None) -> int:
        """kill -9 the control plane (`name`: one instance of several); returns its port."""
        cp = self.process("control-plane", name)
        psutil.Process(cp.pid).kill()
        wait_for(lambda: not pid_alive(cp.pid), 10, 0.05, "the control plane to die")
        state = self.local.load()
        state.processes = [p for p in state.processes if p.pid != cp.pid]
        self.local.save(state)
        self.state = state
        return int(cp.url.rsplit(":", 1)[1])

    def kill_region(self, region: str) -> list[int]:
        """kill -9 the region's agent and every replica it runs (its gateway stays)."""
        pids = [self.process("agent", region).pid]
        pids += [r.pid for r in self.local.replicas(self.local.load()) if r.name.startswith(f"{region}/")]
        kill_trees(pids)
        return pids

    def down(self) -> None:
        kill_fleet(self.local)

    # ------------------------------------------------------------------ clients

    @property
    def api_url(self) -> str:
        """The first instance that can answer (alive and not stopped)."""
        return self.control_plane_urls()[0]

    def control_plane_urls(self) -> list[str]:
        """Every control-plane instance that can answer: alive, not SIGSTOPped."""
        return [
            p.url
            for p in self.local.load().processes
            if p.kind == "control-plane" and pid_alive(p.pid) and not _stopped(p.pid)
        ]

    def api(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(
            method,
            f"{self.api_url}{path}",
            headers={"authorization": f"Bearer {self.token}"},
            timeout=10,
            **kw,
        )

    def deploy(self, name: str, replicas: int, **fields: Any) -> None:
        """Create a deployment of the sim model (`fields`: any other field of the API's body)."""
        r = self.api(
            "POST", "/v1/deployments", json={"name": name, "model": "sim", "replicas": replicas, **fields}
        )
        assert r.status_code == 201, r.text

    def wait_ready(self, name: str, replicas: int, timeout: float = 60, version: int = 1) -> None:
        """Wait until `replicas` of the deployment's `version` are ready."""
        wait_for(
            lambda: self.ready_by_version(name).get(version) == replicas, timeout, 0.2, f"{name}'s replicas"
        )

    def deployment(self, name: str) -> dict:
        return self.api("GET", f"/v1/deployments/{name}").json()

    def wait_versions(self, name: str, want: dict[int, int], timeout: float, what: str) -> None:
        """Wait until the ready replicas by version are exactly `want`; on a timeout the
        message lists every placement (version, state, cluster)."""

        def check() -> bool | polling.NotYet:
            placements = self.deployment(name)["placements"]
            ready: dict[int, int] = {}
            for p in placements:
                if p["state"] == "ready":
                    ready[p["version"]] = ready.get(p["version"], 0) + 1
            if ready == want:
                return True
            return polling.NotYet(
                [(p["version"], p["state"], p["cluster"], p["replica_id"]) for p in placements]
            )

        wait_for(check, timeout, 0.2, what)

    def ready_by_version(self, name: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self.deployment(name)["placements"]:
            if p["state"] == "ready":
                out[p["version"]] = out.get(p["version"], 0) + 1
        return out

    def served_by(self, region: str, model: str) -> str:
        """The cluster that serves one chat request sent to `region`'s gateway ("" on an error):
        an observable sync point for what the gateway's routes say."""
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        headers = {"authorization": f"Bearer {self.key}"}
        r = httpx.post(f"{self.gateways[region]}/v1/chat/completions", json=body, headers=headers, timeout=30)
        return r.headers.get("x-fleet-cluster", "") if r.status_code == 200 else ""

    def gateway_metric(self, region: str, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.gateways[region]}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@dataclass
class Result:
    gateway: str
    started: float
    ended: float
    status: int
    cluster: str = ""
    version: str = ""
    error: str = ""


def broken_stream(body: dict[str, Any], text: str) -> bool:
    """A 200 stream the client could not use: an in-band error event, or no `[DONE]`."""
    return bool(body.get("stream")) and ('data: {"error"' in text or "data: [DONE]" not in text)


@dataclass
class Load(Workers):
    """Steady non-streaming chat load: `workers` threads, each a request at a time,
    round-robin over `gateways`, a fresh end user per request (so the canary split is
    drawn afresh), optionally paced."""

    gateways: list[str]
    key: str
    model: str
    workers: int = 4
    pause_s: float = 0.0
    prompt: str = "hi"
    max_tokens: int = 2
    extra: dict[str, Any] = field(default_factory=dict)  # more fields of every body (temperature...)
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _run(self, index: int) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=30) as client:
            n = index
            while not self._stop.is_set():
                gateway = self.gateways[n % len(self.gateways)]
                n += 1
                body = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": self.prompt}],
                    "max_tokens": self.max_tokens,
                    "user": uuid.uuid4().hex,
                    **self.extra,
                }
                started = time.time()
                try:
                    r = client.post(f"{gateway}/v1/chat/completions", json=body, headers=headers)
                    result = Result(
                        gateway, started, time.time(), r.status_code,
                        r.headers.get("x-fleet-cluster", ""), r.headers.get("x-fleet-version", ""),
                        "" if r.status_code == 200 and not broken_stream(body, r.text) else r.text[:200],
                    )  # fmt: skip
                except httpx.HTTPError as err:
                    result = Result(gateway, started, time.time(), 0, error=f"{type(err).__name__}: {err}")
                self.results.append(result)
                if self.pause_s:
                    time.sleep(self.pause_s)

    def stop(self) -> list[Result]:
        super().stop()
        return self.results

    def failed(self) -> list[Result]:
        """Requests that failed: an error status, or a stream with an error event or no end."""
        return [r for r in self.results if r.status != 200 or r.error]

    def served(self, count: int, since: float = 0.0, timeout: float = 30, what: str = "requests") -> None:
        """Wait until `count` requests that began at or after `since` (time.time()) have ended:
        the load is flowing, or kept flowing past an event."""
        wait_for(lambda: sum(r.started >= since for r in self.results) >= count, timeout, 0.05, what)


def _stopped(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    return False


def kill_fleet(local: LocalFleet) -> None:
    """kill -9 every process carrying the fleet's marker (replicas included), until none
    is left: a test's teardown. A graceful stop (agents draining their replicas, then the
    control plane) costs seconds a fleet and is no test's subject there;
    tests/e2e/test_local_fleet.py stops its fleet gracefully with `fleetctl down`."""
    state = local.load()
    if state is None:
        return
    for _ in range(5):  # an agent killed mid-spawn leaves a replica the next round finds
        procs = local.marked_processes(state.fleet_id)
        if not procs:
            return
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        # reap ours; the others (replicas) are reaped by whoever inherits them, and a
        # zombie is no longer a marked process
        mine = {p.pid for p in psutil.Process().children()}
        psutil.wait_procs([p for p in procs if p.pid in mine], timeout=5)


def kill_trees(pids: list[int]) -> None:
    """kill -9 each process and its children, and wait for them (a crash, not a stop)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)
