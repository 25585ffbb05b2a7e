"""Enrolling clusters: their credential bundle, their NATS users, and the bundle a remote
cluster is handed (`fleetctl clusters enroll NAME`).

The enrolled clusters are remembered in `<FLEET_HOME>/pki/nats.json` together with how the
fleet's nats-server listens, so the server config can be regenerated with one more user
at any time (and reloaded with SIGHUP: connections stay up).
"""

from __future__ import annotations

import base64
import json
import os
import signal
from pathlib import Path

from pydantic import BaseModel, Field

from control_plane.security import nats_config
from control_plane.security.pki import FleetPki, write_private
from fleet_base.batch.webhook_signing import MASTER_ENV
from fleet_base.jetstream_budget import JetStreamBudget
from fleet_base.security.tls import Credentials


class NatsListen(BaseModel):
    host: str = "127.0.0.1"
    port: int = 4222
    store_dir: str = ""
    server_name: str = "fleet-nats"
    clusters: list[str] = Field(default_factory=list)
    pid: int | None = None  # a local nats-server started by fleetctl (reloaded on enrolment)


class Enrolment:
    """The operator-side state of a secured fleet under `home`."""

    def __init__(self, home: Path) -> None:
        self.pki = FleetPki(home)
        self.state_path = self.pki.dir / "nats.json"
        self.config_path = self.pki.dir / "nats-server.conf"

    def load(self) -> NatsListen:
        try:
            return NatsListen.model_validate_json(self.state_path.read_bytes())
        except (FileNotFoundError, ValueError):
            return NatsListen()

    def save(self, listen: NatsListen) -> None:
        write_private(self.state_path, listen.model_dump_json(indent=1).encode())

    def write_nats_config(self, listen: NatsListen, budget: JetStreamBudget | None = None) -> Path:
        cert, key = self.pki.nats_server(hosts=_hosts(listen.host))
        text = nats_config.render(
            host=listen.host,
            port=listen.port,
            store_dir=Path(listen.store_dir),
            server_name=listen.server_name,
            ca_file=self.pki.ca_file,
            cert_file=cert,
            key_file=key,
            clusters=listen.clusters,
            budget=budget,
        )
        write_private(self.config_path, text.encode())
        self.save(listen)
        return self.config_path

    def control_plane_env(self) -> dict[str, str]:
        cert, key = self.pki.control_plane()
        return {
            "FLEET_NATS_CA": str(self.pki.ca_file),
            "FLEET_NATS_CERT": str(cert),
            "FLEET_NATS_KEY": str(key),
            MASTER_ENV: str(self.pki.webhook_master()),
        }

    def enroll(self, cluster: str, hosts: list[str] | None = None) -> Credentials:
        """The cluster's bundle; adds its NATS users and reloads a local nats-server."""
        creds = self.pki.cluster(cluster, hosts)
        listen = self.load()
        if cluster not in listen.clusters:
            listen.clusters.append(cluster)
            if listen.store_dir:  # a server config exists: regenerate and reload it
                self.write_nats_config(listen)
                if listen.pid:
                    reload_nats(listen.pid)
            else:
                self.save(listen)
        return creds

    def bundle(self, cluster: str, creds: Credentials) -> dict[str, str]:
        """Everything a remote cluster needs, as {file name: contents} (no CA key)."""
        out: dict[str, str] = {}
        for path in creds.model_dump().values():
            if path is not None:
                out[Path(path).name] = Path(path).read_text()
        return out


def reload_nats(pid: int) -> None:
    """SIGHUP: nats-server re-reads its config (new users) without dropping connections."""
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        pass


def _hosts(host: str) -> list[str]:
    names = ["localhost", "127.0.0.1", "::1"]
    if host not in ("", "0.0.0.0", "::") and host not in names:
        names.append(host)
    return names


def encode_bundle(files: dict[str, str]) -> str:
    """One line to paste on the remote side (`fleetctl clusters enroll -o json` has the files)."""
    return base64.b64encode(json.dumps(files).encode()).decode()
