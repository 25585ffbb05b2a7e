"""Debian's prometheus and chromium for the observability and console tests: find them,
or skip with the reason (fail instead when FLEET_REQUIRE_PROMETHEUS_CHROMIUM=1, as .ci/run
sets after scripts/install-browser-prometheus.sh); a real Prometheus server on a free port
with a temporary storage dir; the traffic and page helpers of the console's browser story."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from fleet_base.ports import free_port
from fleet_base.processes import stop_process
from tests.polling import wait_for, wait_for_process

REQUIRE_ENV = "FLEET_REQUIRE_PROMETHEUS_CHROMIUM"
INSTALL = "bash scripts/install-browser-prometheus.sh"
CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]


def require_tool(name: str) -> str:
    """The tool's path, or skip (fail in CI) saying how to install it."""
    path = name if os.path.isabs(name) and os.access(name, os.X_OK) else shutil.which(name)
    if path:
        return path
    reason = f"{name} is not installed (Debian package; install with `{INSTALL}`)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)
    raise AssertionError("unreachable")


def require_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the playwright Python package is not installed (pip install -e '.[dev]')"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    require_tool(CHROMIUM)
    return sync_playwright


class Prometheus:
    """`prometheus` with deploy/prometheus/prometheus.yml's scrape job and rule files, made
    fast for a test: 1 s scrape and rule evaluation, targets read from `targets_dir`."""

    def __init__(self, workdir: Path, targets_dir: Path, ca_file: Path | None = None) -> None:
        self.binary = require_tool("prometheus")
        self.workdir = workdir
        self.targets_dir = targets_dir
        self.ca_file = ca_file  # a secured fleet's CA: its replicas serve HTTPS
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(timeout=10)  # one client: a new one per call costs ~0.3 s under load

    def config(self) -> dict:
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(p) for p in self._fast_rules(config["rule_files"])]
        jobs = []
        for job in config["scrape_configs"]:
            if job["job_name"] == "prometheus":
                job["static_configs"] = [{"targets": [f"127.0.0.1:{self.port}"]}]
            for sd in job.get("file_sd_configs", []):
                sd["files"] = [str(self.targets_dir / Path(f).name) for f in sd["files"]]
                sd["refresh_interval"] = "1s"
            if job.get("file_sd_configs") and self.ca_file is not None:
                job["tls_config"] = {"ca_file": str(self.ca_file)}
            jobs.append(job)
        config["scrape_configs"] = jobs
        return config

    def _fast_rules(self, patterns: list[str]) -> list[Path]:
        """Copies of the rule files (globs relative to deploy/prometheus), every group
        evaluated each second; the rules themselves unchanged."""
        out = []
        for pattern in patterns:
            for rules in sorted((ROOT / "deploy/prometheus").glob(pattern)):
                text = yaml.safe_load(rules.read_text())
                for group in text["groups"]:
                    group["interval"] = "1s"
                copy = self.workdir / f"rules-{rules.name}"
                copy.write_text(yaml.safe_dump(text))
                out.append(copy)
        assert out, f"no rule files match {patterns}"
        return out

    def start(self, timeout: float = 60) -> Prometheus:
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(self.config()))
        log = open(self.workdir / "prometheus.log", "ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        wait_for_process(
            self.proc, self.ready, timeout, "prometheus", self.log_tail, 0.2, retry_errors=httpx.HTTPError
        )
        return self

    def ready(self) -> bool:
        return self.client.get(f"{self.url}/-/ready", timeout=1).status_code == 200

    def log_tail(self, lines: int = 30) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def query(self, expr: str) -> list[dict]:
        r = self.client.get(f"{self.url}/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {r.status_code} {body}"
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        return self.client.get(f"{self.url}/api/v1/targets").json()["data"]["activeTargets"]

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None:
            stop_process(self.proc, 15)
        self.proc = None


def streams(gateways: list[str], key: str, model: str, stop: threading.Event) -> None:
    """Streaming chat requests until `stop` (the gateway's TTFT histogram counts streams only)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as client:
        n = 0
        while not stop.is_set():
            try:
                with client.stream(
                    "POST", f"{gateways[n % len(gateways)]}/v1/chat/completions", json=body
                ) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass
            n += 1
            time.sleep(0.1)


class Shots:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.pages: dict[str, str] = {}  # url -> html, every page a test looked at

    def take(self, page, name: str, full_page: bool = True) -> None:
        page.screenshot(path=str(self.folder / f"{name}.png"), full_page=full_page)
        self.pages[f"{name} {page.url}"] = page.content()


BROWSER_ERRORS: list[str] = []  # script errors and console errors (CSP violations show there)


def watched(context):
    page = context.new_page()
    page.on("pageerror", lambda err: BROWSER_ERRORS.append(f"{page.url}: {err}"))
    page.on("console", lambda m: m.type == "error" and BROWSER_ERRORS.append(f"{page.url}: {m.text}"))
    return page


def watch(page, until, timeout: float, what: str) -> list[tuple[str, str]]:
    """(phase, step) as the page shows them, polled until `until(phase)`."""
    seen: list[tuple[str, str]] = []

    def shown() -> bool:
        phase = page.locator("#phase").inner_text()
        step = page.locator(".steps li.now").all_inner_texts()
        now = (phase, step[0] if step else "")
        if not seen or seen[-1] != now:
            seen.append(now)
        return until(phase)

    try:
        wait_for(shown, timeout, what, 0.25)
    except AssertionError as err:
        raise AssertionError(f"{err}; saw {seen}") from None
    return seen
