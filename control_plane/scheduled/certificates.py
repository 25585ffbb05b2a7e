"""Certificate expiry: every day (and once at start) the certificates this control plane
can see are read and their days to expiry kept for /metrics
(`fleet_control_plane_certificate_expires_in_days{certificate}`); one within `cert_renew_window_days`
(FLEET_CERT_RENEW_WINDOW_DAYS) writes a `certificate_expiring` event and a warning.

This job reports, it does not renew: the control plane's NATS identity is loaded into the
TLS context when it connects (a new file takes a restart), the server's certificate needs
nats-server reloaded, clusters' certificates live in bundles shipped to agents, and the CA
key belongs on the operator's machine, not in a running control plane. Renewal is
`fleetctl up` / `fleetctl clusters enroll` (docs/security.md), which re-issue any
certificate within 30 days of expiry; this job makes sure someone hears of it in time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from apscheduler.triggers.cron import CronTrigger
from pydantic import BaseModel

from control_plane.context import ControlPlaneContext
from control_plane.db.models import Event
from control_plane.scheduled.job import ScheduledJob
from control_plane.settings import Settings
from fleet_base.security.ca_bundle import load_bundle

log = logging.getLogger(__name__)

EVENT_KIND = "certificate_expiring"
DAY_S = 86_400.0


class CertificateExpiry(BaseModel):
    certificate: str  # the file (relative to FLEET_HOME when under it), `#n` for a bundle's n-th
    subject: str
    not_after: datetime
    days_left: float


class ExpiryReport(BaseModel):
    certificates: list[CertificateExpiry]
    expiring: list[str]  # within the window (or expired)
    unreadable: list[str]

    def __str__(self) -> str:
        text = f"{len(self.certificates)} certificates, {len(self.expiring)} within the renewal window"
        return text + (f", {len(self.unreadable)} unreadable" if self.unreadable else "")


def certificate_files(settings: Settings) -> list[Path]:
    """The control plane's own identity and trust files, and, where this FLEET_HOME holds
    the fleet PKI (a local fleet), the server's and every cluster's certificates."""
    files = [p for p in (settings.nats_cert_file, settings.nats_ca_file) if p is not None]
    pki = settings.home / "pki"
    if pki.is_dir():
        files += [pki / "ca.pem", pki / "nats-server.pem", pki / "control-plane.pem"]
        files += sorted(pki.glob("clusters/*/*.pem"))
    seen: dict[Path, None] = {}
    for f in files:
        seen.setdefault(Path(f).expanduser(), None)
    return [f for f in seen if f.exists()]


def _label(path: Path, home: Path) -> str:
    try:
        return str(path.relative_to(home.expanduser()))
    except ValueError:
        return str(path)


def expiries(files: Iterable[Path], home: Path, now: datetime) -> tuple[list[CertificateExpiry], list[str]]:
    found, unreadable = [], []
    for path in files:
        label = _label(path, home)
        try:
            certs = load_bundle(path)
        except (OSError, ValueError):
            unreadable.append(label)
            continue
        for i, cert in enumerate(certs):
            found.append(
                CertificateExpiry(
                    certificate=label if len(certs) == 1 else f"{label}#{i}",
                    subject=cert.subject.rfc4514_string(),
                    not_after=cert.not_valid_after_utc,
                    days_left=(cert.not_valid_after_utc - now).total_seconds() / DAY_S,
                )
            )
    return found, unreadable


def check(settings: Settings, now: datetime) -> ExpiryReport:
    found, unreadable = expiries(certificate_files(settings), settings.home, now)
    window = settings.cert_renew_window_days
    return ExpiryReport(
        certificates=found,
        expiring=[c.certificate for c in found if c.days_left <= window],
        unreadable=unreadable,
    )


def expiry_message(c: CertificateExpiry) -> str:
    when = f"expires in {c.days_left:.1f} days" if c.days_left > 0 else "has expired"
    return (
        f"certificate {c.certificate} ({c.subject}) {when} (not after {c.not_after:%Y-%m-%d %H:%M} UTC); "
        "renew it with fleetctl up / fleetctl clusters enroll (docs/security.md)"
    )


def report(ctx: ControlPlaneContext, now: datetime) -> ExpiryReport:
    result = check(ctx.settings, now)
    expiring = [c for c in result.certificates if c.certificate in set(result.expiring)]
    if expiring:
        with ctx.sessions() as session:
            for c in expiring:
                session.add(Event(kind=EVENT_KIND, message=expiry_message(c)))
                log.warning("%s", expiry_message(c))
            session.commit()
    return result


async def run(ctx: ControlPlaneContext) -> ExpiryReport:
    return await asyncio.to_thread(report, ctx, datetime.now(timezone.utc))


JOB = ScheduledJob(
    id="certificate-expiry",
    trigger=lambda s: CronTrigger(hour=6, minute=5, timezone=timezone.utc),
    run=run,
    run_at_start=True,
)

__all__ = ["EVENT_KIND", "JOB", "CertificateExpiry", "ExpiryReport", "certificate_files", "check"]
