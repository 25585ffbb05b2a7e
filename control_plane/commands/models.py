"""`fleetctl models ls|pull|rm`: each cluster's node model cache, through the admin API
(`/v1/model-cache`). `pull` asks the agents to fetch a model ahead of a deployment and
draws a progress bar per cluster from what their heartbeats report."""

from __future__ import annotations

import time

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, fail, show

models_app = typer.Typer(
    help="The model cache of each cluster's nodes (s3://, hf://, oci://, https:// models)."
)
CACHE_COLUMNS = {
    "cluster": "cluster",
    "model": "uri",
    "state": "state",
    "size": "size_bytes",
    "done": "bytes_done",
    "files": "files",
    "in use": "in_use",
    "last used": "last_used",
    "pull (s)": "pull_s",
    "error": "error",
}
ANSWER_COLUMNS = {"cluster": "cluster", "ok": "ok", "message": "message"}


@models_app.command("ls")
def ls(
    cluster: str = typer.Option(None, "--cluster", "-c", help="only this cluster"),
    model: str = typer.Option(None, "--model", "-m", help="only this model URI"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """What each cluster's cache holds (or is pulling), from its agent's heartbeats."""
    params = {k: v for k, v in {"cluster": cluster, "model": model}.items() if v is not None}
    rows = call(lambda c: c.get("/v1/model-cache", **params))
    show(rows, output, CACHE_COLUMNS, title="model cache")


@models_app.command("pull")
def pull(
    model: str = typer.Argument(..., help="model URI, e.g. s3://bucket/smollm2.gguf"),
    cluster: list[str] = typer.Option(
        None, "--cluster", "-c", help="cluster (repeatable; none: every healthy one)"
    ),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the pulls with progress bars"),
    timeout: float = typer.Option(1800.0, "--timeout", help="seconds to follow the pulls"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Pull a model into clusters' caches ahead of a deployment."""
    answers = call(lambda c: c.post("/v1/model-cache/pull", {"model": model, "clusters": cluster or None}))
    started = [a for a in answers if a["ok"]]
    if not wait or output == OutputFormat.json or not started:
        show(answers, output, ANSWER_COLUMNS, title=f"pull {model}")
        if not started:
            raise typer.Exit(1)
        return
    for a in answers:
        if not a["ok"]:
            console.print(f"[red]{a['cluster']}[/red]: {a['message']}")
    uri = started[0]["message"].rsplit(": ", 1)[0]  # the agents answer "<canonical uri>: <state>"
    failed = _follow(uri, [a["cluster"] for a in started], timeout)
    if failed:
        fail(f"pull failed on {', '.join(failed)}")


def _follow(uri: str, clusters: list[str], timeout: float) -> list[str]:
    """Progress bars until every cluster has the model (or failed); the failed clusters."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    deadline = time.monotonic() + timeout
    done: dict[str, str] = {}
    with Progress(*columns, console=console) as progress:
        tasks = {c: progress.add_task(f"{c}: {uri}", total=None) for c in clusters}
        while len(done) < len(clusters) and time.monotonic() < deadline:
            rows = call(lambda c: c.get("/v1/model-cache", model=uri))
            for row in rows:
                name = row["cluster"]
                if name not in tasks or name in done:
                    continue
                progress.update(tasks[name], total=row["size_bytes"] or None, completed=row["bytes_done"])
                if row["state"] in ("ready", "failed"):
                    done[name] = row["state"]
                    if row["state"] == "failed":
                        progress.update(tasks[name], description=f"{name}: failed: {row['error'][:120]}")
            time.sleep(0.5)
    for c in clusters:
        console.print(
            f"{c}: {done.get(c, 'still pulling (timed out following it)')}", soft_wrap=True, highlight=False
        )
    return [c for c in clusters if done.get(c) != "ready"]


@models_app.command("rm")
def rm(
    model: str = typer.Argument(..., help="model URI"),
    cluster: list[str] = typer.Option(
        None, "--cluster", "-c", help="cluster (repeatable; none: every healthy one)"
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Remove a model from clusters' caches (refused where a deployment uses it)."""
    params = {"model": model, **({"cluster": list(cluster)} if cluster else {})}
    answers = call(lambda c: c.request("DELETE", "/v1/model-cache", params=params))
    show(answers, output, ANSWER_COLUMNS, title=f"rm {model}")
    if not any(a["ok"] for a in answers):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
