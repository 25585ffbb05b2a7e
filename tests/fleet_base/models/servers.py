"""Real local servers for the model-store tests.

- `serve(app)`: an ASGI app on a real socket (uvicorn in a thread) at 127.0.0.1:<free port>.
- `FileServer`: plain HTTP files with `Range`, counting requests; it can cut a response
  off after some bytes (an interrupted download) or send slowly (concurrent pulls).
- `HubServer`: a local endpoint serving files in the Hugging Face Hub's HTTP shape (the
  model-info API and `resolve/<revision>/<file>` with `X-Repo-Commit`, `ETag`,
  `X-Linked-Size`), so the real `huggingface_hub` client talks to it through `HF_ENDPOINT`.
  It is a test server written here, not the Hub: the behaviour under test is ours and
  the client's, and the Hub itself cannot be reached from this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleet_base.ports import free_port, wait_port
from tests.polling import wait_for


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "the test server", 0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _range(request: Request, size: int) -> int:
    header = request.headers.get("range", "")
    if header.startswith("bytes=") and header[6:].endswith("-"):
        return int(header[6:-1])
    return 0


def file_response(
    request: Request,
    data: bytes,
    headers: dict[str, str],
    *,
    cut_after: int | None = None,
    delay_s: float = 0.0,
) -> Response:
    start = _range(request, len(data))
    body = data[start:]
    status = 206 if start else 200
    headers = {**headers, "Content-Length": str(len(body)), "Accept-Ranges": "bytes"}
    if start:
        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
    if request.method == "HEAD":
        return Response(status_code=200, headers={**headers, "Content-Length": str(len(data))})

    async def chunks():
        sent = 0
        for i in range(0, len(body), 64 * 1024):
            piece = body[i : i + 64 * 1024]
            if cut_after is not None and sent + len(piece) > cut_after:
                yield piece[: cut_after - sent]
                raise ConnectionResetError("the test server cuts the download off")
            sent += len(piece)
            yield piece
            if delay_s:
                await asyncio.sleep(delay_s)

    return StreamingResponse(chunks(), status_code=status, headers=headers)


@dataclass
class FileServer:
    files: dict[str, bytes]
    cut_first_get_after: int | None = None
    delay_s: float = 0.0
    gets: list[str] = field(default_factory=list)  # the Range header of each GET ("" for none)

    def app(self) -> Starlette:
        async def handle(request: Request) -> Response:
            name = request.path_params["name"]
            if name not in self.files:
                return Response(status_code=404)
            cut = None
            if request.method == "GET":
                self.gets.append(request.headers.get("range", ""))
                if len(self.gets) == 1:
                    cut = self.cut_first_get_after
            return file_response(request, self.files[name], {}, cut_after=cut, delay_s=self.delay_s)

        return Starlette(routes=[Route("/{name:path}", handle, methods=["GET", "HEAD"])])


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class HubServer:
    """repo id -> {file name -> bytes}; files of `lfs_min` bytes or more are LFS files."""

    repos: dict[str, dict[str, bytes]]
    token: str | None = None
    lfs_min: int = 1024
    corrupt: set[str] = field(default_factory=set)  # files served with flipped bytes
    gets: list[str] = field(default_factory=list)

    def commit(self, repo: str) -> str:
        h = hashlib.sha1(repo.encode())
        for name, data in sorted(self.repos[repo].items()):
            h.update(name.encode() + hashlib.sha256(data).digest())
        return h.hexdigest()

    def _denied(self, request: Request) -> Response | None:
        if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            return JSONResponse({"error": "Invalid credentials in Authorization header"}, status_code=401)
        return None

    def _repo(self, request: Request) -> tuple[str, Response | None]:
        repo = f"{request.path_params['org']}/{request.path_params['repo']}"
        if repo not in self.repos:
            return repo, JSONResponse(
                {"error": "Repository not found"}, status_code=404, headers={"X-Error-Code": "RepoNotFound"}
            )
        rev = request.path_params["rev"]
        if rev not in ("main", self.commit(repo)):
            return repo, JSONResponse(
                {"error": "Revision not found"}, status_code=404, headers={"X-Error-Code": "RevisionNotFound"}
            )
        return repo, None

    def app(self) -> Starlette:
        async def info(request: Request) -> Response:
            if (denied := self._denied(request)) is not None:
                return denied
            repo, missing = self._repo(request)
            if missing is not None:
                return missing
            siblings = []
            for name, data in sorted(self.repos[repo].items()):
                s = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
                if len(data) >= self.lfs_min:
                    s["lfs"] = {
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "pointerSize": 134,
                    }
                siblings.append(s)
            return JSONResponse(
                {
                    "id": repo,
                    "modelId": repo,
                    "sha": self.commit(repo),
                    "siblings": siblings,
                    "private": False,
                    "tags": [],
                }
            )

        async def resolve(request: Request) -> Response:
            if (denied := self._denied(request)) is not None:
                return denied
            repo, missing = self._repo(request)
            if missing is not None:
                return missing
            name = request.path_params["path"]
            data = self.repos[repo].get(name)
            if data is None:
                return JSONResponse(
                    {"error": "Entry not found"}, status_code=404, headers={"X-Error-Code": "EntryNotFound"}
                )
            etag = hashlib.sha256(data).hexdigest() if len(data) >= self.lfs_min else git_blob_sha1(data)
            headers = {"X-Repo-Commit": self.commit(repo), "ETag": f'"{etag}"'}
            if len(data) >= self.lfs_min:
                headers["X-Linked-Etag"] = f'"{etag}"'
                headers["X-Linked-Size"] = str(len(data))
            if request.method == "GET":
                self.gets.append(name)
            if name in self.corrupt:
                data = bytes(b ^ 0xFF for b in data)
            return file_response(request, data, headers)

        return Starlette(
            routes=[
                Route("/api/models/{org}/{repo}/revision/{rev}", info, methods=["GET"]),
                Route("/{org}/{repo}/resolve/{rev}/{path:path}", resolve, methods=["GET", "HEAD"]),
            ]
        )


def wait_listening(port: int, timeout: float = 20.0) -> None:
    """`wait_port` on loopback that raises: a test server that never listens is a setup error."""
    if not wait_port("127.0.0.1", port, timeout):
        raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def write_registry_config(root: Path, port: int) -> Path:
    """A docker-distribution config: filesystem storage under `root`, HTTP on 127.0.0.1."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "config.yml"
    cfg.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    return cfg
