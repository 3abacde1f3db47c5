"""Why the leader could not serve a request, with the HTTP status the API answers with.

Raised by the engine and the parts it calls (admission), read by the HTTP layer
(``http/serving.py``), which knows nothing else of the leader's insides.
"""

from __future__ import annotations

# Retry-After for a 429: seconds until KV room is likely.
RETRY_AFTER_S = 2


class EngineError(Exception):
    """A request could not be served; ``status`` is the HTTP status to answer with."""

    status = 500
    retry_after: int | None = None  # seconds, for a 429

    def __init__(self, message: str, status: int | None = None, retry_after: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.retry_after = retry_after
