"""What the HTTP face needs of its node (``app.daemon.Node`` provides it), as a Protocol.

Every part of http/ that asks the node something (the driver, the serving
engine, each API's translation, the control and status routes) types it with
``ApiNode``, so none of them imports the daemon, and none imports ``api.py``
for it.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from ringd.models.catalogue import Catalogue
    from ringd.http.files import Holding
    from ringd.leader.engine import Engine
    from ringd.base.metrics import Metrics
    from ringd.models.checkpoint import ModelInfo


class Served(Protocol):
    """One model the leader serves (an instance of its pool): what a request naming it runs on."""

    name: str  # the instance ("": the configured model's first; a replica's "MODEL#N")
    model_id: str  # what requests name it by, and answers call it

    @property
    def info(self) -> "ModelInfo": ...
    @property
    def tokenizer(self) -> object: ...
    @property
    def engine(self) -> "Engine": ...
    def readiness(self) -> tuple[bool, str]: ...
    def release(self) -> None:
        """A request ``ApiNode.served`` routed here ended (whichever way): it is outstanding work no more."""
        ...


class ApiNode(Protocol):
    name: str
    model_id: str
    started: int
    info: "ModelInfo"
    tokenizer: object
    secret: bytes
    api_keys: frozenset[str]
    metrics: "Metrics"
    chat_template_kwargs: dict  # what every chat template gets unless a request sets it
    fetch_image_urls: bool  # images named by an http(s) URL are fetched (else a 400)
    failover_wait_s: float  # how long a request waits for the next ring when the last was lost
    files: "Holding | None"  # the model this node serves to peers fetching theirs (http/files.py)
    client_ssl: ssl.SSLContext | None  # whom this node trusts when it calls a peer's https API (tls.client_context)
    catalogue: "Catalogue | None"  # the models on this machine that the model list shows (models/catalogue.py)

    @property
    def leading(self) -> bool: ...
    @property
    def drained(self) -> set[str]: ...
    @property
    def leader(self) -> str | None: ...
    def readiness(self) -> tuple[bool, str]: ...
    def local_status(self) -> dict: ...
    async def cluster_status(self) -> dict: ...
    def leader_http(self) -> str | None: ...
    async def leader_changed(self) -> None: ...
    def members(self) -> set[str]: ...
    def fit_rule(self) -> Callable[["ModelInfo"], str | None]:
        """Whether the cluster's memory holds a model, as placement would place it over the members'
        budgets as they are now: None if it does, else why not. Pure: callable off the loop."""
        ...
    async def served(self, name: str | None, keep_alive: "float | None | bool" = False) -> Served:
        """The instance that serves ``name`` (None: the configured model), loading it first if the
        model list holds it (the leader only); ``keep_alive`` (False: leave it) sets how long it stays
        loaded once idle. Raises leader.errors.EngineError (404, 400, 503) saying why not."""
        ...
    def find(self, instance: str) -> Served | None:
        """The leader's instance named ``instance`` (None: no such instance, or not the leader)."""
        ...
    def loaded(self, name: str) -> Served | None:
        """The instance a request naming ``name`` would go to now, without loading (None: none)."""
        ...
    def instances(self) -> list[dict]:
        """The leader's instances, as /api/ps and ``ringctl ps`` show them ([] on a follower)."""
        ...
    def unload(self, name: str) -> list[str]:
        """Unload every instance of the model ``name`` now; the instances unloaded."""
        ...
    async def load(self, name: str, replicas: int, keep_alive: "float | None | bool" = False) -> Served: ...
    def set_pin(self, node: str | None) -> dict: ...
    def drain(self, node: str, undo: bool) -> None: ...
