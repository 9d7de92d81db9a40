"""OpenAI's error body, {"error": {"message", "type", "param", "code"}}, and the refusals."""
from __future__ import annotations

from typing import Optional


class APIError(Exception):
    """An answer other than 200: status, message, OpenAI's error type, the request field at
    fault (param) and a short code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None):
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str):
    """A field whose value the server does not serve: 400 naming it."""
    return APIError(400, f"{param}: {what}", param=param, code="unsupported_parameter")


def overloaded(retry_after_s: int):
    return APIError(503, "the server's queue is full; retry later", type="server_overloaded",
                    code="queue_full", headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str):
    return APIError(503, message, type="server_error", code="unavailable")
