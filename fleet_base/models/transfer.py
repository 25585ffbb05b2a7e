"""Moving one file's bytes from a store into the cache's partial file: where to resume, how
chunks are written, and how a store's failures become the cache's reasons."""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fleet_base.models.errors import ModelStoreError
from fleet_base.models.source import Progress, RemoteFile


def resume_offset(part: Path, file: RemoteFile) -> int:
    """Bytes already in `part`; a part longer than the file is corrupt and starts over."""
    try:
        have = part.stat().st_size
    except FileNotFoundError:
        return 0
    if have > file.size:
        part.unlink()
        return 0
    return have


@contextmanager
def store_errors(
    translate: Callable[[Exception, str], ModelStoreError],
    what: str,
    catch: type[Exception] | tuple[type[Exception], ...] = Exception,
) -> Iterator[None]:
    """A store's failures (`catch`) as the cache's reasons, by the store's `translate`; a full
    local disk (ENOSPC) passes through untranslated, for the cache to report as disk_full."""
    try:
        yield
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise
        raise translate(err, what) from err
    except catch as err:
        raise translate(err, what) from err


def write_chunks(part: Path, mode: str, chunks: Iterable[bytes], progress: Progress) -> None:
    """Write `chunks` to `part` as they come, so a cut-off download keeps every byte that came."""
    with open(part, mode) as out:
        for chunk in chunks:
            out.write(chunk)
            progress(len(chunk))
