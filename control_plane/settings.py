"""The control plane process's one `Settings` (pydantic-settings): every knob it reads from
the environment, read once at start and passed to the loops through the context.

Each field is `FLEET_<FIELD>` (FLEET_PLACER, FLEET_MISSED_HEARTBEATS, ...; the NATS
identity files are FLEET_NATS_CA / FLEET_NATS_CERT / FLEET_NATS_KEY). FLEET_HOME (default
~/.fleet) holds the SQLite database, the admin token the CLI uses, and local-fleet state.
FLEET_DATABASE_URL switches to PostgreSQL (postgresql+psycopg://user:pass@host/db).
FLEET_API_URL (a comma-separated list of one control plane's instances) / FLEET_TOKEN point
the CLI at another control plane (`client_endpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_API_PORT = 7070
# The placer by registry name (`control_plane.placement`) when FLEET_PLACER is unset.
DEFAULT_PLACER = "milp"


def fleet_home() -> Path:
    return Path(os.environ.get("FLEET_HOME", "~/.fleet")).expanduser()


def _env(name: str) -> AliasChoices:
    """The field's own name (keyword arguments) or its environment variable."""
    return AliasChoices(name.removeprefix("FLEET_").lower(), name)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore", populate_by_name=True)

    home: Path = Field(default_factory=fleet_home)
    database_url: str = ""
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"
    port: int = DEFAULT_API_PORT
    heartbeat_interval_s: float = 1.0
    # A cluster is unhealthy after this many heartbeat intervals without one.
    missed_heartbeats: int = 5
    reconcile_interval_s: float = 2.0
    # A silent cluster's ready replicas stay in its desired state until they are ready
    # elsewhere, for at most this long after its last heartbeat (placement/hold.py; 300 s
    # as Kubernetes tolerates an unreachable node). 0 gives them up at once.
    unreachable_hold_s: float = Field(300.0, ge=0)
    # Placement algorithm by registry name (FLEET_PLACER): "milp" (HiGHS, falls back to
    # first-fit-decreasing on any solver error) or "ffd".
    placer: str = DEFAULT_PLACER
    # GPU quotas per priority class (FLEET_GPU_QUOTAS), e.g. "critical:max=16,batch:min=4":
    # a class's bound and guaranteed floor, enforced by both placers (docs/placement.md).
    gpu_quotas: str = ""
    # The control plane's NATS identity (FLEET_NATS_CA / FLEET_NATS_CERT / FLEET_NATS_KEY):
    # TLS with its certificate; unset: plaintext and anonymous (tests).
    nats_ca_file: Path | None = Field(None, validation_alias=AliasChoices("nats_ca_file", "FLEET_NATS_CA"))
    nats_cert_file: Path | None = Field(
        None, validation_alias=AliasChoices("nats_cert_file", "FLEET_NATS_CERT")
    )
    nats_key_file: Path | None = Field(None, validation_alias=AliasChoices("nats_key_file", "FLEET_NATS_KEY"))
    # The fleet's webhook master secret (FLEET_WEBHOOK_MASTER, a file; `fleetctl up` sets it):
    # a key's webhook signing secret is derived from it and shown once; unset: none is shown.
    webhook_master_file: Path | None = Field(
        None, validation_alias=AliasChoices("webhook_master_file", "FLEET_WEBHOOK_MASTER")
    )
    # Publish the key set's lease (fleet_keys) this often; gateways judge staleness by it.
    key_lease_interval_s: float = 5.0
    # FLEET_PROTECT_DOCS=1: /docs and /openapi.json need a bearer token too (and /redoc
    # goes); FLEET_PROTECT_METRICS=1: so does /metrics.
    protect_docs: bool = False
    protect_metrics: bool = False
    # The autoscaler: seconds between decisions, and its policy by registry name.
    autoscale_interval_s: float = Field(2.0, ge=0.05)
    autoscale_policy: str = "ours"
    # Usage records older than this are deleted; quota shares: how often they are
    # recomputed, the usage window they follow, the smallest share a cluster keeps.
    usage_retention_days: float = Field(90.0, gt=0)
    quota_share_interval_s: float = Field(5.0, gt=0)
    quota_share_window_s: float = Field(60.0, gt=0)
    quota_min_share: float = Field(0.1, ge=0, le=1)
    # A usage record dated more than this ahead of the control plane's clock is refused
    # (as is one older than the retention): a report's date must be plausible.
    report_clock_skew_s: float = Field(300.0, ge=0)
    # How long an unacknowledged batch of a durable consumer waits for redelivery.
    ingest_ack_wait_s: float = Field(10.0, gt=0)
    # The TCO report's engineering cost (docs/cost.md): hours a month that running Fleet
    # takes, at this hourly rate; pro-rated to the report's window.
    tco_engineering_hours_per_month: float = Field(20.0, ge=0, le=10_000)
    tco_engineering_hourly_dollars: float = Field(100.0, ge=0, le=100_000)
    # How often the cost gauges on /metrics are recomputed (at most; on a scrape).
    cost_metrics_interval_s: float = Field(60.0, ge=1)
    # Team budgets: seconds between two passes over every budget (control_plane.loops.budgets).
    budget_interval_s: float = Field(30.0, gt=0)
    # The scheduled jobs (control_plane.scheduled), run by the leader. Retention: events and
    # audit records older than these are deleted (usage: `usage_retention_days`, never
    # within the current month, which budgets and cost reports read).
    retention_events_days: float = Field(90.0, gt=0)
    retention_audit_days: float = Field(365.0, gt=0)
    # Certificates within this many days of expiry are reported (event, metric).
    cert_renew_window_days: float = Field(30.0, gt=0)
    # A node no heartbeat has reported for this long (removed from its cluster) is forgotten.
    stale_node_days: float = Field(7.0, gt=0)
    # A control-plane member (any instance) not seen for this long has crashed: forgotten.
    stale_member_s: float = Field(3600.0, gt=0)
    # Leader election (control_plane.ha): a follower takes over after the lease went
    # unrenewed this long on its own clock; a leader stops its loops this long after the
    # start of its last good renew; every instance tries (and heartbeats) this often.
    leader_lease_s: float = Field(15.0, gt=0)
    leader_renew_deadline_s: float = Field(10.0, gt=0)
    leader_retry_s: float = Field(2.0, gt=0)
    # The URL other hosts reach this instance at, as `GET /v1/control-plane` lists it
    # (FLEET_ADVERTISE_URL; Kubernetes: the pod's IP); default: the address it listens on.
    advertise_url: str = ""

    @model_validator(mode="after")
    def _leader_timing(self) -> Settings:
        if not self.leader_renew_deadline_s < self.leader_lease_s:
            raise ValueError("FLEET_LEADER_RENEW_DEADLINE_S must be below FLEET_LEADER_LEASE_S")
        if not self.leader_retry_s < self.leader_renew_deadline_s:
            raise ValueError("FLEET_LEADER_RETRY_S must be below FLEET_LEADER_RENEW_DEADLINE_S")
        return self

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        """The environment's settings; `overrides` that are not None win over it."""
        return cls(**{k: v for k, v in overrides.items() if v is not None})

    def nats_tls(self):
        """The control plane's `fleet_base.security.tls.NatsTls`, or None without certificates."""
        from fleet_base.security.identity import inbox_prefix
        from fleet_base.security.tls import NatsTls

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
        """The URLs of the control-plane instances started under this FLEET_HOME, one a line."""
        return self.home / "api-url"


def parse_api_urls(text: str) -> list[str]:
    """Control-plane URLs from FLEET_API_URL (comma-separated) or the api file (one a line)."""
    parts = text.replace(",", "\n").split()
    return list(dict.fromkeys(p.rstrip("/") for p in parts if p.strip("/")))


def client_timeout() -> float:
    """Seconds the CLI waits for one instance's answer (FLEET_API_TIMEOUT_S, default 30)."""
    try:
        return max(0.1, float(os.environ.get("FLEET_API_TIMEOUT_S") or 30.0))
    except ValueError:
        return 30.0


def client_endpoint() -> tuple[list[str], str | None]:
    """(every API URL, token) for the CLI: FLEET_API_URL / FLEET_TOKEN, else $FLEET_HOME files.
    Several URLs are instances of one control plane; the client fails over between them."""
    home = fleet_home()
    urls = parse_api_urls(os.environ.get("FLEET_API_URL", ""))
    if not urls:
        api_file = home / "api-url"
        urls = parse_api_urls(api_file.read_text()) if api_file.exists() else []
    token = os.environ.get("FLEET_TOKEN")
    if not token:
        token_file = home / "admin-token"
        token = token_file.read_text().strip() if token_file.exists() else None
    return urls or [f"http://127.0.0.1:{DEFAULT_API_PORT}"], token
