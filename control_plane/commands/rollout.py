"""fleetctl rollout start|status|promote|abort: canary rollouts over the admin API."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, emit, emit_json, fail
from control_plane.commands.resources import EngineChoice, _engine_args, _load_file

rollout_app = typer.Typer(help="Canary rollouts: start, status, promote, abort.", no_args_is_help=True)

ROLLOUT_COLUMNS = [
    "deployment",
    "baseline_version",
    "canary_version",
    "phase",
    "step",
    "canary_weight",
    "canary_replicas",
    "reason",
]
NUMBER_COLUMNS = [
    "canary_requests",
    "canary_error_rate",
    "baseline_requests",
    "baseline_error_rate",
    "canary_ttft_p90_s",
    "baseline_ttft_p90_s",
    "ttft_p90_ratio",
    "ttft_p_value",
    "ready",
    "min_ready",
    "capacity_mode",
    "capacity_reason",
    "status",
]
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(text: str, flag: str = "--step-duration") -> float:
    """'90', '90s', '2m', '1.5h', '500ms' -> seconds."""
    match = _DURATION.match(text)
    if not match:
        fail(f"{flag} {text!r}: expected a duration like 30s, 2m or 1h")
    value, unit = float(match.group(1)), match.group(2) or "s"
    seconds = value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    if seconds <= 0:
        fail(f"{flag} must be positive")
    return seconds


_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%?)\s*$")


def parse_share(text: str) -> float:
    """'10%' or '0.1' -> 0.1: the share of requests a shadow phase copies, in (0, 1]."""
    match = _SHARE.match(text)
    if not match:
        fail(f"--shadow {text!r}: expected a share like 10% or 0.1")
    value = float(match.group(1)) / (100 if match.group(2) else 1)
    if not 0 < value <= 1:
        fail(f"--shadow {text!r}: the share must be above 0 and at most 100% (1.0)")
    return value


def parse_steps(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"--steps {text!r}: expected comma-separated percentages like 5,25,50,100")


def _show(data: dict, output: OutputFormat) -> None:
    if output == OutputFormat.json:
        emit_json(data)
        return
    row = {
        **data,
        "step": f"{data['step']}/{len(data['steps'])}",
        "canary_weight": f"{data['canary_weight']:g}%",
    }
    emit(row, output, ROLLOUT_COLUMNS, title=f"rollout of {data['deployment']}")
    last = data.get("last") or {}
    if last:
        emit(last, output, [c for c in NUMBER_COLUMNS if c in last], title="last window")
    else:
        console.print("no telemetry yet")
    if data.get("shadow"):
        _show_shadow(data["shadow"], output)


def _show_shadow(shadow: dict, output: OutputFormat) -> None:
    """The shadow phase and its comparison: one row per measure, originals against copies."""
    phase = shadow.get("phase") or "-"
    title = f"shadow phase: {phase}, {shadow['share']:.0%} of requests for {shadow['duration_s']:g}s"
    if shadow.get("reason"):
        title += f" ({shadow['reason']})"
    errors = shadow.get("errors") or {}
    greedy = shadow.get("greedy") or {}
    rows = [
        {
            "measure": "requests / copies / dropped",
            "original": shadow.get("requests"),
            "copy": shadow.get("copies"),
            "note": f"{shadow.get('dropped', 0)} dropped, {shadow.get('compared', 0)} compared",
        },
        {
            "measure": "errors",
            "original": errors.get("original"),
            "copy": errors.get("copy"),
            "note": "same requests",
        },
    ]
    for key, label in (
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("ttft_p90_s", "TTFT p90 (s)"),
        ("itl_p50_s", "ITL p50 (s)"),
        ("itl_p90_s", "ITL p90 (s)"),
    ):
        pair = shadow.get(key) or {}
        rows.append(
            {"measure": label, "original": pair.get("original"), "copy": pair.get("copy"), "note": ""}
        )
    agreement = greedy.get("agreement")
    rows.append({
        "measure": "greedy identical",
        "original": greedy.get("compared"),
        "copy": greedy.get("identical"),
        "note": ("-" if agreement is None else f"agreement {agreement:.1%}")
        + ("" if greedy.get("first_diff_token_p50") is None else f", first diff token p50 {greedy['first_diff_token_p50']:g}"),
    })  # fmt: skip
    emit(rows, output, ["measure", "original", "copy", "note"], title=title)


def start(
    name: str = typer.Argument(..., help="deployment name"),
    version: int = typer.Option(None, "--version", help="roll out this existing version"),
    file: Path = typer.Option(
        None, "--file", "-f", help="the new version's fields (YAML, like fleetctl deploy -f)"
    ),
    model: str = typer.Option(None, "--model", "-m", help="the new version's model"),
    engine: EngineChoice = typer.Option(None, "--engine", help="the new version's engine"),
    engine_arg: list[str] = typer.Option(
        None, "--engine-arg", "-e", help="new version's engine flag KEY=VALUE"
    ),
    steps: str = typer.Option("5,25,50,100", "--steps", help="canary traffic percentages, ending at 100"),
    step_duration: str = typer.Option("2m", "--step-duration", help="how long each step is observed"),
    max_error_rate: float = typer.Option(
        0.02, "--max-error-rate", help="roll back above this canary 5xx share"
    ),
    max_ttft_p90_ratio: float = typer.Option(
        1.3, "--max-ttft-p90-ratio", help="roll back above this canary/baseline TTFT p90"
    ),
    min_requests: int = typer.Option(50, "--min-requests", help="canary requests needed per step"),
    ready_timeout: str = typer.Option(
        "10m", "--ready-timeout", help="roll back if canary replicas take longer"
    ),
    shadow: str = typer.Option(
        None,
        "--shadow",
        help="a shadow phase first: copy this share of requests (10% or 0.1) to the new version",
    ),
    shadow_duration: str = typer.Option(
        None, "--shadow-duration", help="how long the shadow phase runs (10m)"
    ),
    shadow_min_requests: int = typer.Option(
        20, "--shadow-min-requests", help="copies compared before judging"
    ),
    shadow_max_error_increase: float = typer.Option(
        0.02, "--shadow-max-error-increase", help="stop above this copy-minus-original 5xx share"
    ),
    shadow_max_ttft_p90_ratio: float = typer.Option(
        1.5, "--shadow-max-ttft-p90-ratio", help="stop above this copy/original TTFT p90"
    ),
    shadow_max_itl_p90_ratio: float = typer.Option(
        1.5, "--shadow-max-itl-p90-ratio", help="stop above this copy/original ITL p90"
    ),
    shadow_min_agreement: float = typer.Option(
        0.9, "--shadow-min-agreement", help="stop below this share of identical greedy outputs"
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Start a canary rollout of NAME to --version V or to a new version (-f FILE, --model, -e)."""
    body: dict[str, Any] = {
        "steps": parse_steps(steps),
        "step_duration_s": parse_duration(step_duration),
        "max_error_rate": max_error_rate,
        "max_ttft_p90_ratio": max_ttft_p90_ratio,
        "min_requests": min_requests,
        "ready_timeout_s": parse_duration(ready_timeout),
    }
    if shadow is not None:
        body |= {
            "shadow_share": parse_share(shadow),
            "shadow_min_requests": shadow_min_requests,
            "shadow_max_error_rate_increase": shadow_max_error_increase,
            "shadow_max_ttft_p90_ratio": shadow_max_ttft_p90_ratio,
            "shadow_max_itl_p90_ratio": shadow_max_itl_p90_ratio,
            "shadow_min_greedy_agreement": shadow_min_agreement,
        }
        if shadow_duration is not None:
            body["shadow_duration_s"] = parse_duration(shadow_duration, "--shadow-duration")
    elif shadow_duration is not None:
        fail("--shadow-duration needs --shadow SHARE (e.g. --shadow 10%)")
    spec: dict[str, Any] = _load_file(file) if file else {}
    spec.pop("name", None)
    if model:
        spec["model"] = model
    if engine:
        spec["engine"] = engine.value
    if engine_arg:
        spec["engine_args"] = {**spec.get("engine_args", {}), **_engine_args(engine_arg)}
    if version is not None and spec:
        fail("give either --version or a new spec (-f/--model/--engine/-e), not both")
    if version is not None:
        body["version"] = version
    elif spec:
        body["spec"] = spec
    else:
        fail("give --version V or the new version's fields (-f FILE, --model, --engine, -e KEY=VALUE)")
    _show(call(lambda c: c.post(f"/v1/deployments/{name}/rollouts", body)), output)


def status(
    name: str = typer.Argument(..., help="deployment name"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """The active (or last) rollout of NAME with its last window's numbers."""
    _show(call(lambda c: c.get(f"/v1/deployments/{name}/rollouts/current")), output)


def promote(
    name: str = typer.Argument(..., help="deployment name"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Promote the canary now: it becomes the current version."""
    _show(call(lambda c: c.post(f"/v1/deployments/{name}/rollouts/current/promote")), output)


def abort(
    name: str = typer.Argument(..., help="deployment name"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Abort the rollout: all traffic back to the baseline, the canary's replicas removed."""
    _show(call(lambda c: c.post(f"/v1/deployments/{name}/rollouts/current/abort")), output)


rollout_app.command("start")(start)
rollout_app.command("status")(status)
rollout_app.command("promote")(promote)
rollout_app.command("abort")(abort)


def register(app: typer.Typer) -> None:
    app.add_typer(rollout_app, name="rollout")
