"""Where the control plane keeps things and how it finds the rest, from the environment.

FLEET_HOME (default ~/.fleet) holds the SQLite database, the admin token the CLI uses,
and local-fleet state. FLEET_DATABASE_URL switches to PostgreSQL
(postgresql+psycopg://user:pass@host/db). FLEET_API_URL / FLEET_TOKEN point the CLI
at another control plane.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

DEFAULT_API_PORT = 7070


def fleet_home() -> Path:
    return Path(os.environ.get("FLEET_HOME", "~/.fleet")).expanduser()


class Settings(BaseModel):
    home: Path = Field(default_factory=fleet_home)
    database_url: str = ""
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"
    port: int = DEFAULT_API_PORT
    heartbeat_interval_s: float = 1.0
    # A cluster is unhealthy after this many heartbeat intervals without one.
    missed_heartbeats: int = 5
    reconcile_interval_s: float = 2.0
    # Placement algorithm by registry name (FLEET_PLACER): "milp" (HiGHS, falls back to
    # first-fit-decreasing on any solver error) or "ffd".
    placer: str = "milp"
    # GPU quotas per priority class (FLEET_GPU_QUOTAS), e.g. "critical:max=16,batch:min=4":
    # a class's bound and guaranteed floor, enforced by both placers (docs/placement.md).
    gpu_quotas: str = ""
    # The control plane's NATS identity (FLEET_NATS_CA / FLEET_NATS_CERT / FLEET_NATS_KEY):
    # TLS with its certificate; unset: plaintext and anonymous (tests).
    nats_ca_file: Path | None = None
    nats_cert_file: Path | None = None
    nats_key_file: Path | None = None
    # Publish the key set's lease (fleet_keys) this often; gateways judge staleness by it.
    key_lease_interval_s: float = 5.0
    # FLEET_PROTECT_DOCS=1: /docs and /openapi.json need a bearer token too (and /redoc
    # goes); FLEET_PROTECT_METRICS=1: so does /metrics.
    protect_docs: bool = False
    protect_metrics: bool = False

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        home = fleet_home()
        values = {
            "home": home,
            "database_url": os.environ.get("FLEET_DATABASE_URL", ""),
            "nats_url": os.environ.get("FLEET_NATS_URL", "nats://127.0.0.1:4222"),
        }
        if os.environ.get("FLEET_PLACER"):
            values["placer"] = os.environ["FLEET_PLACER"]
        if os.environ.get("FLEET_GPU_QUOTAS"):
            values["gpu_quotas"] = os.environ["FLEET_GPU_QUOTAS"]
        for field, env in (
            ("nats_ca_file", "FLEET_NATS_CA"),
            ("nats_cert_file", "FLEET_NATS_CERT"),
            ("nats_key_file", "FLEET_NATS_KEY"),
        ):
            if os.environ.get(env):
                values[field] = Path(os.environ[env])
        for field, env in (
            ("protect_docs", "FLEET_PROTECT_DOCS"),
            ("protect_metrics", "FLEET_PROTECT_METRICS"),
        ):
            if os.environ.get(env):
                values[field] = os.environ[env].lower() in ("1", "true", "yes")
        if "FLEET_MISSED_HEARTBEATS" in os.environ:
            values["missed_heartbeats"] = int(os.environ["FLEET_MISSED_HEARTBEATS"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def nats_tls(self):
        """The control plane's `agent.security.tls.NatsTls`, or None without certificates."""
        from agent.security.identity import inbox_prefix
        from agent.security.tls import NatsTls

        if not (self.nats_ca_file and self.nats_cert_file and self.nats_key_file):
            return None
        return NatsTls(
            ca_file=self.nats_ca_file,
            cert_file=self.nats_cert_file,
            key_file=self.nats_key_file,
            inbox_prefix=inbox_prefix("control-plane"),
        )

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'fleet.db'}"

    @property
    def token_file(self) -> Path:
        """The admin token for the CLI (mode 0600)."""
        return self.home / "admin-token"

    @property
    def api_file(self) -> Path:
        """The URL of the control plane last started under this FLEET_HOME."""
        return self.home / "api-url"


def client_endpoint() -> tuple[str, str | None]:
    """(API URL, token) for the CLI: FLEET_API_URL / FLEET_TOKEN, else $FLEET_HOME files."""
    home = fleet_home()
    url = os.environ.get("FLEET_API_URL")
    if not url:
        api_file = home / "api-url"
        url = api_file.read_text().strip() if api_file.exists() else f"http://127.0.0.1:{DEFAULT_API_PORT}"
    token = os.environ.get("FLEET_TOKEN")
    if not token:
        token_file = home / "admin-token"
        token = token_file.read_text().strip() if token_file.exists() else None
    return url.rstrip("/"), token
