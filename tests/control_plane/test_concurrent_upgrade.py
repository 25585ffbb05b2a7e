"""Instances starting together on one empty database (two Kubernetes pods at first install,
control planes started by hand) each migrate it: the upgrades take turns, and every one ends
at head without an error. Processes, as in production (Alembic's context is per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from control_plane.db.session import current_revision, head_revision

ROOT = Path(__file__).resolve().parents[2]
UPGRADE = "import sys; from control_plane.db.session import upgrade_to_head; upgrade_to_head(sys.argv[1])"


def test_concurrent_upgrades_take_turns(db_url):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UPGRADE, db_url], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    failures = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failures.append(err[-2000:])
    assert not failures, failures
    assert current_revision(db_url) == head_revision(db_url)
