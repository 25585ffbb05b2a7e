"""Fixtures: a real S3-compatible server (moto's, over HTTP), the local hub endpoint, a
real OCI registry (docker-distribution, `scripts/oci-registry.sh` installs it), and an
empty model cache per test."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_base.models import ModelCache
from fleet_base.processes import stop_process
from tests.fleet_base.models.servers import free_port, wait_listening, write_registry_config

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto's S3 server on a free port; `stop()` takes it away (an outage)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        wait_listening(self.port)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, **_creds())

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _creds() -> dict[str, str]:
    return {
        "aws_access_key_id": AWS_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": AWS_ENV["AWS_DEFAULT_REGION"],
    }


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    pytest.importorskip("moto.server")
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def s3(s3_server: S3Server, monkeypatch) -> S3Server:
    """The module's S3 server, emptied (moto's reset API), with this process's AWS env
    pointing at it. A test that stops it gets a new one in the next test."""
    import httpx

    if s3_server._server is None:
        s3_server.__init__()
    httpx.post(f"{s3_server.url}/moto-api/reset", timeout=10).raise_for_status()
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch) -> ModelCache:
    root = tmp_path / "model-cache"
    monkeypatch.setenv("FLEET_MODEL_CACHE", str(root))
    return ModelCache(root)


def registry_binary() -> str | None:
    return shutil.which("docker-registry") or shutil.which("registry")


@pytest.fixture()
def oci_registry(tmp_path: Path) -> Iterator[str]:
    binary = registry_binary()
    if binary is None:
        if os.environ.get("FLEET_REQUIRE_OCI_REGISTRY"):
            pytest.fail("no docker-registry binary; run scripts/oci-registry.sh")
        pytest.skip("no OCI registry binary (docker-registry); scripts/oci-registry.sh installs it")
    port = free_port()
    cfg = write_registry_config(tmp_path / "registry", port)
    proc = subprocess.Popen([binary, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc, 10)
