"""Errors in OpenAI's format: `APIError` (status, `{"error": {message, type, param, code}}`
body, headers such as Retry-After) and the mapping of pydantic validation errors onto it (the
offending parameter as a dotted path, OpenAI-flavoured messages, unknown and unsupported
parameters reported first). The error object itself is `openai.types.shared.ErrorObject`.
"""
from __future__ import annotations

import re
from typing import Any

from openai.types.shared import ErrorObject
from pydantic import ValidationError
from pydantic_core import PydanticCustomError


class APIError(Exception):
    """An error to return to the client as `{"error": {message, type, param, code}}`.

    `APIError(message, status=400, type=None, param=None, code=None, headers=None)`;
    `type` defaults to "invalid_request_error" for 4xx and "server_error" for 429/5xx.
    `headers` (e.g. Retry-After) are for the HTTP layer; they are not part of the body.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or ("server_error" if status >= 500 or status == 429 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}} (param and code may be null)."""
        info = ErrorObject(message=self.message, type=self.type, param=self.param, code=self.code)
        return {"error": info.model_dump(mode="json", exclude_unset=True)}

    def __repr__(self) -> str:
        return f"APIError(status={self.status}, param={self.param!r}, message={self.message!r})"

    @classmethod
    def model_not_found(cls, model: str, served: str | None = None) -> APIError:
        """404 for a model id this service does not serve."""
        also = f"; this server serves '{served}'" if served else ""
        return cls(f"The model '{model}' does not exist{also}.", status=404, param="model",
                   code="model_not_found")

    @classmethod
    def invalid_api_key(cls) -> APIError:
        """401 for a missing or wrong API key."""
        return cls("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", status=401,
                   code="invalid_api_key")

    @classmethod
    def overloaded(cls, message: str = "The server is overloaded; retry later.", *,
                   status: int = 503, retry_after_s: float | None = None) -> APIError:
        """429/503 when the service sheds load; sets Retry-After when given."""
        headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
        return cls(message, status=status, code="overloaded", headers=headers)

    @classmethod
    def internal(cls, message: str = "Internal server error.") -> APIError:
        """500 for a failure inside the service."""
        return cls(message, status=500, code="internal_error")


def _invalid(message: str, kind: str = "invalid_value", **ctx: Any) -> PydanticCustomError:
    """A validation error with a ready-made message (ctx `field` names a sub-parameter); `kind`
    "unsupported_parameter" for what this server does not implement."""
    return PydanticCustomError(kind, "{message}", {"message": message, **ctx})


# pydantic adds union-member tags ("str", "list[int]", "TextContentPart") to error locations;
# our field names are snake_case, so anything else is a tag and is dropped from `param`.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|.*[\[\]()-].*)$")
_ERROR_PRIORITY = {"extra_forbidden": 0, "unsupported_parameter": 1}


def _error_param(error: dict[str, Any]) -> str | None:
    """Dotted parameter path of a pydantic error, e.g. "messages.0.role"."""
    parts = [str(p) for p in error["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p))]
    extra = (error.get("ctx") or {}).get("field")
    if extra:
        parts.append(extra)
    return ".".join(parts) or None


def _error_message(error: dict[str, Any], param: str | None) -> str:
    """A readable, OpenAI-flavoured message for one pydantic error."""
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if kind in ("unsupported_parameter", "invalid_value"):
        return msg
    if kind == "missing":
        return f"Missing required parameter: '{param}'."
    if param is None:
        return f"Invalid request: {msg}."
    if kind.endswith("_type"):
        return f"Invalid type for '{param}': {msg}."
    return f"Invalid value for '{param}': {msg}."


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """Turn a pydantic ValidationError into a 400 APIError describing its most relevant error."""
    errors = sorted(exc.errors(include_url=False),
                    key=lambda e: _ERROR_PRIORITY.get(e["type"], 2))
    first = errors[0]
    param = _error_param(first)
    message = _error_message(first, param)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(message, status=400, param=param)
