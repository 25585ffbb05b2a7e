"""OpenAI's error body and the exception that carries it, for engine and gateway alike."""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


class OpenAIError(Exception):
    """An error the client sees in OpenAI's shape; raise it from anywhere in a request."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.kind = kind  # the body's `type` when the status's default is not OpenAI's

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code, self.kind)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    """OpenAI's shape; `kind` overrides the status's `type` (429 `insufficient_quota`)."""
    kind = kind or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before", "none"}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'role') -> 'messages.0.role'; drops the union-member tags Pydantic adds."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in _TAGS)]
    parts = [p for p in parts if p != "body"]
    return ".".join(parts) or None


def validation_error(errors: list[Any]) -> OpenAIError:
    """The most specific Pydantic error, phrased for a person."""
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return OpenAIError(400, f"The request body is not valid JSON: {detail}", code="invalid_json")
    if first.get("type") == "model_type" and not first.get("loc"):
        return OpenAIError(400, "The request body must be a JSON object", code="invalid_json")
    best = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _loc_to_param(tuple(best.get("loc", ())))
    msg = str(best.get("msg", "invalid value")).removeprefix("Value error, ")
    if best.get("type") == "missing":
        text = f"'{param}' is a required field"
    elif param:
        shown = repr(best.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        text = f"Invalid value for '{param}': {msg} (got {shown})"
    else:
        text = msg
    return OpenAIError(400, text, param=param)
