"""s3:// against moto's S3 server over real HTTP: pulls, prefixes, multipart ETags,
resume of an interrupted download, the size bound, bad input. (Single flight across
processes is the cache's, whatever the scheme: test_https_hf.py counts the GETs.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleet_base.models import DiskFull, MissingObject, ModelCache, NoCredentials
from fleet_base.models.cache import _part_name, cache_key

ROOT = Path(__file__).resolve().parents[3]


def _bucket(s3, name="models"):
    client = s3.client()
    client.create_bucket(Bucket=name)
    return client


def test_pull_one_object_then_serve_it_offline(s3, cache: ModelCache) -> None:
    data = os.urandom(300_000)
    _bucket(s3).put_object(Bucket="models", Key="smol/model.gguf", Body=data)
    seen: list[tuple[int, int]] = []
    result = cache.pull("s3://models/smol/model.gguf", progress=lambda d, t: seen.append((d, t)))
    assert result.downloaded and result.bytes_fetched == len(data)
    assert seen[-1] == (len(data), len(data))
    path = cache.model_dir(result.entry) / "model.gguf"
    assert path.read_bytes() == data
    s3.stop()  # the store goes away: the cache still answers, without the network
    again = cache.pull("s3://models/smol/model.gguf")
    assert not again.downloaded and again.entry.key == result.entry.key


def test_prefix_pulls_every_object_and_multipart_etag_is_verified(s3, cache: ModelCache) -> None:
    client = _bucket(s3)
    big = os.urandom(11 * 1024 * 1024)  # three parts of 5 MiB: an ETag "md5-of-md5s-3"
    up = client.create_multipart_upload(Bucket="models", Key="hf/model.safetensors")
    parts = []
    for i, start in enumerate(range(0, len(big), 5 * 1024 * 1024), start=1):
        r = client.upload_part(
            Bucket="models",
            Key="hf/model.safetensors",
            PartNumber=i,
            UploadId=up["UploadId"],
            Body=big[start : start + 5 * 1024 * 1024],
        )
        parts.append({"PartNumber": i, "ETag": r["ETag"]})
    client.complete_multipart_upload(
        Bucket="models", Key="hf/model.safetensors", UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
    )
    client.put_object(Bucket="models", Key="hf/config.json", Body=b'{"model_type": "llama"}')
    entry = cache.pull("s3://models/hf/").entry
    assert sorted(f.name for f in entry.files) == ["config.json", "model.safetensors"]
    assert (cache.model_dir(entry) / "model.safetensors").read_bytes() == big


def test_interrupted_download_resumes_with_a_range(s3, cache: ModelCache) -> None:
    data = os.urandom(2_000_000)
    client = _bucket(s3)
    client.put_object(Bucket="models", Key="m.gguf", Body=data)
    # What an interrupted pull leaves behind: the first 1.2 MB in the partial file.
    partial = cache.root / "partial" / cache_key("s3://models/m.gguf")
    partial.mkdir(parents=True)
    (partial / _part_name("m.gguf")).write_bytes(data[:1_200_000])
    result = cache.pull("s3://models/m.gguf")
    assert result.bytes_fetched == len(data) - 1_200_000  # only the rest came over the wire
    assert (cache.model_dir(result.entry) / "m.gguf").read_bytes() == data
    assert not partial.exists()


def test_missing_object_and_bucket(s3, cache: ModelCache) -> None:
    _bucket(s3)
    with pytest.raises(MissingObject):
        cache.pull("s3://models/nothing-here.gguf")
    with pytest.raises(MissingObject):
        cache.pull("s3://no-such-bucket/m.gguf")
    assert cache.entries() == []


def test_no_credentials_is_named(s3, cache: ModelCache, monkeypatch, tmp_path: Path) -> None:
    _bucket(s3).put_object(Bucket="models", Key="m.gguf", Body=b"x" * 10)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(NoCredentials, match="no AWS credentials"):
        cache.pull("s3://models/m.gguf")


def test_size_bound_evicts_the_least_recently_used_model_not_in_use(s3, tmp_path: Path) -> None:
    client = _bucket(s3)
    for name in ("a", "b", "c"):
        client.put_object(Bucket="models", Key=f"{name}.gguf", Body=os.urandom(400_000))
    cache = ModelCache(tmp_path / "c", max_bytes=1_000_000)
    cache.pull("s3://models/a.gguf")
    cache.pull("s3://models/b.gguf")
    os.utime(cache.model_dir(cache.lookup("s3://models/a.gguf")) / ".fleet-last-used", (1, 1))
    cache.pull("s3://models/c.gguf", in_use=["s3://models/a.gguf"])  # a is older but in use: b goes
    assert [e.uri for e in cache.entries()] == ["s3://models/a.gguf", "s3://models/c.gguf"]
    with pytest.raises(DiskFull, match="bounded"):
        ModelCache(tmp_path / "small", max_bytes=100_000).pull("s3://models/a.gguf")
