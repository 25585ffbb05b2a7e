"""A small synchronous client of the admin API for fleetctl (and tests).

Every failure becomes an `ApiError` carrying the server's one-line reason (or why the
server could not be asked), so commands can print it and exit non-zero.
"""

from __future__ import annotations

from typing import Any

import httpx

from control_plane.settings import client_endpoint

PAGE = 1000


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


class FleetClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        default_url, default_token = client_endpoint()
        self.url = (url or default_url).rstrip("/")
        self.token = token if token is not None else default_token
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, json=json, params=params)
        except httpx.ConnectError:
            raise ApiError(
                0,
                f"control plane unreachable at {self.url} (start it with `fleetctl control-plane` or `fleetctl up`)",
            ) from None
        except httpx.TimeoutException:
            raise ApiError(0, f"control plane at {self.url} did not answer in time") from None
        except httpx.HTTPError as err:
            raise ApiError(0, f"control plane at {self.url}: {err}") from None
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
