"""The one error every part of http/ raises: an HTTP status, a message, and the field at fault.

Anything a client can get wrong (a body, a key, a model name, a ring that is
not ready) becomes an ``ApiError``; each API answers it in its own shape
(``api.py`` picks the shape by the route's path; a stream that has started
reports it in-band, ``endpoint.py``). ``body`` is OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``), which Responses shares
and every route that is no API's answers with.
"""

from __future__ import annotations

# OpenAI's error type for a status, when the raiser names none.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, for 429 and 503
        self.message = message
        self.param = param
        self.code = code
        # A status without its own type: the client's mistake (4xx) or the server's.
        self.type = type_ or TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
