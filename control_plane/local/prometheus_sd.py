"""Prometheus file-based service discovery for a local fleet: `prometheus-targets.json`
lists the control plane, every gateway and every replica the agents report, with labels
to group by. Prometheus re-reads the file on change (`file_sd_configs`), so rewriting it
is all `fleetctl up` and `fleetctl ps` have to do. See deploy/README.md."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, Field

from fleet_base.local_state import LocalState, atomic_write

TARGETS_FILE = "prometheus-targets.json"


class TargetGroup(BaseModel):
    """One file_sd entry: host:port targets sharing labels (`__metrics_path__` included)."""

    targets: list[str]
    labels: dict[str, str] = Field(default_factory=dict)


def host_port(url: str) -> str | None:
    """`http://127.0.0.1:9001/x` -> `127.0.0.1:9001`; None for an empty or odd URL."""
    if not url:
        return None
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def prometheus_targets(
    fleet_id: str, api_url: str | list[str], gateways: dict[str, str], cluster_dirs: dict[str, Path]
) -> list[TargetGroup]:
    """Target groups of a local fleet. `gateways`: region -> gateway URL; `cluster_dirs`:
    region -> that cluster's agent state dir (its replicas.json names the replicas)."""
    groups: list[TargetGroup] = []
    base = {"fleet": fleet_id}
    api_urls = [api_url] if isinstance(api_url, str) else api_url
    if targets := [t for t in map(host_port, api_urls) if t]:  # every control-plane instance
        groups.append(TargetGroup(targets=targets, labels={**base, "kind": "control-plane"}))
    for region, url in sorted(gateways.items()):
        if target := host_port(url):
            labels = {**base, "kind": "gateway", "cluster": region, "region": region}
            groups.append(TargetGroup(targets=[target], labels=labels))
    for region, state_dir in sorted(cluster_dirs.items()):
        snapshot = LocalState(state_dir).load_replicas()
        for replica in snapshot.replicas if snapshot else []:
            if target := host_port(replica.url):
                labels = {
                    **base,
                    "kind": "replica",
                    "cluster": snapshot.cluster or region,
                    "region": region,
                    "deployment": replica.deployment,
                    "replica": replica.replica_id,
                    "version": str(replica.version),
                }
                if replica.url.startswith("https://"):  # a secured fleet (docs/security.md)
                    labels["__scheme__"] = "https"
                groups.append(TargetGroup(targets=[target], labels=labels))
    return groups


def write_targets(path: Path, groups: list[TargetGroup]) -> Path:
    """Atomically (Prometheus must never read half a file)."""
    body = "[\n" + ",\n".join(g.model_dump_json() for g in groups) + "\n]\n"
    atomic_write(path, body.encode())
    path.chmod(0o644)  # a Prometheus running as another user (or in a container) reads it
    return path
