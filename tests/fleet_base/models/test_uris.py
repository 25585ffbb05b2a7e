"""Model URI parsing (no network): every scheme's canonical form and every refusal."""

from __future__ import annotations

import hashlib

import pytest

from fleet_base.models import BadModelUri, UnknownScheme, check_model_uri, is_remote
from fleet_base.models.source import RemoteFile, safe_name
from fleet_base.models.verify import check_file

SHA = "ab" * 32


@pytest.mark.parametrize(
    ("uri", "canonical"),
    [
        ("s3://models/smol/m.gguf", "s3://models/smol/m.gguf"),
        ("s3://models/hf/", "s3://models/hf/"),
        ("hf://acme/tiny", "hf://acme/tiny@main"),
        ("hf://acme/tiny@v1.0/sub/model.gguf", "hf://acme/tiny@v1.0/sub/model.gguf"),
        ("oci://registry.example.com:5000/models/smol", "oci://registry.example.com:5000/models/smol:latest"),
        (f"oci://r.io/m/smol@sha256:{SHA}", f"oci://r.io/m/smol@sha256:{SHA}"),
        (f"https://h.example/a/m.gguf#sha256={SHA.upper()}", f"https://h.example/a/m.gguf#sha256={SHA}"),
        ("smollm2-135m", "smollm2-135m"),
        ("/models/local.gguf", "/models/local.gguf"),
    ],
)
def test_canonical(uri: str, canonical: str) -> None:
    assert check_model_uri(uri) == canonical
    assert is_remote(uri) == ("://" in uri)


@pytest.mark.parametrize(
    ("uri", "error", "text"),
    [
        ("ftp://h/m.gguf", UnknownScheme, "unknown scheme 'ftp'"),
        ("gs://b/m.gguf", UnknownScheme, "known: s3://"),
        ("https://h/m.gguf", BadModelUri, "#sha256="),
        (f"https://user:pw@h/m.gguf#sha256={SHA}", BadModelUri, "credentials"),
        (f"https://h/m.gguf?X-Amz-Signature=x#sha256={SHA}", BadModelUri, "signed URL"),
        ("s3://Bad_Bucket/m", BadModelUri, "s3://bucket"),
        ("s3://bucket", BadModelUri, "s3://bucket"),
        ("hf://just-a-name", BadModelUri, "org/repo"),
        ("hf://acme/tiny/../../etc", BadModelUri, "unsafe"),
        ("oci://r.io/Upper:tag", BadModelUri, "oci://registry"),
    ],
)
def test_refused(uri: str, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text.replace("?", r"\?").replace("+", r"\+")):
        check_model_uri(uri)


def test_unsafe_names_from_a_store_are_refused() -> None:
    for name in ("../x", "a/../../x", "/etc/passwd", "a\\b", ""):
        with pytest.raises(BadModelUri):
            safe_name(name, "s3://b/k/")
    assert safe_name("sub/model.safetensors", "s3://b/k/") == "sub/model.safetensors"


def test_store_checksums(tmp_path) -> None:
    data = bytes(range(256)) * 5000  # 1.28 MB
    path = tmp_path / "f"
    path.write_bytes(data)
    md5 = hashlib.md5(data).hexdigest()
    git = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
    part = 512 * 1024
    parts = [hashlib.md5(data[i : i + part]).digest() for i in range(0, len(data), part)]
    etag = f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"
    sha = hashlib.sha256(data).hexdigest()
    for digest, part_size in (
        (f"md5:{md5}", None),
        (f"gitsha1:{git}", None),
        (f"s3etag:{etag}", part),
        (f"sha256:{sha}", None),
    ):
        assert (
            check_file(path, RemoteFile(name="f", size=len(data), digest=digest, part_size=part_size)) == sha
        )
