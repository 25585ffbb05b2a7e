"""The certificate-expiry check: days to expiry for the control plane's own identity, its
trust bundle and (a local fleet's FLEET_HOME) the PKI's certificates; an event for each
within the window, none for the others."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.scheduled.certificates import EVENT_KIND, certificate_files, check, report
from control_plane.security.pki import FleetCA
from control_plane.settings import Settings


@pytest.fixture
def home(tmp_path):
    """A FLEET_HOME with a PKI: the CA (10 years), the control plane's leaf for 200 days, a
    cluster's agent for 20, its gateway for 40 days and its replica for 1."""
    pki = tmp_path / "pki"
    ca = FleetCA(pki)
    ca.issue(pki / "control-plane.pem", pki / "control-plane.key", "control-plane", days=200)
    east = pki / "clusters" / "east"
    east.mkdir(parents=True)
    ca.issue(east / "agent.pem", east / "agent.key", "agent", "east", days=20)
    ca.issue(east / "gateway.pem", east / "gateway.key", "gateway", "east", days=40)
    ca.issue(east / "replica.pem", east / "replica.key", "replica", "east", days=1)
    return tmp_path


@pytest.mark.parametrize(
    ("window", "expiring"),
    [
        (1, ["pki/clusters/east/replica.pem"]),
        (30, ["pki/clusters/east/agent.pem", "pki/clusters/east/replica.pem"]),
        (
            45,
            ["pki/clusters/east/agent.pem", "pki/clusters/east/gateway.pem", "pki/clusters/east/replica.pem"],
        ),
    ],
)
def test_certificates_within_the_window_are_expiring(home, window, expiring) -> None:
    result = check(Settings(home=home, cert_renew_window_days=window), datetime.now(timezone.utc))
    assert sorted(result.expiring) == expiring
    days = {c.certificate: c.days_left for c in result.certificates}
    assert days["pki/control-plane.pem"] == pytest.approx(200, abs=0.01)
    assert days["pki/clusters/east/agent.pem"] == pytest.approx(20, abs=0.01)
    assert days["pki/clusters/east/replica.pem"] == pytest.approx(1, abs=0.01)
    assert days["pki/ca.pem"] > 3000


def test_the_configured_identity_counts_once_and_a_bad_file_is_reported(home, tmp_path) -> None:
    bad = tmp_path / "broken.pem"
    bad.write_text("not a certificate")
    settings = Settings(home=home, nats_cert_file=home / "pki" / "control-plane.pem", nats_ca_file=bad)
    files = certificate_files(settings)
    assert files.count(home / "pki" / "control-plane.pem") == 1
    result = check(settings, datetime.now(timezone.utc))
    assert result.unreadable == ["broken.pem"]
    assert "1 unreadable" in str(result)


def test_no_pki_and_no_identity_is_nothing_to_check(tmp_path) -> None:
    result = check(Settings(home=tmp_path), datetime.now(timezone.utc))
    assert result.certificates == [] and result.expiring == []
    assert not (tmp_path / "pki").exists()  # the check never creates a CA


def test_an_event_per_expiring_certificate(db, home) -> None:
    """25 days on: the agent's and the replica's have expired, the gateway's is within the window."""
    ctx = ControlPlaneContext(settings=Settings(home=home, cert_renew_window_days=30), sessions=db)
    result = report(ctx, datetime.now(timezone.utc) + timedelta(days=25))
    with db() as s:
        events = {
            e.message.split()[1]: e.message
            for e in s.scalars(select(m.Event).where(m.Event.kind == EVENT_KIND))
        }
    assert sorted(events) == sorted(result.expiring) == [
        "pki/clusters/east/agent.pem", "pki/clusters/east/gateway.pem", "pki/clusters/east/replica.pem"
    ]  # fmt: skip
    assert "has expired" in events["pki/clusters/east/agent.pem"]
    assert "expires in 15.0 days" in events["pki/clusters/east/gateway.pem"]
