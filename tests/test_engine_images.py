"""Fleet's images of the foreign engines (deploy/images/engines): each is the engine's official
image pinned by a release tag (or a digest), adds a non-root user and nothing secret, lints
clean with hadolint, and is the image the Kubernetes runtime runs by default for its engine.
Parsed with BuildKit's parser (the `dockerfile` package); docker cannot build here, so
whether the pinned tags pull and start is for a machine with docker and a GPU
(docs/engines.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest

from fleet_base.kube_config import ENGINE_IMAGES

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ROOT / "deploy" / "images" / "engines"
OFFICIAL = {
    "vllm": r"vllm/vllm-openai:v\d+\.\d+\.\d+",
    "sglang": r"lmsysorg/sglang:v\d+\.\d+\.\d+(\.post\d+)?-cu\d+",
    "llama-cpp": r"ghcr\.io/ggml-org/llama\.cpp:server-cuda\d*-b\d+",
}
SECRET_WORDS = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY|ACCESS_KEY|PRIVATE)", re.IGNORECASE)


def parsed(name: str) -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(ENGINES / f"{name}.Dockerfile"))


def default_args(cmds: tuple[dockerfile.Command, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for c in cmds:
        if c.cmd == "ARG" and "=" in c.value[0]:
            key, value = c.value[0].split("=", 1)
            out.setdefault(key, value)
    return out


def test_one_image_per_foreign_engine() -> None:
    assert sorted(p.stem for p in ENGINES.glob("*.Dockerfile")) == sorted(OFFICIAL)
    assert {name.replace(".", "-") for name in ENGINE_IMAGES} == set(OFFICIAL)


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_built_on_the_official_image_pinned(name: str) -> None:
    cmds = parsed(name)
    args = default_args(cmds)
    froms = [c for c in cmds if c.cmd == "FROM"]
    assert len(froms) == 1, "the official image plus a layer, no build stage"
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0].value[0])
    assert re.fullmatch(OFFICIAL[name] + r"(@sha256:[0-9a-f]{64})?", image), image
    assert "latest" not in image


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_non_root_no_secrets_and_labelled(name: str) -> None:
    cmds = parsed(name)
    users = [c.value[0] for c in cmds if c.cmd == "USER"]
    assert users and users[-1] == "10001:10001"  # the pod's runAsUser (agent/runtime/kube_pod.UID)
    for c in cmds:
        if c.cmd in ("ENV", "ARG", "LABEL"):
            assert not SECRET_WORDS.search(" ".join(c.value)), c.original
        assert c.cmd not in ("COPY", "ADD"), "nothing of ours or the builder's goes in"
    (label,) = [c.value for c in cmds if c.cmd == "LABEL"]
    labels = {k: v.strip('"') for k, v in zip(label[::2], label[1::2], strict=True)}
    assert labels["dev.fleet.engine"] == {"llama-cpp": "llama.cpp"}.get(name, name)
    assert labels["org.opencontainers.image.title"] == f"fleet-{name}"
    assert "mkdir -p /models" in " ".join(" ".join(c.value) for c in cmds if c.cmd == "RUN")


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_default_engine_image_names_this_dockerfile(name: str) -> None:
    engine = {"llama-cpp": "llama.cpp"}.get(name, name)
    version = default_args(parsed(name))["FLEET_VERSION"]
    assert ENGINE_IMAGES[engine] == f"ghcr.io/fleet-llm/fleet-{name}:{version}"  # type: ignore[index]


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_lints_clean(name: str) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run(
        [
            hadolint,
            "--config",
            str(ROOT / "deploy/images/.hadolint.yaml"),
            str(ENGINES / f"{name}.Dockerfile"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
