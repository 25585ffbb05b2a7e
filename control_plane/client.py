"""A small synchronous client of the admin API for fleetctl (and tests).

Every failure becomes an `ApiError` carrying the server's one-line reason (or why the
server could not be asked), so commands can print it and exit non-zero.

It knows every control-plane instance (`client_endpoint`: FLEET_API_URL as a comma-separated
list, or the lines of $FLEET_HOME/api-url) and fails over between them, starting at the last
one that answered. Any instance serves the whole admin API, so the next one is as good. A read
(GET, HEAD, OPTIONS) moves on after a connection error, a timeout or a 502/503/504. A write
moves on only when it surely never reached a server (the connection was refused or never
established): after a timeout or a gateway error it may have been applied, and a second try
elsewhere could apply it twice (a second key, a second version), so it is reported instead.
A paused instance accepts connections and never answers: a read leaves it after
FLEET_API_TIMEOUT_S (default 30).
"""

from __future__ import annotations

from typing import Any, ClassVar

import httpx

from control_plane.settings import client_endpoint, client_timeout

PAGE = 1000
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A proxy or a draining instance: the request was not served, another instance may be able to.
RETRY_STATUSES = frozenset({502, 503, 504})


class ApiError(Exception):
    """A refused or failed call. `status` is 0 when the control plane was not reached."""

    def __init__(self, status: int, message: str, field: str | None = None, type: str = "error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.type = type

    def __str__(self) -> str:
        return self.message if self.status == 0 else f"{self.message} (HTTP {self.status})"


def _never_sent(err: httpx.HTTPError) -> bool:
    """The request cannot have reached a server: no connection was made."""
    return isinstance(err, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)


def _transport_reason(url: str, err: httpx.HTTPError) -> str:
    if isinstance(err, httpx.ConnectError):
        return f"unreachable at {url}"
    if isinstance(err, httpx.TimeoutException):
        return f"at {url} did not answer in time"
    return f"at {url}: {err}"


class FleetClient:
    # The instance that last answered, per list of URLs: later clients in this process start there.
    _last_good: ClassVar[dict[tuple[str, ...], str]] = {}

    def __init__(
        self, url: str | list[str] | None = None, token: str | None = None, timeout: float | None = None
    ) -> None:
        default_urls, default_token = client_endpoint()
        if url is None:
            urls = default_urls
        elif isinstance(url, str):
            urls = [u for u in (part.strip() for part in url.split(",")) if u]
        else:
            urls = list(url)
        self.urls = [u.rstrip("/") for u in urls] or default_urls
        self.url = self._last_good.get(tuple(self.urls), self.urls[0])
        self.token = token if token is not None else default_token
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout or client_timeout())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _order(self) -> list[str]:
        """Every URL once, the last good one first, then the rest in their listed order."""
        start = self.urls.index(self.url) if self.url in self.urls else 0
        return self.urls[start:] + self.urls[:start]

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        method = method.upper()
        params = {k: v for k, v in (params or {}).items() if v is not None}
        reasons: list[str] = []
        response: httpx.Response | None = None
        for url in self._order():
            try:
                response = self._http.request(method, url + path, json=json, params=params)
            except httpx.HTTPError as err:
                reasons.append(_transport_reason(url, err))
                if method in SAFE_METHODS or _never_sent(err):
                    continue
                raise self._unreached(reasons) from None
            if response.status_code in RETRY_STATUSES and method in SAFE_METHODS:
                reasons.append(f"at {url} answered HTTP {response.status_code}")
                continue
            self._remember(url)
            break
        else:  # every instance failed: a 50x one answered with says more than a refused connection
            if response is None:
                raise self._unreached(reasons)
        if response.status_code >= 400:
            raise self._error(response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise ApiError(
                response.status_code, f"{self.url} did not answer with JSON; is it a Fleet control plane?"
            ) from None

    def _remember(self, url: str) -> None:
        self.url = url
        self._last_good[tuple(self.urls)] = url

    def _unreached(self, reasons: list[str]) -> ApiError:
        message = "control plane " + "; ".join(reasons)
        if all(r.startswith("unreachable") for r in reasons):
            message = (
                f"control plane unreachable at {', '.join(self.urls)} "
                "(start it with `fleetctl control-plane` or `fleetctl up`)"
            )
        return ApiError(0, message)

    def _error(self, response: httpx.Response) -> ApiError:
        try:
            body = response.json()
        except ValueError:
            body = None
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            message, field, kind = str(err.get("message")), err.get("field"), str(err.get("type", "error"))
        elif isinstance(body, dict) and "detail" in body:
            message, field, kind = str(body["detail"]), None, "error"
        else:
            message, field, kind = response.text[:200] or response.reason_phrase, None, "error"
        if response.status_code == 401 and not self.token:
            message += " (no token: set FLEET_TOKEN or run the control plane once under this FLEET_HOME)"
        return ApiError(response.status_code, message, field, kind)

    def get(self, path: str, **params) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, json=body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def items(self, path: str, limit: int | None = None, **params) -> list[dict]:
        """Every item of a paginated list (or the first `limit`)."""
        out: list[dict] = []
        offset = 0
        while True:
            want = PAGE if limit is None else min(PAGE, limit - len(out))
            page = self.get(path, limit=want, offset=offset, **params)
            out.extend(page["items"])
            offset += len(page["items"])
            if not page["items"] or offset >= page["total"] or (limit is not None and len(out) >= limit):
                return out
