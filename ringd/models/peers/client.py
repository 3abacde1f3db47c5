"""Asking a holder: its address, the deadlines of every wait, what a failed request is, the
manifest request and Retry-After (a holder's word, bounded).

A holder is trusted for nothing it says beyond what is checked: every header acted on is
parsed defensively (``retry_after``), every step of a request has a deadline (connecting,
the answer's head, each read of the body, each piece at a floor rate). What a holder did
wrong is one of the exceptions at the end, each of which the fetch (peers/fetch.py)
answers in its own way: a stall drops the holder at once, a failed request rests it, a
bad piece or a manifest not ours refuses it.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import re
import ssl as ssl_lib
import time
from dataclasses import dataclass

import aiohttp

from ringd.security.auth import FILES_BODY_SIGNATURE_HEADER, FILES_NONCE_HEADER, AuthError, check_files_body, sign_files
from ringd.models.errors import ModelError
from ringd.models.peers.manifest import FILES_PREFIX, MAX_MANIFEST_BYTES, Manifest, ManifestError

# Deadlines. Connecting to a holder on the LAN (its address looked up too); the answer's status
# and headers, which a holder sends before its first byte of a file (a 503 at once when busy).
CONNECT_TIMEOUT_S = 5.0
HEAD_TIMEOUT_S = 10.0
# Silence within a body: a holder that sends no byte for this long has stalled (a LAN holder
# sends megabytes a second; its disk pausing takes well under a second) and is dropped.
STALL_S = 10.0
# The slowest a piece may arrive, on top of STALL_S: a holder that trickles a byte now and then
# is a staller too. A LAN stream carries tens of MiB/s; a tenth of a slow Wi-Fi's share is this.
MIN_PIECE_BYTES_PER_S = 1024 * 1024
# A holder hashes every byte of its model for the first manifest it is asked for: minutes
# for hundreds of GB. How long a fetcher waits for it, asking again every Retry-After.
MANIFEST_WAIT_S = 1800.0
# A holder that failed a request (not a bad piece: the link, a restart) is asked again after this.
HOLDER_RETRY_S = 2.0
# Retry-After, in seconds, is the holder's word: a value that is not a number of seconds or an
# HTTP date (RFC 9110 10.2.3) counts as HOLDER_RETRY_S, and any is taken as at most this (a
# holder serving others frees a stream within seconds; one building its manifest is asked again).
MAX_RETRY_AFTER_S = 30.0


class FetchError(ModelError):
    """The model's bytes could not be had from any peer; the message says why and from whom."""


def retry_after(value: str | None, now: float | None = None) -> float:
    """Seconds to wait by a Retry-After header, whatever a holder put there: delay-seconds or an
    HTTP date (RFC 9110 10.2.3), clamped to [0, MAX_RETRY_AFTER_S]; anything else (none, "soon",
    "nan", "1e308", a date that does not parse) is HOLDER_RETRY_S. Never raises."""
    if value is None:
        return HOLDER_RETRY_S
    value = value.strip()
    if re.fullmatch(r"[0-9]{1,12}(\.[0-9]{1,6})?", value):  # delay-seconds (a fraction allowed)
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
            seconds = when.timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError, IndexError, OverflowError):
            return HOLDER_RETRY_S
    if not math.isfinite(seconds):
        return HOLDER_RETRY_S
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


@dataclass(frozen=True)
class Holder:
    node: str
    http: str  # host:port of its HTTP API
    model: str  # the fingerprint of the model it serves
    https: bool = False  # its API speaks TLS (the INFO it sent says so): fetched with the node's client context


def client_session(ssl: ssl_lib.SSLContext | None = None) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=STALL_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(ssl=ssl if ssl is not None else True))


def holder_url(holder: Holder, path: str, ssl: ssl_lib.SSLContext | None = None) -> str:
    return f"{'https' if holder_tls(holder, ssl) is not None else 'http'}://{holder.http}{path}"


def holder_tls(holder: Holder, ssl: ssl_lib.SSLContext | None) -> ssl_lib.SSLContext | None:
    """The context to reach ``holder`` with: the node's, where the holder's API speaks TLS; a
    holder with TLS and a node with no context is a failed request that says so."""
    if not holder.https:
        return None
    if ssl is None:
        raise FetchError(f"{holder.node} serves its API over https, and this fetch has no TLS context to check it with")
    return ssl


def piece_deadline(nbytes: int) -> float:
    """Seconds ``nbytes`` of a body may take: STALL_S, and the bytes at MIN_PIECE_BYTES_PER_S."""
    return STALL_S + nbytes / MIN_PIECE_BYTES_PER_S


def reason(e: BaseException) -> str:
    """What failed, for a log line: the message, and the exception's type where it says more."""
    if isinstance(e, (HolderFailed, BadHolder, BadPiece, FetchError)) and str(e):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def read_at_most(r: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or its first ``limit + 1`` bytes if it is longer: ``StreamReader.read(n)``
    gives what has arrived (up to n), so one call may end a body split over TCP segments early."""
    body = bytearray()
    while len(body) <= limit and (chunk := await r.content.read(limit + 1 - len(body))):
        body += chunk
    return bytes(body)


async def fetch_manifest(http: aiohttp.ClientSession, holders: list[Holder], secret: bytes, node: str, fingerprint: str | None, ssl: ssl_lib.SSLContext | None = None) -> Manifest:
    """The signed manifest of the first holder that answers (waiting while it builds it)."""
    errors = []
    deadline = time.monotonic() + MANIFEST_WAIT_S
    pending = list(holders)
    while pending:
        holder = pending.pop(0)
        fp = fingerprint or "any"
        path = f"{FILES_PREFIX}/{fp}/manifest"
        try:
            headers = sign_files(secret, "GET", path, node, holder.node, time.time())
            async with asyncio.timeout(CONNECT_TIMEOUT_S + HEAD_TIMEOUT_S + piece_deadline(MAX_MANIFEST_BYTES)), http.get(holder_url(holder, path, ssl), headers=headers) as r:
                body = await read_at_most(r, MAX_MANIFEST_BYTES)
                if r.status == 503 and time.monotonic() < deadline:
                    await asyncio.sleep(retry_after(r.headers.get("Retry-After")))
                    pending.insert(0, holder)  # building: ask it again
                    continue
                if r.status != 200:
                    errors.append(f"{holder.node}: HTTP {r.status} {body[:200].decode(errors='replace')}")
                    continue
                if len(body) > MAX_MANIFEST_BYTES:
                    errors.append(f"{holder.node}: a manifest over {MAX_MANIFEST_BYTES} bytes")
                    continue
                check_files_body(secret, headers[FILES_NONCE_HEADER], body, r.headers.get(FILES_BODY_SIGNATURE_HEADER))
                manifest = Manifest.from_wire(json.loads(body))
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            errors.append(f"{holder.node}: {reason(e)}")
            continue
        except (AuthError, ManifestError, ValueError) as e:
            errors.append(f"{holder.node}: {e}")
            continue
        except Exception as e:  # whatever else a holder's answer makes of the parsing: said, and the next asked
            errors.append(f"{holder.node}: {reason(e)}")
            continue
        if fingerprint is not None and manifest.fingerprint != fingerprint:
            errors.append(f"{holder.node}: its manifest is of model {manifest.fingerprint}, not {fingerprint}")
            continue
        return manifest
    raise FetchError("no holder answered with the model's manifest: " + "; ".join(errors))


class BadPiece(Exception):
    pass


class BadHolder(Exception):
    pass


class HolderBusy(Exception):
    def __init__(self, retry_after: float):
        super().__init__(f"busy; retry after {retry_after} s")
        self.retry_after = retry_after


class HolderFailed(Exception):
    pass


class Stalled(HolderFailed):
    """A holder whose socket is open and silent (or too slow): dropped from the fetch at once."""
