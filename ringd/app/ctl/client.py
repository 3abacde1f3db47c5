"""ringctl's HTTP client: one request to one node's API, over plain HTTP or https (``Trust``),
signed with the cluster secret or carrying an API key (``Credentials``), for the node name the
pin store holds for that address. Errors come back as a CtlError that says what to check."""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ringd.security.auth import sign
from ringd.node.config import DEFAULT_SECRET_FILE, KEYS, ConfigError, read_secret_file
from ringd.app.ctl.errors import CtlError
from ringd.app.ctl.pins import DEFAULT_KNOWN_NODES, KnownNodes
from ringd.base.names import check_name
from ringd.security.tls import TlsError, cluster_ca_pem, trusting

# A node answers status from memory; seconds of silence mean it is down or stuck.
HTTP_TIMEOUT_S = 5.0

DEFAULT_CLUSTER = next(k.default for k in KEYS if k.name == "cluster")
# The start of the 400 a node with TLS on gives plain HTTP (http/tlslisten.py).
SPEAKS_HTTPS = b"this node speaks HTTPS"


class Trust:
    """How ringctl reaches a node's API: plain HTTP, or https checked against ``ca_file``, else
    against the cluster CA derived from the secret (``secret()``) and the cluster's name."""

    def __init__(self, https: bool, ca_file: str | None, cluster: str, secret):
        self.https, self.ca_file, self.cluster, self._secret = https, ca_file, cluster, secret
        self._context: ssl.SSLContext | None = None

    def url(self, node: str, path: str) -> str:
        return f"{'https' if self.https else 'http'}://{node}{path}"

    def context(self) -> ssl.SSLContext | None:
        if not self.https:
            return None
        if self._context is None:
            if self.ca_file is not None:
                try:
                    pem = Path(self.ca_file).expanduser().read_bytes()
                    self._context = trusting(pem)
                except OSError as e:
                    raise CtlError(f"--ca: cannot read {self.ca_file}: {e.strerror}") from None
                except TlsError as e:
                    raise CtlError(f"--ca: {self.ca_file}: {e}") from None
            else:
                secret = self._secret()
                if secret is None:
                    raise CtlError(
                        "the node speaks HTTPS; trust its certificate with --ca FILE, or give the cluster secret "
                        "(--secret-file) and ringctl checks it against the cluster CA"
                    )
                self._context = trusting(cluster_ca_pem(secret, self.cluster))
        return self._context

    def failed(self, url: str, e: ssl.SSLCertVerificationError) -> "CtlError":
        how = (
            f"is --ca {self.ca_file} the CA that issued it?" if self.ca_file is not None
            else f"with tls: auto, --secret-file must hold the cluster's secret and --cluster name it (now {self.cluster!r}); "
            "with the node's own tls_cert, give its CA: --ca FILE"
        )  # fmt: skip
        return CtlError(f"{url}: the node's certificate did not verify ({e.verify_message}); {how}")


class Credentials:
    """What ringctl proves itself with: the cluster secret (read when first needed), an API key;
    and for which node it signs at each address (``named``: the user's word, else ``known``'s pin)."""

    def __init__(
        self, secret_file: str | None, api_key: str | None, known: KnownNodes | None = None, named: dict[str, str] | None = None,
        trust: Trust | None = None,
    ):  # fmt: skip
        self.secret_file = secret_file
        self.api_key = api_key
        self.trust = trust or Trust(False, None, DEFAULT_CLUSTER, lambda: self.secret(required=False))
        self.known = known or KnownNodes(DEFAULT_KNOWN_NODES)
        self.named = named or {}
        self._secret: bytes | None = None
        self._node_names: dict[str, str] = {}

    def secret(self, required: bool) -> bytes | None:
        if self._secret is None:
            path = self.secret_file or DEFAULT_SECRET_FILE
            try:
                self._secret = read_secret_file(path)
            except ConfigError as e:
                if required or self.secret_file:
                    raise CtlError(f"{e}; control commands are signed with the cluster secret (--secret-file FILE)") from None
                return None
        return self._secret

    def node_name(self, node: str) -> str:
        """The name to sign for at ``node``: the user's, else the pinned one, else (first contact) what
        the node says, then pinned. The node's open /health must say the same, or nothing is signed."""
        if node in self._node_names:
            return self._node_names[node]
        claimed = fetch(node, "/health", allow_error=True, trust=self.trust).get("node")
        claim = f"says it is {claimed!r:.80}" if isinstance(claimed, str) else "does not say which node it is"
        pinned = self.known.load().get(node)
        named = self.named.get(node)
        if named is not None:
            if claimed != named:
                raise CtlError(f"the node at {node} {claim}, but you named {named!r}; nothing was signed: is --node the address you meant?")
            if pinned is not None and pinned != named:
                print(f"ringctl: {node} was pinned as {pinned!r}; it is {named!r} now, as you named it ({self.known.path})", file=sys.stderr)
        elif pinned is not None:
            if claimed != pinned:
                raise CtlError(
                    f"the node at {node} {claim}, but ringctl pinned it as {pinned!r} when it first signed for it "
                    f"({self.known.path}); nothing was signed. If another node now answers there, say which you mean: "
                    f"--node-name NAME (or --node NAME@{node})"
                )
        else:
            try:
                check_name(claimed)
            except ValueError:
                raise CtlError(f"the node at {node} {claim} (a node name); name it yourself: --node-name NAME") from None
            print(
                f"ringctl: first signed request to {node}, which says it is {claimed!r}: pinned in {self.known.path}; "
                "ringctl will sign for no other name there",
                file=sys.stderr,
            )  # fmt: skip
        name = named or pinned or claimed
        if pinned != name:
            self.known.pin(node, name)
        self._node_names[node] = name
        return name


def fetch(
    node: str, path: str, body: dict | None = None, creds: Credentials | None = None, sign_with_secret: bool = False,
    allow_error: bool = False, trust: Trust | None = None, timeout_s: float = HTTP_TIMEOUT_S,
) -> dict:  # fmt: skip
    trust = trust or (creds.trust if creds is not None else Trust(False, None, DEFAULT_CLUSTER, lambda: None))
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if creds is not None:
        secret = creds.secret(required=sign_with_secret)
        if secret is not None:
            method = "GET" if data is None else "POST"
            headers.update(sign(secret, method, path, creds.node_name(node), data or b"", time.time()))
        elif creds.api_key:
            headers["Authorization"] = f"Bearer {creds.api_key}"
    while True:
        url = trust.url(node, path)
        req = urllib.request.Request(url, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=trust.context()) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            if e.code == 400 and raw.startswith(SPEAKS_HTTPS) and not trust.https:
                trust.https = True  # and for every later request of this run
                continue
            if allow_error:
                try:
                    return json.loads(raw)
                except ValueError:
                    return {}
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:300].decode(errors="replace")
            raise CtlError(f"{url} answered {e.code}: {message}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLCertVerificationError):
                raise trust.failed(url, e.reason) from None
            raise CtlError(f"cannot read {url}: {e.reason}; is ringd running there? (--node HOST:PORT)") from None
        except (OSError, ValueError) as e:
            raise CtlError(f"cannot read {url}: {e}; is ringd running there? (--node HOST:PORT)") from None
