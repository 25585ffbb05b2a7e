"""`--weights auto`'s measured plan, kept on disk per machine and model shape.

Timing the formats costs seconds at every load (most of auto's load-time cost), yet its
answer depends only on the CPU, the core count, torch's kernels and the weight shapes. So the
first load on a machine measures and writes the plan here; later loads (every replica start,
every engine process) read it. The key covers everything the answer depends on; delete the
file (or the directory) to measure again, e.g. after measuring on a box that was busy.

Root: `FLEET_WEIGHTS_PLAN_CACHE` (default `~/.cache/fleet/weights-plan`); `off` disables it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "FLEET_WEIGHTS_PLAN_CACHE"


def cache_root() -> Path | None:
    env = os.environ.get(ENV)
    if env is not None and env.strip().lower() in ("off", "0", "none", ""):
        return None
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fleet" / "weights-plan"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(shape_key: Any) -> str:
    """A stable name for (this CPU, its cores, this torch, these shapes and thread counts)."""
    ident = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "shapes": repr(shape_key),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def load(key: str) -> dict | None:
    root = cache_root()
    if root is None:
        return None
    path = root / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # a torn or foreign file: measure again
        log.warning("ignoring unreadable weights plan %s: %s", path, exc)
        return None


def store(key: str, record: dict) -> None:
    """Atomic (write then rename), so concurrent replica starts never read half a file."""
    root = cache_root()
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(tmp, root / f"{key}.json")
    except OSError as exc:  # a read-only home must not stop the engine
        log.warning("could not keep the weights plan under %s: %s", root, exc)
