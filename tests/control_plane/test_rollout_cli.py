"""fleetctl rollout: flag parsing and the errors caught before any API call (the API
round trip is exercised by tests/e2e/test_rollouts.py)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from control_plane.cli import app
from control_plane.commands.rollout import parse_duration, parse_steps


@pytest.mark.parametrize(
    "text, seconds", [("90", 90), ("90s", 90), ("2m", 120), ("1.5h", 5400), ("500ms", 0.5)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["2x", "-1s", "", "0s", "m"])
def test_bad_durations_exit_with_a_reason(text):
    with pytest.raises(typer.Exit):
        parse_duration(text)


def test_steps():
    assert parse_steps("5,25, 50,100") == [5, 25, 50, 100]
    with pytest.raises(typer.Exit):
        parse_steps("5,a,100")


@pytest.mark.parametrize(
    "args, message",
    [
        (["web"], "give --version V"),
        (["web", "--version", "2", "-e", "seed=1"], "not both"),
        (["web", "--version", "2", "--step-duration", "soon"], "--step-duration"),
    ],
)
def test_start_refuses_before_calling_the_api(args, message, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["rollout", "start", *args])
    assert result.exit_code == 1
    assert message in result.output


def test_help_lists_the_subcommands():
    result = CliRunner().invoke(app, ["rollout", "--help"])
    assert result.exit_code == 0
    for word in ("start", "status", "promote", "abort"):
        assert word in result.output


@pytest.mark.parametrize(
    "text, share", [("10%", 0.1), ("0.1", 0.1), ("100%", 1.0), ("1", 1.0), (" 2.5% ", 0.025)]
)
def test_shadow_shares(text, share):
    from control_plane.commands.rollout import parse_share

    assert parse_share(text) == pytest.approx(share)


@pytest.mark.parametrize("text", ["0", "0%", "150%", "1.5", "ten", "-1"])
def test_bad_shadow_shares_exit_with_a_reason(text):
    from control_plane.commands.rollout import parse_share

    with pytest.raises(typer.Exit):
        parse_share(text)


def test_a_shadow_duration_needs_a_share(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["rollout", "start", "web", "-e", "seed=1", "--shadow-duration", "10m"])
    assert result.exit_code == 1 and "--shadow" in result.output
