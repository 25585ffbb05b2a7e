"""`python -m engine.server --model s3://...` on its own (no agent): the server pulls the
model into the cache while /health says loading, serves it, and reports the parts of its
cold start in `fleet_engine_startup_seconds`. A tiny random Llama keeps it quick."""

from __future__ import annotations

import httpx

from engine.server.process import ServerProcess
from fleet_base.models import ModelCache
from tests.agent.conftest import make_tiny_model_dir


def test_engine_server_pulls_an_s3_prefix_and_serves_it(s3, cache: ModelCache, tmp_path) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    client = s3.client()
    client.create_bucket(Bucket="models")
    for f in model.iterdir():
        client.upload_file(str(f), "models", f"tiny/{f.name}")
    args = [
        "--served-model-name",
        "tiny",
        "--threads",
        "1",
        "--kv-cache-memory",
        "2MiB",
        "--max-model-len",
        "128",
    ]
    with ServerProcess(*args, model="s3://models/tiny/", log_path=tmp_path / "engine.log") as server:
        assert 503 in server.health_codes  # listening (loading) before the model was there
        r = httpx.post(
            f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{server.url}/metrics").text
    for phase in ("pull", "load", "warmup", "first_token"):
        assert f'fleet_engine_startup_seconds{{model="tiny",phase="{phase}"}}' in metrics, phase
    entry = cache.lookup("s3://models/tiny/")
    assert entry is not None and {f.name for f in entry.files} >= {"config.json", "model.safetensors"}
