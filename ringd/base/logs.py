"""A node's log lines: text for people, or JSON for machines, each naming the request it is about.

``log_format: text`` (the default) prints one line per event as before;
``log_format: json`` prints one JSON object per line with the keys in
``JSON_KEYS``: time (UTC, ISO 8601, milliseconds), level, node, logger,
request_id, term, message, and fields (structured details of the event).

A request's id is the client's ``x-request-id`` when it sent one, else one
made by the node that took the request (``new_request_id``); the API answers
with it, a follower forwards it to the leader, and the leader hands it to every
stage in the request's first frame. A line about a request names it either
through ``about(...)`` in the call's ``extra`` (the engine and the stages,
which serve many requests from callbacks) or through ``REQUEST_ID``, the
context variable the API sets for the life of a handler, so every line logged
while serving a request carries its id without being told.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import re
import secrets
import sys

# The request a handler is serving; lines logged in its context name it.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("ringd_request_id", default=None)

LOG_FORMATS = ("text", "json")
JSON_KEYS = ("time", "level", "node", "logger", "request_id", "term", "message", "fields")

# A client's x-request-id: what tracing proxies send (UUIDs, hex, base64-ish ids),
# short enough for every log line, and nothing a log reader could mistake for structure.
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,%d}" % MAX_REQUEST_ID_CHARS)

# Third-party chatter at info level drowns the ring's own lines.
QUIET_LOGGERS = ("aiohttp.access", "huggingface_hub", "transformers")


class RequestIdError(ValueError):
    """A client's x-request-id that is not one."""


def new_request_id() -> str:
    return "req-" + secrets.token_hex(8)


def check_request_id(value: str) -> str:
    if not _REQUEST_ID.fullmatch(value):
        raise RequestIdError(
            f"x-request-id must be 1 to {MAX_REQUEST_ID_CHARS} characters of letters, digits and ._:/+=@-; "
            f"got {value[:40]!r}{'...' if len(value) > 40 else ''}"
        )
    return value


def about(request_id: str | None = None, term: int | None = None, **fields) -> dict:
    """``extra`` for a log call about a request and/or a ring term, with structured fields."""
    return {"request_id": request_id, "term": term, "fields": fields}


class _Context(logging.Filter):
    """Gives every record the request id, term and fields the formatters read."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        if not hasattr(record, "term"):
            record.term = None
        if not isinstance(getattr(record, "fields", None), dict):
            record.fields = {}
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, node: str):
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(record.fields)
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            fields["stack"] = record.stack_info
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "node": self.node,
            "logger": record.name,
            "request_id": record.request_id,
            "term": record.term,
            "message": record.getMessage(),
            "fields": fields,
        }
        # default=str: a field that is not JSON (a Path, an exception) is still one line.
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """Today's lines, with the request's id in brackets when the line is about one."""

    def __init__(self, node: str):
        super().__init__(f"%(asctime)s {node} %(levelname).1s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        if record.request_id is not None:
            line = line.replace(": ", f": [{record.request_id}] ", 1)
        return line


def setup(node: str, level: str, fmt: str = "text") -> None:
    """Send this process's log to standard error in ``fmt`` (launchd and systemd keep it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context())
    handler.setFormatter(JsonFormatter(node) if fmt == "json" else TextFormatter(node))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    logging.captureWarnings(True)  # Python's warnings too, in the same format
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
