"""One real replica (`python -m engine.server`) shared by the API and bad-input tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.process import ServerProcess

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("engine-server") / "server.log"
    proc = ServerProcess("--max-model-len", "2048", "--max-request-bytes", "65536", log_path=log)
    with proc:
        yield proc


@pytest.fixture(scope="session")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120.0) as client:
        yield client


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    r = client.get("/metrics")
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, model: str = MODEL, **labels: str) -> float:
    key = (name, tuple(sorted({"model": model, **labels}.items())))
    assert key in samples, f"{name}{labels} missing from /metrics"
    return samples[key]
