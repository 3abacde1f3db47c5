"""Anthropic's Messages API: not served yet (issue 15 is open); only its error shape is here.

``/v1/messages`` answers 404 in Anthropic's error shape, so an Anthropic client
hears that the route is missing in the form it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .openai_types import ApiError

if TYPE_CHECKING:
    from .api import Api

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(e.status, "api_error"), "message": e.message}}


class AnthropicApi:
    def __init__(self, api: "Api"):
        self.api = api

    def routes(self) -> list:
        return []
