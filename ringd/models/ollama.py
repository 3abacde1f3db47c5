"""``ollama:NAME[:TAG]``: a model pulled with Ollama, served from the GGUF file in Ollama's own store.

Ollama keeps each pulled model as a manifest (JSON, one file per name and tag) that
names content-addressed blobs; the blob of the layer whose media type is
``application/vnd.ollama.image.model`` is the model's GGUF file, which ringd reads
in place (``gguf.py``): nothing is copied or converted, and Ollama need not be running.

Names are parsed as Ollama parses them (``types/model/name.go``):
``[host/][namespace/]model[:tag]``, with ``registry.ollama.ai``, ``library`` and
``latest`` for the parts left out, so ``ollama:smollm2`` is what ``ollama run
smollm2`` runs and ``ollama:user/model:tag`` what ``ollama run user/model:tag`` does.

It deliberately ignores the rest of an Ollama model: the template, parameters,
system prompt and license layers (the GGUF carries its own chat template and
tokenizer), a vision model's projector, adapters, and the newer ``kind`` segment of
names (skills, agents: not models). It checks a blob's size against its manifest
(an interrupted pull) but does not hash it: Ollama did at pull time, and reading
tens of GB at every start is not worth it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ringd.models.errors import ModelError

PREFIX = "ollama:"

# What a name leaves out (types/model/name.go: DefaultName).
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

# An Ollama manifest names a handful of layers, about a kilobyte of JSON: a file past this is no
# manifest, and is refused before it is read (a damaged or hostile store costs nothing).
MAX_MANIFEST_BYTES = 1 << 20
# The layer of a manifest that is the model's weights: a GGUF file.
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
GGUF_MAGIC = b"GGUF"

# Where the store is when OLLAMA_MODELS is not set: a user's Ollama (the macOS app,
# or `ollama serve` run by hand) keeps it under the home folder; the Linux install
# script's system service runs as the `ollama` user, whose home is /usr/share/ollama.
USER_STORE = Path(".ollama") / "models"  # in the home folder
SYSTEM_STORE = Path("/usr/share/ollama/.ollama/models")

# The parts' characters and lengths, as Ollama's isValidPart checks them: a letter,
# digit or _ first; then also - and . (not in a namespace), and : in a host (a port).
_PART = {
    "host": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*"), 350, "letters, digits, _, -, . and :"),
    "namespace": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*"), 80, "letters, digits, _ and -"),
    "model": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80, "letters, digits, _, - and ."),
    "tag": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80, "letters, digits, _, - and ."),
}
_SHA256 = re.compile(r"sha256:([0-9a-f]{64})")
_NAME_FORMS = "NAME, NAME:TAG, NAMESPACE/NAME:TAG or HOST/NAMESPACE/NAME:TAG"


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    def manifest(self, store: Path) -> Path:
        """Where Ollama writes this name's manifest (Name.Filepath)."""
        return store / "manifests" / self.host / self.namespace / self.model / self.tag

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"


def is_ollama_ref(model: str) -> bool:
    """Whether ``model`` names a model in the Ollama store (``ollama:NAME[:TAG]``)."""
    return model.startswith(PREFIX)


def parse_name(name: str) -> OllamaName:
    """An Ollama model name with its defaults filled in, as ``ParseName`` makes it; ModelError if invalid.

    The tag is after the last ":" if that comes after the last "/" (a host may carry a
    port); then the model, namespace and host are cut at the last "/" each, a host
    losing any ``scheme://``. A separator with nothing on one side is an invalid name.
    """
    s, parts = name, {}
    if s.rfind(":") > s.rfind("/"):
        s, _, parts["tag"] = s.rpartition(":")
    for kind in ("model", "namespace"):
        before, sep, after = s.rpartition("/")
        if not sep:
            parts[kind] = s
            break
        parts[kind], s = after, before
    else:
        parts["host"] = s.partition("://")[2] or s
    full = {"host": DEFAULT_HOST, "namespace": DEFAULT_NAMESPACE, "tag": DEFAULT_TAG, **parts}
    for kind, (pattern, max_len, allowed) in _PART.items():
        value = full[kind]
        if not (1 <= len(value) <= max_len and pattern.fullmatch(value)):
            shown = f"the {kind} {value!r}" if value else f"an empty {kind}"
            raise ModelError(
                f"{PREFIX}{name}: not an Ollama model name ({shown}: a {kind} is 1 to {max_len} of {allowed}, "
                f"starting with a letter, digit or _); names look like {_NAME_FORMS}"
            )
    return OllamaName(full["host"], full["namespace"], full["model"], full["tag"])


def store_dir(environ: Mapping[str, str] | None = None, *, name: str = "NAME") -> Path:
    """Ollama's model store: $OLLAMA_MODELS if set, else ~/.ollama/models, else the Linux
    system service's; ModelError naming each place looked in when there is none."""
    env = os.environ if environ is None else environ
    if env.get("OLLAMA_MODELS"):
        store = Path(env["OLLAMA_MODELS"]).expanduser()
        if not store.is_dir():
            raise ModelError(f"OLLAMA_MODELS is {store}, which is not a directory; point it at Ollama's model store, or unset it to use ~/{USER_STORE}")
        return store
    user = Path(env.get("HOME") or Path.home()) / USER_STORE
    for store in (user, SYSTEM_STORE):
        if store.is_dir():
            return store
    raise ModelError(
        f"no Ollama model store: OLLAMA_MODELS is not set and neither {user} nor {SYSTEM_STORE} exists; "
        f"install Ollama (https://ollama.com) and run `ollama pull {name}`, or set OLLAMA_MODELS to where its models are"
    )


def resolve(ref: str, models_dir: Path | None = None) -> Path:
    """The GGUF file of ``ollama:NAME[:TAG]`` in the Ollama store (``models_dir``, else ``store_dir()``).

    ModelError, naming what was looked for, where, and the ``ollama pull`` that fixes
    it, for a malformed name, no store, no manifest, a manifest without a model layer,
    a missing blob, a blob shorter or longer than its manifest says, or one that is
    not a GGUF file.
    """
    text = ref.removeprefix(PREFIX)
    name = parse_name(text)
    what = f"{PREFIX}{text}"
    pull = f"`ollama pull {text}`"
    store = Path(models_dir).expanduser() if models_dir is not None else store_dir(name=text)
    manifest_path = name.manifest(store)
    if not manifest_path.is_file():
        raise ModelError(f"{what}: no such model in the Ollama store {store} (no manifest {manifest_path}); {pull} fetches it, `ollama list` shows what is there")
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"over {MAX_MANIFEST_BYTES} bytes, where a manifest is about a kilobyte")
        manifest = json.loads(raw.decode())
        layers = [layer for layer in manifest.get("layers") or [] if isinstance(layer, dict)]
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError, RecursionError) as e:  # RecursionError: nested too deep
        raise ModelError(f"{what}: cannot read its manifest {manifest_path} ({e}); {pull} writes it again") from None
    layer = next((layer for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE), None)
    if layer is None:
        kinds = ", ".join(str(layer.get("mediaType")) for layer in layers) or "none"
        raise ModelError(f"{what}: its manifest {manifest_path} has no {MODEL_MEDIA_TYPE} layer (its layers: {kinds}); is it a model? {pull} rewrites it")
    digest = _SHA256.fullmatch(str(layer.get("digest")))
    if digest is None:
        raise ModelError(f"{what}: its manifest {manifest_path} gives the model layer the digest {layer.get('digest')!r}, not sha256:<64 hex digits>; {pull} rewrites it")
    # Blobs are named sha256-<hex>; older stores used sha256:<hex>, a name Windows does not allow.
    candidates = [store / "blobs" / f"sha256-{digest[1]}", store / "blobs" / f"sha256:{digest[1]}"]
    blob = next((path for path in candidates if path.is_file()), None)
    if blob is None:
        raise ModelError(f"{what}: the blob of its model layer is missing (no {candidates[0]}); {pull} fetches it again")
    size, expected = blob.stat().st_size, layer.get("size")
    if isinstance(expected, int) and size != expected:
        raise ModelError(f"{what}: its blob {blob} is {size} bytes, its manifest says {expected} (an interrupted pull?); {pull} completes it")
    with open(blob, "rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ModelError(f"{what}: its model blob {blob} is not a GGUF file (it does not start with 'GGUF'); ringd serves GGUF models")
    return blob
