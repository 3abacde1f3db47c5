"""ringd/http/errors.py: an error's OpenAI type follows its status."""

from __future__ import annotations

import pytest

from ringd.http.errors import ApiError


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"), (416, "invalid_request_error"),
     (422, "invalid_request_error"), (429, "rate_limit_error"), (500, "server_error"), (503, "service_unavailable")],
)  # fmt: skip
def test_a_status_without_a_type_of_its_own_is_the_clients_mistake_or_the_servers(status, kind):
    """Issue 28: a 416 (a Range outside a weight file) said server_error."""
    assert ApiError(status, "x").body()["error"]["type"] == kind
