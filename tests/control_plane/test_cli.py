"""fleetctl's launcher surface (the control plane's commands arrive with it)."""

from __future__ import annotations

from typer.testing import CliRunner

from control_plane.cli import app


def test_version_and_help():
    runner = CliRunner()
    res = runner.invoke(app, ["version"])
    assert res.exit_code == 0 and res.output.strip()
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "engine" in res.output


def test_engine_command_reports_a_bad_model_with_non_zero_exit():
    res = CliRunner().invoke(app, ["engine", "--model", "/nonexistent/model.gguf", "--port", "1"])
    assert res.exit_code != 0
