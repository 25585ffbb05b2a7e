"""The platform (control plane, agent, gateway, fleetctl) installs and imports without
torch, and deploy/images builds it that way: Dockerfiles parsed with BuildKit's parser
(the `dockerfile` package), linted with hadolint, and checked for what we promise
(multi-stage, pinned bases, build args for versions, non-root). Docker itself cannot run
here; docs/kubernetes.md says what a real build adds."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "deploy" / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
ENGINE_ONLY = ("torch", "triton", "transformers", "safetensors", "accelerate")
CLI_ONLY = ("typer", "rich", "matplotlib")
SERVICE_MODULES = [
    "control_plane.server",
    "control_plane.api.app",
    "agent.daemon",
    "agent.gateway.app",
    "agent.runtime.kubernetes",
]
PLATFORM_MODULES = [
    "control_plane.cli",
    "control_plane.server",
    "control_plane.api.app",
    "control_plane.commands.db",
    "agent.__main__",
    "agent.daemon",
    "agent.gateway.__main__",
    "agent.gateway.app",
    "agent.runtime.kubernetes",
    "agent.runtime.process",
]
BLOCKING = """
import importlib, importlib.abc, sys
blocked = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(name + " is not installed")
sys.meta_path.insert(0, Block())
for m in sys.argv[2:]:
    importlib.import_module(m)
print("imported", len(sys.argv) - 2)
"""


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_base_and_cli_install_need_no_torch() -> None:
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    assert not names(project["dependencies"]) & set(ENGINE_ONLY + CLI_ONLY)
    assert names(extras["cli"]) == set(CLI_ONLY)
    assert "torch==2.13.0" in extras["engine"]
    assert "fleet[engine,cli]" in extras["dev"]  # `pip install -e ".[dev]"` installs everything


def _fresh_python(code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c code args` with only the repository on the path (no inherited environment)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    ("blocked", "modules"),
    [(ENGINE_ONLY, PLATFORM_MODULES), (ENGINE_ONLY + CLI_ONLY, SERVICE_MODULES)],
    ids=["cli-install", "base-install"],
)
def test_platform_modules_import_without_torch(blocked, modules) -> None:
    out = _fresh_python(BLOCKING, ",".join(blocked), *modules)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"imported {len(modules)}" in out.stdout


LOADED_HEAVY = """
import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
print("heavy:", sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "triton")))
"""


@pytest.mark.parametrize("module", ["agent.gateway.app", "control_plane.api.app", "control_plane.server"])
def test_app_import_loads_neither_torch_nor_triton(module: str) -> None:
    """With torch installed (nothing blocked), importing the app must not load it: the
    layering rule checked on what actually runs, not on the import graph alone."""
    out = _fresh_python(LOADED_HEAVY, module)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "heavy: []" in out.stdout, out.stdout


def stages(path: Path) -> list[list[dockerfile.Command]]:
    out: list[list[dockerfile.Command]] = []
    for cmd in dockerfile.parse_file(str(path)):
        if cmd.cmd == "FROM":
            out.append([])
        if out:
            out[-1].append(cmd)
    return out


def test_three_images() -> None:
    assert [p.name for p in DOCKERFILES] == [
        "engine-cpu.Dockerfile",
        "engine-cuda.Dockerfile",
        "platform.Dockerfile",
    ]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(path: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run(
        [hadolint, "--config", str(IMAGES / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multistage_pinned_non_root(path: Path) -> None:
    parsed = dockerfile.parse_file(str(path))
    args = {}
    for cmd in parsed:
        if cmd.cmd == "ARG" and "=" in cmd.value[0]:
            key, value = cmd.value[0].split("=", 1)
            args.setdefault(key, value)
    froms = [c for c in parsed if c.cmd == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    for c in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], c.value[0])
        assert re.search(r":\d+(\.\d+)+", image) and "latest" not in image, image
    final = stages(path)[-1]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0
    assert {"FLEET_VERSION"} <= set(args)
    for cmd in parsed:
        if cmd.cmd == "COPY" and not any(f.startswith("--from") for f in cmd.flags):
            for src in cmd.value[:-1]:
                assert (ROOT / src).exists(), f"{path.name}: COPY {src} is not in the repository"
    text = path.read_text()
    if path.name == "platform.Dockerfile":
        assert 'pip install -e ".[cli]"' in text and "torch==" not in text
    else:
        assert args["TORCH_VERSION"] == "2.13.0" and 'pip install -e ".[engine]"' in text


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "**/__pycache__"} <= set(ignored)
    for needed in (
        "agent",
        "control_plane",
        "engine",
        "kernels",
        "fleet_base",
        "migrations",
        "pyproject.toml",
        "README.md",
    ):
        assert needed not in ignored


def test_our_kernels_layer_is_the_only_kernels_package() -> None:
    """Hugging Face ships a `kernels` distribution (transformers >= 5.25 requires it) under
    the same import name as our layer; installed beside us, transformers imports ours."""
    import importlib.metadata

    owners = set(importlib.metadata.packages_distributions().get("kernels", []))
    assert owners <= {"fleet"}, f"another distribution installs a top-level 'kernels': {owners}"
    extras = pyproject()["project"]["optional-dependencies"]
    bounded = [r for r in extras["engine"] if r.startswith("transformers")]
    assert bounded and "<5.25" in bounded[0]
