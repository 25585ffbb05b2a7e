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


def _commands(group, path=()):
    """Every command path of a click group, subcommands included."""
    import click

    for name, cmd in getattr(group, "commands", {}).items():
        yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


def test_every_command_renders_its_help():
    """Rich markup in a help text (a stray [tag]) breaks that command's --help."""
    import typer.main

    group = typer.main.get_command(app)
    paths = list(_commands(group))
    assert len(paths) > 20
    for path in paths:
        res = CliRunner().invoke(app, [*path, "--help"])
        assert res.exit_code == 0, (path, res.output[-400:])


def test_engine_command_reports_a_bad_model_with_non_zero_exit():
    res = CliRunner().invoke(app, ["engine", "--model", "/nonexistent/model.gguf", "--port", "1"])
    assert res.exit_code != 0
