"""`fleetctl` as a user runs it: `python -m control_plane.cli` in a child process against the
fleet whose state lives in `home` (FLEET_HOME); a caller's FLEET_API_URL and FLEET_TOKEN never
leak in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def fleetctl(
    home: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """The finished command; `check` turns a non-zero exit into an AssertionError with its output."""
    full_env = {**os.environ, "FLEET_HOME": str(home), "PYTHONPATH": str(ROOT)}
    for name in ("FLEET_API_URL", "FLEET_TOKEN"):
        full_env.pop(name, None)
    full_env.update(env or {})
    result = subprocess.run(
        [sys.executable, "-m", "control_plane.cli", *args],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"fleetctl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def fleetctl_json(home: Path, *args: str, **kwargs: Any) -> Any:
    """The command's `-o json` output, parsed."""
    return json.loads(fleetctl(home, *args, "-o", "json", **kwargs).stdout)
