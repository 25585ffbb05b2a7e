"""Size-bounded replica logs, rotated by copy and truncate.

A process replica writes stdout and stderr straight into `logs/<replica_id>.log`, opened
for appending, so it outlives an agent killed with SIGKILL (a pipe read by the agent
would break with it). The agent therefore rotates the way `logrotate`'s copytruncate
does: once the file is over `max_bytes` it shifts `.1` .. `.N-1` up, copies the file to
`.1` and truncates it; the replica's next write lands at the new end, because its file
was opened O_APPEND. Lines written between the copy and the truncation are lost, a
price worth a disk that cannot fill. When the copy itself fails (a full disk) the
file is truncated anyway: old log lines go before the state files do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)


def backup(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def rotate_if_large(path: str | Path, max_bytes: int, backups: int) -> bool:
    """Rotate `path` when it holds more than `max_bytes`, keeping `backups` copies; True
    when it rotated. Never raises for a missing or unwritable file."""
    path = Path(path)
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except OSError:
        return False
    if backups > 0:
        with contextlib.suppress(FileNotFoundError):
            backup(path, backups).unlink()
        for n in range(backups - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(backup(path, n), backup(path, n + 1))
        try:
            shutil.copyfile(path, backup(path, 1))
        except OSError as err:
            log.warning("could not keep a copy of %s before truncating it: %s", path, err)
            with contextlib.suppress(OSError):
                backup(path, 1).unlink()
    try:
        os.truncate(path, 0)
        with open(path, "ab") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} log rotated\n".encode())
    except OSError as err:
        log.warning("could not truncate %s: %s", path, err)
        return False
    return True
