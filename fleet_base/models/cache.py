"""The node's model cache: content-addressed, verified, single-flight, atomic, bounded.

Layout under the root (`FLEET_MODEL_CACHE`, default `$FLEET_HOME/models`):
- `blobs/sha256/<hex>`: each verified file once, named by its sha256;
- `models/<key>/`: a model as the engine loads it (hard links to blobs) with
  `.fleet-manifest.json` written last: a directory without it does not exist for readers;
- `refs/<key>`: a mutable name (hf `@main`, an OCI tag) -> the key of the pinned entry;
- `partial/<key>/`: downloads in progress, kept on failure so the next pull resumes;
- `locks/<key>.lock`: held while a model is pulled, so two replicas (or processes) on one
  node pull it once: the second waits, then finds it cached;
- `pins/<holder>.json`: the URIs a holder (the agent, for its replicas' models and LoRA
  adapters) uses now; eviction in every process keeps them.

A cached entry is used without asking the store again (offline starts); pulling again
after `remove` refreshes it. The size bound evicts least recently used models that no
caller names as in use and no pin holds, and a pull that cannot fit fails with `DiskFull`
before it starts.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from pydantic import BaseModel, ValidationError

from fleet_base.models.errors import ChecksumMismatch, DiskFull, ModelStoreError
from fleet_base.models.schemes import source_for
from fleet_base.models.source import Listing, RemoteFile, Source
from fleet_base.models.verify import check_file

log = logging.getLogger(__name__)

ENV_DIR = "FLEET_MODEL_CACHE"
ENV_MAX_BYTES = "FLEET_MODEL_CACHE_MAX_BYTES"
MANIFEST = ".fleet-manifest.json"
LAST_USED = ".fleet-last-used"
PINS = "pins"
_HOLDER = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
PullProgress = Callable[[int, int], None]  # (bytes done, bytes in all)


def default_cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    home = os.environ.get("FLEET_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".fleet") / "models"


def default_max_bytes() -> int | None:
    raw = os.environ.get(ENV_MAX_BYTES, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


class CachedFile(BaseModel):
    name: str
    size: int
    sha256: str


class CacheEntry(BaseModel):
    """A complete model in the cache (`.fleet-manifest.json`)."""

    uri: str  # as first asked for (canonical)
    pinned_uri: str  # what the store pinned it to (hf commit); equal to uri otherwise
    key: str
    files: list[CachedFile]
    size_bytes: int
    pulled_at: float
    pull_s: float
    last_used: float = 0.0


@dataclass(frozen=True)
class PullResult:
    entry: CacheEntry
    downloaded: bool  # False: it was cached already (or another process pulled it meanwhile)
    bytes_fetched: int = 0


def cache_key(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _part_name(name: str) -> str:
    return name.replace("/", "%2F") + ".part"


class ModelCache:
    def __init__(
        self, root: Path | str | None = None, max_bytes: int | None = None, workers: int = 4
    ) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.max_bytes = max_bytes if max_bytes is not None else default_max_bytes()
        self.workers = max(1, workers)

    def _make_dirs(self) -> None:
        for sub in ("blobs/sha256", "models", "refs", "partial", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # ----------------------------------------------------------------- reading

    def _dir(self, key: str) -> Path:
        return self.root / "models" / key

    def _read(self, key: str) -> CacheEntry | None:
        d = self._dir(key)
        try:
            entry = CacheEntry.model_validate_json((d / MANIFEST).read_bytes())
        except (FileNotFoundError, NotADirectoryError, ValidationError, ValueError):
            return None
        try:
            entry.last_used = (d / LAST_USED).stat().st_mtime
        except FileNotFoundError:
            entry.last_used = entry.pulled_at
        return entry

    def _resolve_key(self, canonical: str) -> str:
        key = cache_key(canonical)
        if (self._dir(key) / MANIFEST).is_file():
            return key
        try:
            return (self.root / "refs" / key).read_text().strip() or key
        except FileNotFoundError:
            return key

    def lookup(self, uri: str) -> CacheEntry | None:
        """The complete cached entry for `uri`, or None (never touches the network)."""
        return self._read(self._resolve_key(source_for(uri).canonical))

    def model_dir(self, entry: CacheEntry) -> Path:
        return self._dir(entry.key)

    def touch(self, entry: CacheEntry) -> None:
        """Mark `entry` used now (LRU); a read-only cache (a volume mounted into a pod) stays as it is."""
        try:
            with open(self._dir(entry.key) / LAST_USED, "a"):
                pass
            os.utime(self._dir(entry.key) / LAST_USED)
        except OSError:
            pass

    def entries(self) -> list[CacheEntry]:
        models = self.root / "models"
        if not models.is_dir():
            return []
        found = (self._read(d.name) for d in models.iterdir() if not d.name.startswith("."))
        return sorted((e for e in found if e is not None), key=lambda e: e.uri)

    def size_bytes(self) -> int:
        """Bytes on disk: unique blobs plus partial downloads."""
        total = 0
        for sub in ("blobs/sha256", "partial"):
            for path in (self.root / sub).rglob("*"):
                if path.is_file():
                    total += path.stat().st_size
        return total

    # ----------------------------------------------------------------- pulling

    def pull(
        self,
        uri: str,
        progress: PullProgress | None = None,
        in_use: Iterable[str] = (),
        refresh: bool = False,
    ) -> PullResult:
        """`uri` in the cache, downloading what is missing; single-flight across processes.
        `in_use`: URIs eviction must keep (the models replicas here use)."""
        in_use = list(in_use)
        source = source_for(uri)
        canonical = source.canonical
        if not refresh and (entry := self.lookup(canonical)) is not None:
            self.touch(entry)
            return PullResult(entry, downloaded=False)
        key = cache_key(canonical)
        self._make_dirs()
        with FileLock(str(self.root / "locks" / f"{key}.lock")):
            if not refresh and (entry := self.lookup(canonical)) is not None:
                self.touch(entry)  # another process pulled it while we waited
                return PullResult(entry, downloaded=False)
            t0 = time.monotonic()
            listing = source.listing()
            pinned = source.pinned_uri(listing)
            pkey = cache_key(pinned)
            existing = self._read(pkey)
            if existing is not None and not refresh:
                self._write_ref(key, pkey)
                self.touch(existing)
                return PullResult(existing, downloaded=False)
            fetched, shas = self._download(source, listing, pkey, progress, in_use)
            entry = self._commit(canonical, pinned, pkey, listing, shas, time.monotonic() - t0)
            if pkey != key:
                self._write_ref(key, pkey)
        log.info("pulled %s (%d bytes fetched, %.1f s)", canonical, fetched, entry.pull_s)
        self.enforce_bound(in_use=[canonical, *in_use])
        return PullResult(entry, downloaded=True, bytes_fetched=fetched)

    def _download(
        self,
        source: Source,
        listing: Listing,
        pkey: str,
        progress: PullProgress | None,
        in_use: Iterable[str],
    ) -> tuple[int, dict[str, str]]:
        """Fetch and verify what is missing, in parallel; (bytes fetched, file name -> sha256)."""
        partial = self.root / "partial" / pkey
        partial.mkdir(parents=True, exist_ok=True)
        todo: list[RemoteFile] = []
        shas: dict[str, str] = {}
        done = 0
        for f in listing.files:
            if f.digest.startswith("sha256:") and self._blob(f.digest[7:]).is_file():
                shas[f.name] = f.digest[7:]
                done += f.size  # the same bytes are cached under another model: share them
                continue
            todo.append(f)
            part = partial / _part_name(f.name)
            done += min(part.stat().st_size, f.size) if part.is_file() else 0
        total = sum(f.size for f in listing.files)
        self.make_room(total - done, keep=in_use)
        lock = threading.Lock()
        state = {"done": done, "fetched": 0}

        def advance(n: int) -> None:
            with lock:
                state["done"] += n
                state["fetched"] += n
                if progress is not None:
                    progress(min(state["done"], total), total)

        if progress is not None:
            progress(done, total)

        def one(f: RemoteFile) -> None:
            part = partial / _part_name(f.name)
            source.fetch(f, part, advance)
            try:
                sha = check_file(part, f)
            except ChecksumMismatch:
                part.unlink(missing_ok=True)
                raise
            shas[f.name] = sha
            blob = self._blob(sha)
            if blob.is_file():
                part.unlink()
            else:
                os.replace(part, blob)
                os.chmod(blob, 0o444)

        try:
            with ThreadPoolExecutor(max_workers=min(self.workers, max(1, len(todo)))) as pool:
                for future in [pool.submit(one, f) for f in todo]:
                    future.result()
        except OSError as err:
            if err.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.root).free
                raise DiskFull(
                    f"the disk under {self.root} filled up ({free} bytes free); the download resumes later"
                ) from err
            raise ModelStoreError(f"writing the cache failed: {err}") from err
        return state["fetched"], shas

    def _blob(self, sha256: str) -> Path:
        return self.root / "blobs" / "sha256" / sha256

    def _commit(
        self, uri: str, pinned: str, pkey: str, listing: Listing, shas: dict[str, str], pull_s: float
    ) -> CacheEntry:
        """Link the verified blobs into a model directory and publish it with one rename."""
        files = []
        tmp = self.root / "models" / f".tmp-{pkey}-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for f in listing.files:
            sha = shas[f.name]
            dest = tmp / f.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.link(self._blob(sha), dest)
            files.append(CachedFile(name=f.name, size=f.size, sha256=sha))
        entry = CacheEntry(
            uri=uri,
            pinned_uri=pinned,
            key=pkey,
            files=files,
            size_bytes=sum(f.size for f in files),
            pulled_at=time.time(),
            pull_s=round(pull_s, 3),
        )
        (tmp / MANIFEST).write_text(entry.model_dump_json(indent=1))
        final = self._dir(pkey)
        if final.exists():  # a refresh, or a directory left without its manifest
            shutil.rmtree(final)
        os.rename(tmp, final)
        shutil.rmtree(self.root / "partial" / pkey, ignore_errors=True)
        self.touch(entry)
        return entry

    def _write_ref(self, key: str, pkey: str) -> None:
        tmp = self.root / "refs" / f".{key}.{os.getpid()}"
        tmp.write_text(pkey)
        os.replace(tmp, self.root / "refs" / key)

    # ----------------------------------------------------------------- pins

    def pin(self, holder: str, uris: Iterable[str]) -> bool:
        """Record the URIs `holder` uses now (replacing what it said before): no process
        evicts them while the pin stands. False when the cache cannot be written (a
        read-only mount: nothing there is evicted anyway)."""
        if not _HOLDER.match(holder):
            raise ValueError(f"pin holder {holder!r} is not a plain name")
        d = self.root / PINS
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{holder}.{os.getpid()}.{threading.get_ident()}"
            tmp.write_text(json.dumps(sorted(set(uris))))
            os.replace(tmp, d / f"{holder}.json")
        except OSError as err:
            log.warning("cannot pin the models %s uses in %s: %s", holder, d, err)
            return False
        return True

    def pinned(self) -> set[str]:
        """Every URI some holder pins."""
        out: set[str] = set()
        try:
            pins = list((self.root / PINS).glob("*.json"))
        except OSError:
            return out
        for path in pins:
            try:
                uris = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(uris, list):
                out.update(u for u in uris if isinstance(u, str))
        return out

    # ----------------------------------------------------------------- eviction

    def _keep_keys(self, keep: Iterable[str]) -> set[str]:
        keys = set()
        for uri in keep:
            try:
                keys.add(self._resolve_key(source_for(uri).canonical))
            except ModelStoreError:
                continue
        return keys

    def make_room(self, need: int, keep: Iterable[str] = ()) -> None:
        """Evict least recently used entries not in `keep` until `need` more bytes fit."""
        if need <= 0:
            return
        if self.max_bytes is not None:
            if need > self.max_bytes:
                raise DiskFull(f"the model needs {need} bytes; the cache is bounded at {self.max_bytes}")
            self._evict_until(lambda: self.size_bytes() + need <= self.max_bytes, keep)  # type: ignore[operator]
            if self.size_bytes() + need > self.max_bytes:
                raise DiskFull(
                    f"the model needs {need} bytes; the cache holds {self.size_bytes()} of {self.max_bytes} "
                    "in models that replicas use"
                )
        self._evict_until(lambda: shutil.disk_usage(self.root).free > need, keep)
        free = shutil.disk_usage(self.root).free
        if free <= need:
            raise DiskFull(f"the model needs {need} bytes; {free} bytes are free under {self.root}")

    def enforce_bound(self, in_use: Iterable[str] = ()) -> list[str]:
        if self.max_bytes is None:
            return []
        return self._evict_until(lambda: self.size_bytes() <= self.max_bytes, in_use)  # type: ignore[operator]

    def _evict_until(self, enough: Callable[[], bool], keep: Iterable[str]) -> list[str]:
        kept = self._keep_keys([*keep, *self.pinned()])
        evicted = []
        for entry in sorted(self.entries(), key=lambda e: e.last_used):
            if enough():
                break
            if entry.key in kept:
                continue
            self._delete(entry)
            evicted.append(entry.uri)
            log.info(
                "evicted %s from the model cache (last used %.0f s ago)",
                entry.uri,
                time.time() - entry.last_used,
            )
        return evicted

    def remove(self, uri: str) -> CacheEntry | None:
        """Delete `uri`'s entry (and blobs nothing else links); the entry removed, or None."""
        entry = self.lookup(uri)
        if entry is not None:
            with FileLock(str(self.root / "locks" / f"{entry.key}.lock")):
                self._delete(entry)
        return entry

    def _delete(self, entry: CacheEntry) -> None:
        d = self._dir(entry.key)
        trash = self.root / "models" / f".trash-{entry.key}-{os.getpid()}"
        if d.exists():
            os.rename(d, trash)  # readers stop seeing it at once
            shutil.rmtree(trash, ignore_errors=True)
        for ref in (self.root / "refs").iterdir():
            if ref.is_file() and ref.read_text().strip() == entry.key:
                ref.unlink(missing_ok=True)
        for blob in (self.root / "blobs" / "sha256").iterdir():
            if blob.stat().st_nlink <= 1:
                blob.unlink(missing_ok=True)
