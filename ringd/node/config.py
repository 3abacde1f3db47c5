"""One validated Config from a YAML file, ``RINGD_*`` environment variables and flags.

Later sources win: file, then environment, then flags. Every key is declared
once in ``KEYS`` (type, default, check, help); the YAML schema, the environment
names and the command-line flags all come from that table, so they cannot
drift apart, and ``Config`` has no defaults of its own. Unknown keys, keys
given twice and impossible values are errors that name the key, where it came
from, and why.

It also reads the two files whose contents are credentials, the cluster secret
and the API keys, and never puts their contents in a message.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from ringd.cluster.links import DEAD_AFTER_S, HEARTBEAT_INTERVAL_S
from ringd.cluster.members import ClusterSettings
from ringd.base.device import default_cache_dir
from ringd.leader.engine import EngineSettings
from ringd.leader.admission import FAILOVER_WAIT_S, MAX_QUEUED_REQUESTS, QUEUE_TIMEOUT_S
from ringd.leader.prefix import DEFAULT_PREFIX_CACHE_ENTRIES
from ringd.leader.pacing import DEFAULT_PREFILL_CHUNK_S
from ringd.leader.scheduler import DEFAULT_INTERLEAVED_CHUNK, DEFAULT_MAX_ROWS, DEFAULT_NUM_DRAFT, DEFAULT_PREFILL_CHUNK, MAX_NUM_DRAFT
from ringd.base.logs import LOG_FORMATS
from ringd.base.names import check_host as _host
from ringd.base.names import DEFAULT_HTTP_PORT, DEFAULT_RING_PORT, check_name, parse_hostport
from ringd.base.names import check_port as _port
from ringd.ring.plan import MAX_GROUP
from ringd.stage.groupengine import DEVICE_NAME, ENGINES
from ringd.ring.steps import DEFAULT_KV_GROUP_SIZE, KV_BITS, KV_GROUP_SIZES, MAX_ROWS, KvOptions
from ringd.models.ollama.keepalive import DEFAULT_KEEP_ALIVE_S, KeepAliveError, parse_keep_alive
from ringd.cluster.sharing import MAX_REPLICAS
from ringd.security.tls import TlsSettings

# Where `ringd serve` and `ringctl` look for the cluster secret unless told
# otherwise (the README has users put it there).
DEFAULT_SECRET_FILE = "~/.config/ringd/secret"
# models_dir when it is not set: a folder in ringd's cache (ringd.base.device.default_cache_dir).
DEFAULT_MODELS_DIR = "from-peers"
# The secret authenticates every ring connection; shorter ones are guessable.
MIN_SECRET_BYTES = 16
# API keys are bearer tokens anyone can try over HTTP; shorter ones are guessable.
MIN_API_KEY_CHARS = 16


class ConfigError(ValueError):
    """A bad key or value; the message says which, from where, and why."""


def _positive_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("must be a positive integer")
    return v


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 2**31:
        raise ValueError("must be an integer")
    return v


def _positive_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError("must be a positive number")
    return float(v)


def _seconds_or_off(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise ValueError("must be a number of seconds >= 0 (0: off)")
    return float(v)


def _keep_alive(v: Any) -> float | None:
    if isinstance(v, str) and v.removeprefix("-").isascii() and v.removeprefix("-").isdigit():
        v = int(v)  # whole seconds, as OLLAMA_KEEP_ALIVE takes them (an environment variable, a flag)
    try:
        return parse_keep_alive(v)
    except KeepAliveError as e:
        raise ValueError(str(e)) from None


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("must be a non-empty string")
    return v




def _peers(v: Any) -> list[str]:
    if isinstance(v, str):
        v = [p for p in v.split(",") if p.strip()]
    if not isinstance(v, list):
        raise ValueError("must be a list of IP:PORT entries")
    out = []
    for p in v:
        parse_hostport(p.strip() if isinstance(p, str) else p)
        out.append(p.strip())
    return out


def _split(v: Any) -> list[int] | None:
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = [int(x) for x in v.split(",")]
        except ValueError:
            raise ValueError("must be comma-separated layer counts like 10,9,9") from None
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
        raise ValueError("must be a list of positive layer counts like [10, 9, 9]")
    return v


def _tensor_parallel(v: Any) -> int | str:
    if v == "auto":
        return v
    if isinstance(v, str) and v.isascii() and v.isdigit():
        v = int(v)  # a flag or an environment variable
    try:
        return _int_between(1, MAX_GROUP)(v)
    except ValueError:
        raise ValueError(f"must be auto or an integer from 1 to {MAX_GROUP}") from None


def _rdma_devices(v: Any) -> dict[str, str]:
    """Per peer, this Mac's RDMA device (``ibv_devices``) whose Thunderbolt cable reaches it."""
    if isinstance(v, str):
        pairs = [p.strip().partition("=") for p in v.split(",") if p.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ValueError("must be peer=device pairs like mini2=rdma_en3,mini3=rdma_en4")
        v = {k.strip(): d.strip() for k, _, d in pairs}
    if not isinstance(v, dict):
        raise ValueError("must be a mapping of peer node to RDMA device, e.g. mini2: rdma_en3")
    for node, device in v.items():
        check_name(node)
        if not isinstance(device, str) or not DEVICE_NAME.fullmatch(device):
            raise ValueError(f"the device toward {node!r} must be a device name like rdma_en3 (ibv_devices lists them), got {device!r}")
    return dict(v)


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in _TRUE + _FALSE:
        return v.lower() in _TRUE
    raise ValueError("must be true or false (on/off, yes/no and 1/0 are accepted too)")


def _patterns(v: Any) -> list[str]:
    """Interface names, globs (``bridge*``) or IPv4 networks (``169.254.0.0/16``)."""
    if isinstance(v, str):
        v = [p.strip() for p in v.split(",") if p.strip()]
    if not isinstance(v, list) or not all(isinstance(p, str) and p and len(p) <= 64 for p in v):
        raise ValueError("must be a list of interface names, globs like bridge* or networks like 169.254.0.0/16")
    return v


def _mapping(v: Any) -> dict:
    """A YAML mapping, or "key=value,key=value" from a flag or the environment."""
    if isinstance(v, str):
        out = {}
        for part in filter(None, (p.strip() for p in v.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{part!r} must be key=value")
            try:
                out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
            except ValueError:
                raise ValueError(f"{part!r}: the value must be a number") from None
        return out
    if not isinstance(v, dict):
        raise ValueError("must be a mapping (key: value), or key=value,key=value on the command line")
    return v


def _placement_weights(v: Any) -> dict[str, float]:
    v = _mapping(v)
    for node, share in v.items():
        check_name(node)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0:
            raise ValueError(f"the share of {node!r} must be a positive number, got {share!r}")
    return {k: float(x) for k, x in v.items()}


def _capabilities(v: Any) -> dict:
    from ringd.base.device import check_capabilities

    return check_capabilities(_mapping(v))


def _choice(*options: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return v

    return check


def _int_between(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"must be an integer from {lo} to {hi}")
        return v

    return check


def _int_in(*options: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or v not in options:
            raise ValueError(f"must be one of {', '.join(map(str, options))}")
        return v

    return check


def _non_negative_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("must be an integer >= 0")
    return v


def _log_level(v: Any) -> str:
    if not isinstance(v, str) or v.lower() not in ("debug", "info", "warning", "error"):
        raise ValueError("must be one of debug, info, warning, error")
    return v.lower()


def _template_kwargs(v: Any) -> dict:
    # From a flag or the environment it comes as JSON text.
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise ValueError('must be a JSON object, e.g. {"enable_thinking": false}') from None
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ValueError('must be a mapping of template variables, e.g. {"enable_thinking": false}')
    return v


def _tls(v: Any) -> str:
    # YAML reads a bare `off` as false.
    if v is False or v in ("off", "auto"):
        return "off" if v is False else v
    raise ValueError("must be one of off, auto (for a certificate of your own, set tls_cert and tls_key instead)")


def _optional(check: Callable) -> Callable:
    return lambda v: None if v is None else check(v)


@dataclass(frozen=True)
class Key:
    name: str
    check: Callable[[Any], Any]
    default: Any
    help: str
    kind: type = str  # how a flag or environment string is parsed before the check


KEYS: list[Key] = [
    Key("name", check_name, None, "this node's id in the cluster (default: the host name)"),
    Key("cluster", check_name, "ringd", "cluster name; daemons of other clusters are ignored"),
    Key("secret_file", _str, DEFAULT_SECRET_FILE, "file holding the cluster secret (at least 16 bytes, readable by its owner only)"),
    Key("api_keys_file", _optional(_str), None, "file of API keys, one a line, that /v1/* requires as a Bearer token (default: none, the API is open)"),
    Key("ring_encryption", _bool, False, "encrypt ring links and model files sent between peers (AES-GCM) for networks you don't trust; integrity (HMAC) is always on"),
    Key("tls", _tls, "off", "HTTPS for the API: auto issues this node a certificate from a CA derived from the cluster secret (clients trust the file `ringctl tls-ca` prints); off: plain HTTP"),
    Key("tls_cert", _optional(_str), None, "a certificate (PEM) of your own for the API, e.g. mkcert's; turns HTTPS on (needs tls_key; not with tls: auto)"),
    Key("tls_key", _optional(_str), None, "the unencrypted private key (PEM) of tls_cert"),
    Key("tls_ca", _optional(_str), None, "the CA (PEM) that issued the other nodes' own certificates (tls_cert), which this node checks a leader it forwards to with, besides the cluster CA (default: with tls_cert the system's store)"),
    Key("model", _optional(_str), None, "mlx-lm model directory, Hugging Face repo id, .gguf file, OWNER/REPO:QUANT (a Hub GGUF repository's quant, e.g. Q4_K_M; also hf.co/OWNER/REPO) or ollama:NAME[:TAG]"),
    Key("model_from_peers", _bool, False, "with no model of its own (or before the Hub), fetch the layers this node runs from peers that hold the model: config, tokenizer and its stages' tensors only, checked chunk by chunk"),
    Key("models_dir", _optional(_str), None, f"a folder of models (GGUF files, mlx-lm directories, a few folders deep) that the model list shows besides the Ollama store and the Hugging Face cache, and where a model fetched from peers is kept (default: {DEFAULT_MODELS_DIR} in ringd's cache)"),
    Key("draft_model", _optional(_str), None, "a small model sharing the served model's tokenizer, run whole on the leader for speculative decoding (directory, repo id or .gguf)"),
    Key("num_draft_tokens", _int_between(1, MAX_NUM_DRAFT), DEFAULT_NUM_DRAFT, f"tokens the draft model proposes per step (1 to {MAX_NUM_DRAFT})", int),
    Key("model_id", _optional(_str), None, "model name the API serves (default: the model's directory or repo name)"),
    Key("host", _host, "0.0.0.0", "address the ring port listens on"),
    Key("advertise", _optional(_host), None, "address peers dial to reach this node (default: this host's addresses, in prefer_interfaces order)"),
    Key("ring_port", _port, DEFAULT_RING_PORT, "TCP port for ring traffic between daemons", int),
    Key("http_host", _host, "0.0.0.0", "address the HTTP API listens on"),
    Key("http_port", _port, DEFAULT_HTTP_PORT, "TCP port of the OpenAI-compatible HTTP API", int),
    Key("peers", _peers, [], "peers to dial, IP:PORT (repeatable flag --peer)"),
    Key("discovery", _bool, True, "find peers with Bonjour (mDNS) on the LAN; off: static peers and gossip only"),
    Key("prefer_interfaces", _patterns, [], "interfaces (names, globs or networks) whose addresses peers should dial first, e.g. bridge0,en0"),
    Key("mdns_interfaces", _optional(_patterns), None, "where Bonjour is spoken (names, globs or networks; default: every interface)"),
    Key("priority", _int, 0, "election priority: the live node with the highest leads (ties: smallest name)", int),
    Key("state_dir", _str, "~/.local/state/ringd", "where the node keeps its election state (a manual leader pin survives restarts)"),
    Key("nodes", _optional(_positive_int), None, "ring size the first plan waits for (default: peers + 1, or with discovery whoever is found within a few seconds)", int),
    Key("split", _split, None, "layers per stage in ring order, e.g. 10,9,9 (default: even)"),
    Key("tensor_parallel", _tensor_parallel, 1, f"Macs that split every layer of a stage between them (1 to {MAX_GROUP}, or auto): consecutive nodes of the ring form groups of this many, each a stage; a stream gets faster as Macs are added where the links are fast; auto: groups where the measured links and compute say they pay (docs/tensor-parallel.md)"),
    Key("tensor_engine", _choice(*ENGINES), "auto", "what a tensor-parallel group's all-reduces run on (its first member's setting counts): auto (MLX's jaccl RDMA where every member has it and rdma_devices names each peer, else ringd), ringd (the ring's own sealed links), jaccl (RDMA or refuse), mlx-ring (MLX's TCP ring backend, for comparison)"),
    Key("rdma_devices", _rdma_devices, {}, "for jaccl: per peer node, this Mac's RDMA device on the Thunderbolt 5 cable to it (ibv_devices lists them), e.g. mini2=rdma_en3,mini3=rdma_en4"),
    Key("prefill_chunk_tokens", _positive_int, DEFAULT_PREFILL_CHUNK, "prompt tokens per prefill frame", int),
    Key("prefill_chunk_s", _seconds_or_off, DEFAULT_PREFILL_CHUNK_S, "seconds the slowest stage may spend on one prompt chunk: chunks shrink (to 32 tokens at least) where 512 tokens take longer, so a new request's first token waits about three such chunks behind a long prompt; 0: chunks by token count alone", float),
    Key("interleaved_chunk_tokens", _positive_int, DEFAULT_INTERLEAVED_CHUNK, "prompt tokens per prefill frame while other requests decode (their pause is about one such chunk)", int),
    Key("micro_batches", _non_negative_int, 0, "micro-batches around the ring at once (0: one per stage, which keeps every stage busy)", int),
    Key("max_batch_rows", _int_between(1, MAX_ROWS), DEFAULT_MAX_ROWS, f"requests decoding together in one micro-batch (1 to {MAX_ROWS})", int),
    Key("memory_budget_gb", _optional(_positive_float), None, "GiB this node may use for weights and KV cache (default: what the machine can give)", float),
    Key("capabilities", _optional(_capabilities), None, "override what was detected: memory_gb, gpu_cores (e.g. memory_gb=16)"),
    Key("placement", _choice("balanced", "uniform", "memory", "compute", "custom"), "balanced", "how the leader splits the layers: balanced, uniform, memory, compute or custom"),
    Key("placement_weights", _placement_weights, {}, "custom placement: each node's share, e.g. mini1=1,studio=3"),
    Key("api_only", _bool, False, "hold no layers: only serve the API (and lead, if elected)"),
    Key("kv_reserve_tokens", _positive_int, 2048, "KV-cache positions every stage keeps room for when layers are placed", int),
    Key("max_kv_size", _optional(_positive_int), None, "mlx-lm max_kv_size: a rotating KV cache of this many positions (disables prefix reuse)", int),
    Key("kv_bits", _optional(_int_in(*KV_BITS)), None, "mlx-lm kv_bits: quantize the KV cache to this many bits", int),
    Key("kv_group_size", _int_in(*KV_GROUP_SIZES), DEFAULT_KV_GROUP_SIZE, "mlx-lm kv_group_size for a quantized KV cache", int),
    Key("quantized_kv_start", _non_negative_int, 5000, "mlx-lm quantized_kv_start: positions kept unquantized", int),
    Key("chat_template_kwargs", _template_kwargs, {}, 'variables every chat template gets unless a request sets them (chat_template_kwargs), e.g. {"enable_thinking": false}'),
    Key("fetch_image_urls", _bool, False, "fetch images a request names by an http(s) URL (off: such a request is a 400; a server that fetches what a client names is a door into the network it sits in: turn on only where every client is trusted)"),
    Key("replicas", _int_between(1, MAX_REPLICAS), 1, f"instances of the configured model (1 to {MAX_REPLICAS}), each a ring over its share of the nodes: a token of a short ring crosses fewer hops, which pays with few streams (with many, one long ring batches as wide; docs/benchmarks.md)", int),
    Key("keep_alive", _keep_alive, DEFAULT_KEEP_ALIVE_S, "how long a model loaded on demand stays loaded once idle, as Ollama's keep_alive: 5m, 1h, 0 (unload at once), -1 (forever); a request's keep_alive sets its model's (the configured model always stays)"),
    Key("prefix_cache_entries", _non_negative_int, DEFAULT_PREFIX_CACHE_ENTRIES, "finished requests whose KV caches stay for prefix reuse (0: off)", int),
    Key("max_queued_requests", _non_negative_int, MAX_QUEUED_REQUESTS, "requests that may wait for KV room before 429s", int),
    Key("queue_timeout_s", _positive_float, QUEUE_TIMEOUT_S, "longest wait for KV room before a 429", float),
    Key("failover_wait_s", _positive_float, FAILOVER_WAIT_S, "how long a request waits for a ring being re-planned, or a follower for a new leader to carry a proxied request over, before it gives up", float),
    Key("heartbeat_interval_s", _positive_float, HEARTBEAT_INTERVAL_S, "seconds between heartbeats on each link", float),
    Key("dead_after_s", _positive_float, DEAD_AFTER_S, "seconds of silence after which a peer is dead", float),
    Key("log_level", _log_level, "info", "debug, info, warning or error"),
    Key("log_format", _choice(*LOG_FORMATS), "text", "text (for people) or json (one object a line, for log search)"),
]
_BY_NAME = {k.name: k for k in KEYS}


@dataclass(frozen=True)
class Config:
    """The validated settings; ``load`` makes one. The defaults are in ``KEYS`` only."""

    name: str
    cluster: str
    secret_file: str
    api_keys_file: str | None
    ring_encryption: bool
    tls: str
    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None
    model: str | None
    model_from_peers: bool
    models_dir: str | None
    draft_model: str | None
    num_draft_tokens: int
    model_id: str | None
    host: str
    advertise: str | None
    ring_port: int
    http_host: str
    http_port: int
    peers: list[str]
    discovery: bool
    prefer_interfaces: list[str]
    mdns_interfaces: list[str] | None
    priority: int
    state_dir: str
    nodes: int | None
    split: list[int] | None
    tensor_parallel: int | str  # "auto": the leader chooses (cluster/groups.py)
    tensor_engine: str  # stage/groupengine.py
    rdma_devices: dict[str, str]
    prefill_chunk_tokens: int
    prefill_chunk_s: float
    interleaved_chunk_tokens: int
    micro_batches: int
    max_batch_rows: int
    memory_budget_gb: float | None
    capabilities: dict | None
    placement: str
    placement_weights: dict
    api_only: bool
    kv_reserve_tokens: int
    max_kv_size: int | None
    kv_bits: int | None
    kv_group_size: int
    quantized_kv_start: int
    chat_template_kwargs: dict
    fetch_image_urls: bool
    replicas: int
    keep_alive: float | None
    prefix_cache_entries: int
    max_queued_requests: int
    queue_timeout_s: float
    failover_wait_s: float
    heartbeat_interval_s: float
    dead_after_s: float
    log_level: str
    log_format: str

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget_gb is None else int(self.memory_budget_gb * 2**30)

    @property
    def models_path(self) -> Path:
        """models_dir, or its default in ringd's cache."""
        return Path(self.models_dir).expanduser() if self.models_dir else default_cache_dir() / DEFAULT_MODELS_DIR

    @property
    def expected_nodes(self) -> int:
        return self.nodes if self.nodes is not None else len(self.peers) + 1

    def read_secret(self) -> bytes:
        return read_secret_file(self.secret_file)

    def tls_settings(self, secret: bytes) -> TlsSettings:
        """TLS for the API as ``tls.py`` takes it; ``secret``: the cluster secret (``read_secret``)."""
        mode = "cert" if self.tls_cert is not None else self.tls
        return TlsSettings(mode, self.cluster, secret, self.tls_cert, self.tls_key, self.tls_ca)

    def cluster_settings(self) -> ClusterSettings:
        """Who this node is among its peers, and how fast it hears of them."""
        return ClusterSettings(
            self.name, self.cluster, Path(self.state_dir).expanduser() / f"{self.cluster}-{self.name}.json", self.priority,
            self.heartbeat_interval_s, self.dead_after_s, self.ring_encryption,
        )  # fmt: skip

    def engine_settings(self) -> EngineSettings:
        """What a leader's engine is tuned by, cut from these settings."""
        kv = None
        if self.max_kv_size is not None or self.kv_bits is not None:
            kv = KvOptions(self.max_kv_size, self.kv_bits, self.kv_group_size, self.quantized_kv_start)
        return EngineSettings(
            prefill_chunk_tokens=self.prefill_chunk_tokens, prefill_chunk_s=self.prefill_chunk_s, kv=kv, prefix_cache_entries=self.prefix_cache_entries,
            max_queued=self.max_queued_requests, queue_timeout_s=self.queue_timeout_s, micro_batches=self.micro_batches,
            max_batch_rows=self.max_batch_rows, interleaved_chunk_tokens=self.interleaved_chunk_tokens,
            num_draft=self.num_draft_tokens, failover_wait_s=self.failover_wait_s,
        )  # fmt: skip

    def read_api_keys(self) -> frozenset[str]:
        """The API keys of ``api_keys_file``; empty when none is set, which leaves /v1/* open."""
        return frozenset() if self.api_keys_file is None else read_api_keys_file(self.api_keys_file)


def read_secret_file(path: str | os.PathLike = DEFAULT_SECRET_FILE) -> bytes:
    """The cluster secret in ``path`` (surrounding whitespace stripped), checked.

    ``ringctl`` reads it with this too, so both refuse the same files: one
    missing, shorter than ``MIN_SECRET_BYTES``, or (on POSIX) one that group or
    others may read or write, since whoever reads it can join the ring.
    """
    path = Path(path).expanduser()
    quoted = shlex.quote(str(path))
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"secret_file: {path} is not a regular file")
        if os.name == "posix" and st.st_mode & 0o077:
            raise ConfigError(
                f"secret_file: {path} can be read or written by other users (mode {stat.S_IMODE(st.st_mode):03o}); "
                f"run: chmod 600 {quoted}"
            )
        secret = path.read_bytes().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"secret_file: cannot read {path}: no such file; create it (the same secret on every node): "
            f"mkdir -p {shlex.quote(str(path.parent))} && head -c 32 /dev/urandom | base64 > {quoted} && chmod 600 {quoted}"
        ) from None
    except OSError as e:
        raise ConfigError(f"secret_file: cannot read {path}: {e.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"secret_file: {path} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return secret


def read_api_keys_file(path: str | os.PathLike) -> frozenset[str]:
    """API keys, one a line; blank lines and lines starting with '#' are skipped.

    Errors name the file and the line, never the key: they end up in logs.
    """
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"api_keys_file: cannot read {path}: {e.strerror}") from None
    keys = set()
    # bytes.splitlines splits at \n, \r and \r\n only, so line numbers are an editor's.
    for number, raw in enumerate(data.splitlines(), 1):
        where = f"api_keys_file: {path}, line {number}"
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: not UTF-8 text") from None
        if not line or line.startswith("#"):
            continue
        # Clients send keys in an HTTP header (Authorization: Bearer KEY), where
        # only printable ASCII without spaces arrives intact.
        if not (line.isascii() and line.isprintable()) or " " in line:
            raise ConfigError(f"{where}: a key must be printable ASCII without spaces (the key is not shown here)")
        if len(line) < MIN_API_KEY_CHARS:
            raise ConfigError(
                f"{where}: a key must be at least {MIN_API_KEY_CHARS} characters (the key is not shown here); "
                "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        keys.add(line)
    if not keys:
        raise ConfigError(f"api_keys_file: {path} holds no keys (one a line; blank lines and # comments are skipped)")
    return frozenset(keys)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"key {key!r} on line {line} was given on line {first_line}")
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping.

    YAML requires unique keys, but PyYAML keeps the last one silently: a file
    with two ``ring_port:`` lines would run on a port its reader did not expect.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            # "<<: *defaults" merges are overridden on purpose; complex keys are
            # left to PyYAML, which refuses the unhashable ones.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1  # marks count from 0, editors from 1
            if key in first_lines:
                raise _DuplicateKey(key, line, first_lines[key])
            first_lines[key] = line
        return super().construct_mapping(node, deep)


def _from_string(key: Key, raw: str) -> Any:
    if key.kind in (int, float):
        try:
            return key.kind(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not {'an integer' if key.kind is int else 'a number'}") from None
    return raw


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per key; ``--peer`` is repeatable."""
    parser.add_argument("--config", metavar="FILE", help="YAML config file (see config/cluster.example.yaml)")
    for key in KEYS:
        if key.name == "peers":
            parser.add_argument("--peer", dest="peers", action="append", metavar="IP:PORT", help=key.help)
        else:
            parser.add_argument("--" + key.name.replace("_", "-"), dest=key.name, metavar=key.name.upper(), help=key.help)


def load(args: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> Config:
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    path = getattr(args, "config", None) or environ.get("RINGD_CONFIG")
    if path:
        try:
            data = yaml.load(Path(path).expanduser().read_text(), Loader=_UniqueKeyLoader)
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except _DuplicateKey as e:
            raise ConfigError(
                f"config file {path}, line {e.line}: key {e.key!r} is given twice (first on line {e.first_line}); keep one"
            ) from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
        for k, v in data.items():
            if k not in _BY_NAME:
                raise ConfigError(f"config file {path}: unknown key {k!r}; known keys: {', '.join(_BY_NAME)}")
            values[k], sources[k] = v, f"config file {path}"

    for key in KEYS:
        env = "RINGD_" + key.name.upper()
        if env in environ:
            try:
                values[key.name] = _from_string(key, environ[env])
            except ValueError as e:
                raise ConfigError(f"{env}: {e}") from None
            sources[key.name] = f"environment variable {env}"

    for key in KEYS:
        raw = getattr(args, key.name, None) if args is not None else None
        if raw is None:
            continue
        flag = "--peer" if key.name == "peers" else "--" + key.name.replace("_", "-")
        try:
            values[key.name] = raw if key.name == "peers" else _from_string(key, raw)
        except ValueError as e:
            raise ConfigError(f"{flag}: {e}") from None
        sources[key.name] = f"flag {flag}"

    checked: dict[str, Any] = {}
    for key in KEYS:
        # A copy, so that no Config shares (and could change) a default list.
        v = values.get(key.name, copy.deepcopy(key.default))
        try:
            checked[key.name] = key.check(v) if v is not None or key.default is not None else None
        except ValueError as e:
            raise ConfigError(f"{key.name} ({sources.get(key.name, 'default')}): {e}; got {v!r}") from None
    if checked["name"] is None:
        checked["name"] = check_name(re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname().split(".")[0]) or "node")
    cfg = Config(**checked)
    if cfg.nodes is not None and cfg.nodes < 1:
        raise ConfigError("nodes: must be at least 1")
    if cfg.dead_after_s <= cfg.heartbeat_interval_s:
        raise ConfigError(
            f"dead_after_s ({cfg.dead_after_s}) must be longer than heartbeat_interval_s ({cfg.heartbeat_interval_s}), "
            "or every peer looks dead between two heartbeats"
        )
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        given, missing = ("tls_cert", "tls_key") if cfg.tls_key is None else ("tls_key", "tls_cert")
        raise ConfigError(f"{given} is set but {missing} is not: a certificate needs its key, and the key its certificate; set both")
    if cfg.tls_cert is not None and cfg.tls == "auto":
        raise ConfigError(
            "tls: auto and tls_cert/tls_key both choose the API's certificate (auto issues one from the cluster CA, "
            "tls_cert is your own); keep one of them"
        )
    if cfg.split is not None and cfg.tensor_parallel == "auto":
        raise ConfigError("split fixes the ring's stages and tensor_parallel: auto chooses them; set one of the two")
    stages = cfg.expected_nodes // (1 if cfg.tensor_parallel == "auto" else cfg.tensor_parallel)
    if cfg.split is not None and len(cfg.split) != stages:
        raise ConfigError(
            f"split: {cfg.split} has {len(cfg.split)} entries for a ring of {stages} stages "
            "(the ring size is `nodes`, or the number of peers + 1 when `nodes` is not set, "
            "over tensor_parallel, the nodes of a stage)"
        )
    return cfg
