"""The control plane's one Settings: every FLEET_* knob read once, keyword arguments first."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from control_plane.settings import DEFAULT_PLACER, Settings


def test_environment_names_and_overrides(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    monkeypatch.setenv("FLEET_PLACER", "ffd")
    monkeypatch.setenv("FLEET_NATS_CA", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("FLEET_PROTECT_DOCS", "yes")
    monkeypatch.setenv("FLEET_AUTOSCALE_INTERVAL_S", "0.5")
    monkeypatch.setenv("FLEET_QUOTA_MIN_SHARE", "0.25")
    s = Settings.from_env(port=1234, host=None)
    assert (s.home, s.placer, s.nats_ca_file, s.protect_docs) == (tmp_path, "ffd", tmp_path / "ca.pem", True)
    assert (s.autoscale_interval_s, s.quota_min_share, s.port, s.host) == (0.5, 0.25, 1234, "127.0.0.1")
    monkeypatch.delenv("FLEET_PLACER")
    assert Settings().placer == DEFAULT_PLACER
    monkeypatch.setenv("FLEET_AUTOSCALE_INTERVAL_S", "0")
    with pytest.raises(ValidationError):
        Settings()


def test_leader_timing_defaults_and_order(monkeypatch) -> None:
    s = Settings()
    assert (s.leader_lease_s, s.leader_renew_deadline_s, s.leader_retry_s) == (15.0, 10.0, 2.0)
    monkeypatch.setenv("FLEET_LEADER_LEASE_S", "6")
    monkeypatch.setenv("FLEET_LEADER_RENEW_DEADLINE_S", "4")
    monkeypatch.setenv("FLEET_LEADER_RETRY_S", "1")
    assert (Settings().leader_lease_s, Settings().leader_renew_deadline_s, Settings().leader_retry_s) == (
        6,
        4,
        1,
    )
    for lease, deadline, retry in [(10, 10, 2), (10, 12, 2), (15, 10, 10), (15, 10, 11), (15, 10, 0)]:
        monkeypatch.setenv("FLEET_LEADER_LEASE_S", str(lease))
        monkeypatch.setenv("FLEET_LEADER_RENEW_DEADLINE_S", str(deadline))
        monkeypatch.setenv("FLEET_LEADER_RETRY_S", str(retry))
        with pytest.raises(ValidationError):
            Settings()
